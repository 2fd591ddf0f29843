"""RolloutEngine.load_weights checks every name, shape and dtype before it copies anything: weights it refuses leave
the rollout model exactly as it was (not half old, half new), and the error names the tensor."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import VOCAB

from engines.models import build_causal_lm, tiny_qwen2_config
from engines.rollout import RolloutEngine


def _setup() -> tuple[RolloutEngine, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cfg = tiny_qwen2_config(VOCAB)
    old = {k: v.clone() for k, v in build_causal_lm(cfg, seed=1).state_dict().items()}
    new = build_causal_lm(cfg, seed=2).state_dict()
    return RolloutEngine(build_causal_lm(cfg, seed=1), eos_token_id=2, pad_token_id=0), old, new


def _unchanged(ro: RolloutEngine, old: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, old[k]) for k, v in ro.model.state_dict().items())


def _extra(sd):
    return {**sd, "score.weight": torch.zeros(1, 64)}


def _missing(sd):
    return {k: v for k, v in sd.items() if k != "lm_head.weight"}


def _late_shape(sd):
    k = "model.layers.1.mlp.down_proj.weight"
    return {**sd, k: sd[k][:, :10]}


def _int_dtype(sd):
    k = "model.norm.weight"
    return {**sd, k: torch.ones_like(sd[k], dtype=torch.int64)}


def _not_a_tensor(sd):
    return {**sd, "model.norm.weight": [1.0] * 64}


@pytest.mark.parametrize("spoil,error,pattern", [
    (_extra, KeyError, r"names not in the rollout model.*score\.weight"),
    (_missing, KeyError, r"no weights given for.*lm_head\.weight"),
    (_late_shape, ValueError, r"model\.layers\.1\.mlp\.down_proj\.weight has shape \(64, 10\).*\(64, 128\)"),
    (_int_dtype, ValueError, r"model\.norm\.weight has dtype torch\.int64.*torch\.float32"),
    (_not_a_tensor, TypeError, r"model\.norm\.weight.*list"),
], ids=["extra", "missing", "shape", "dtype", "not_a_tensor"])
@pytest.mark.parametrize("streamed", [False, True], ids=["mapping", "stream"])
def test_refused_weights_leave_the_model_alone(spoil, error, pattern, streamed):
    ro, old, new = _setup()
    bad = spoil(new)
    with pytest.raises(error, match=pattern):
        ro.load_weights(iter(bad.items()) if streamed else bad)
    assert _unchanged(ro, old), "load_weights copied some tensors before refusing the rest"
    assert ro.load_weights(new) == len(new)  # good weights still load
    assert all(torch.equal(v, new[k]) for k, v in ro.model.state_dict().items())


def test_a_refused_sync_keeps_the_rollout_worker_on_its_weights_and_version():
    from engines.rollout_worker import RolloutWorker

    w = RolloutWorker.__new__(RolloutWorker)  # the endpoint's body, without a cluster
    ro, old, new = _setup()
    w.engine, w._version = ro, 3
    body = RolloutWorker.load_weights
    body = getattr(body, "__wrapped__", body)
    with pytest.raises(KeyError, match="score.weight"):
        body(w, _extra(new), 4)
    assert w._version == 3 and _unchanged(ro, old)
