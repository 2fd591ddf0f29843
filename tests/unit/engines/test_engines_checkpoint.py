"""FSDPEngine checkpoints: safetensors shards + JSON, never pickle; round trips on 1 and 2 ranks, resharding,
and loud, named failures for corrupt, truncated, foreign or booby-trapped files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_testutils import Payload, engine_snapshot, load_error_worker, payload_worker, save_then_load_worker
from engines_testutils import VOCAB, make_batch, model_factory, token_mean_loss

from engines._dist import spawn
from engines.checkpoint import CheckpointError
from engines.fsdp import EngineConfig, FSDPEngine
from engines.models import build_causal_lm, tiny_qwen2_config

pytestmark = pytest.mark.timeout(300)  # a bound on a hang; spawns take minutes on a loaded 2-core box

CFG = EngineConfig(lr=1e-3, warmup_steps=3, micro_batch_size=2, weight_decay=0.01, betas=(0.8, 0.95))


def _assert_snapshots_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for k in a["optim"]:
        va, vb = a["optim"][k], b["optim"][k]
        assert (torch.equal(va, vb) and va.dtype == vb.dtype) if isinstance(va, torch.Tensor) else va == vb, k
    assert a["groups"] == b["groups"]
    assert (a["step"], a["lr"]) == (b["step"], b["lr"])


def _trained_engine(seed: int = 0, steps: int = 2) -> FSDPEngine:
    eng = FSDPEngine(model_factory(seed), CFG)
    batch = make_batch(B=4, seed=5)
    for _ in range(steps):
        eng.train_step(batch, token_mean_loss)
    return eng


@pytest.fixture(scope="module")
def two_rank_round_trip(tmp_path_factory) -> tuple[list[dict], Path]:
    """One 2-rank ``save_then_load_worker`` run for the module (a spawn costs a fresh torch process per rank): each
    rank's results, and the 2-rank checkpoint it saved (after two steps). Tests copy the checkpoint before changing
    it."""
    ckpt = tmp_path_factory.mktemp("two_rank") / "ckpt"
    return spawn(save_then_load_worker, 2, CFG, str(ckpt)), ckpt


@pytest.fixture(scope="module")
def two_rank_saved(two_rank_round_trip) -> Path:
    """The module's 2-rank checkpoint (never changed: tests take ``two_rank_ckpt``, a copy, to change it)."""
    return two_rank_round_trip[1]


@pytest.fixture
def two_rank_ckpt(two_rank_saved, tmp_path) -> Path:
    """This test's own copy of the module's 2-rank checkpoint."""
    return Path(shutil.copytree(two_rank_saved, tmp_path / "ckpt"))


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(str(marker)), protocol=4)


def test_one_rank_round_trip_restores_model_optimizer_and_schedule(tmp_path):
    a = _trained_engine(0)
    a.save(tmp_path / "ckpt")
    b = FSDPEngine(model_factory(9), CFG)
    b.load(tmp_path / "ckpt")
    _assert_snapshots_equal(engine_snapshot(a), engine_snapshot(b))
    assert b.global_step == 2 and b.lr == pytest.approx(CFG.lr)
    batch = make_batch(B=4, seed=6)
    assert a.train_step(batch, token_mean_loss) == b.train_step(batch, token_mean_loss)
    _assert_snapshots_equal(engine_snapshot(a), engine_snapshot(b))


@pytest.mark.parametrize("other", [{"num_attention_heads": 8, "num_key_value_heads": 4}, {"rope_theta": 1e5},
                                   {"hidden_act": "gelu"}, {"rms_norm_eps": 1e-3}], ids=str)
def test_a_checkpoint_of_a_model_with_other_settings_but_the_same_shapes_is_refused(tmp_path, other):
    """Only the tensors' names, shapes and dtypes were compared: a model of 8 heads loaded a 4-head model's weights
    (the same shapes) without a word, and computed other logits with them."""
    _trained_engine(0).save(tmp_path / "ckpt")
    eng = FSDPEngine(lambda: build_causal_lm(tiny_qwen2_config(VOCAB, **other), seed=9), CFG)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="another model") as e:
        eng.load(tmp_path / "ckpt")
    for k, v in other.items():
        assert k in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())  # nothing was loaded
    FSDPEngine(model_factory(9), CFG).load(tmp_path / "ckpt")  # the same settings load


def test_loading_under_another_lr_schedule_says_which_fields_differ(tmp_path, caplog):
    import dataclasses

    _trained_engine(0).save(tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="orchestra"):
        FSDPEngine(model_factory(9), CFG).load(tmp_path / "ckpt")
    assert not [r for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    other = dataclasses.replace(CFG, schedule_start=3, warmup_steps=CFG.warmup_steps + 1)
    with caplog.at_level("WARNING", logger="orchestra"):
        FSDPEngine(model_factory(9), other).load(tmp_path / "ckpt")
    (msg,) = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    assert "schedule_start: 0 -> 3" in msg and f"warmup_steps: {CFG.warmup_steps} -> {CFG.warmup_steps + 1}" in msg


def _load_worker(rank: int, world: int, ckpt_dir: str, other: EngineConfig) -> dict:
    """Load ``ckpt_dir`` into a fresh engine under ``CFG`` and snapshot it; then load it into another fresh engine
    under ``other`` and keep this rank's "learning-rate schedule" records of that load as (level, message)."""
    import logging

    eng = FSDPEngine(model_factory(4), CFG)
    eng.load(ckpt_dir)
    snapshot = engine_snapshot(eng)

    records: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "learning-rate schedule" in record.getMessage():
                records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("orchestra")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    FSDPEngine(model_factory(4), other).load(ckpt_dir)
    return {"snapshot": snapshot, "schedule_records": records}


@pytest.fixture(scope="module")
def one_rank_into_two(tmp_path_factory) -> tuple[dict, list[dict]]:
    """A 1-rank checkpoint saved here (one step), loaded by both ranks of one 2-rank spawn (``_load_worker``, once
    for the module: a spawn costs a fresh torch process per rank): the saved engine's snapshot, and each rank's
    snapshot after loading under ``CFG`` and its schedule records after loading under ``CFG`` with one more warmup
    step."""
    import dataclasses

    ckpt = tmp_path_factory.mktemp("one_rank") / "ckpt"
    saved = _trained_engine(0, steps=1)
    saved.save(ckpt)
    other = dataclasses.replace(CFG, warmup_steps=CFG.warmup_steps + 1)
    return engine_snapshot(saved), spawn(_load_worker, 2, str(ckpt), other)


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_a_two_rank_load_under_another_lr_schedule_warns_once(one_rank_into_two):
    """Both ranks find the same difference; rank 0 warns and rank 1 says it at DEBUG only, so a group's load
    gives one warning, not one per rank."""
    import logging

    _, res = one_rank_into_two
    r0, r1 = (r["schedule_records"] for r in res)
    assert [level for level, _ in r0] == [logging.WARNING] and [level for level, _ in r1] == [logging.DEBUG]
    assert r0[0][1] == r1[0][1] and f"warmup_steps: {CFG.warmup_steps} -> {CFG.warmup_steps + 1}" in r0[0][1]


def test_only_rank_0_warns_of_another_lr_schedule(caplog):
    """The rule the two-rank test shows, in process: a rank other than 0 logs the difference at DEBUG."""
    import dataclasses

    from engines.fsdp import _warn_schedule_change

    saved = dataclasses.asdict(CFG)
    other = dataclasses.replace(CFG, total_steps=10, lr_schedule="cosine")
    with caplog.at_level("DEBUG", logger="orchestra"):
        _warn_schedule_change(saved, other, "ckpt", 1)
        _warn_schedule_change(saved, other, "ckpt", 0)
    assert [(r.levelname, "learning-rate schedule" in r.getMessage()) for r in caplog.records] == [
        ("DEBUG", True), ("WARNING", True)]


def test_checkpoint_holds_only_safetensors_and_json(tmp_path):
    from safetensors import safe_open

    _trained_engine(0, steps=1).save(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["engine_state.json", "index.json", "model-rank00000-of-00001.safetensors",
                     "optim-rank00000-of-00001.safetensors"]
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert index["world_size"] == 1
    entry = index["tensors"]["model/model.embed_tokens.weight"]
    assert entry["shape"] == [VOCAB, 64] and entry["dtype"] == "float32"
    assert entry["placement"] == {"kind": "shard", "dim": 0}
    assert entry["shards"] == [{"rank": 0, "file": "model-rank00000-of-00001.safetensors", "offset": [0, 0],
                                "shape": [VOCAB, 64]}]
    with safe_open(str(tmp_path / "ckpt" / "optim-rank00000-of-00001.safetensors"), "pt") as f:
        assert "optim/model.embed_tokens.weight/exp_avg" in f.keys()
    state = json.loads((tmp_path / "ckpt" / "engine_state.json").read_text())
    assert state["global_step"] == 1
    assert state["optimizer"]["scalars"]["model.embed_tokens.weight"]["step"] == {"value": 1.0, "dtype": "float32"}
    assert state["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.95]


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_two_rank_round_trip_and_reshard_to_one_rank(two_rank_round_trip):
    res, ckpt = two_rank_round_trip
    for r in res:  # every rank restored the same full state
        _assert_snapshots_equal(r["saved"], r["loaded"])
        ma, mb = r["metrics"]
        assert ma == mb
        for k, v in r["after"][0].items():
            assert torch.equal(v, r["after"][1][k]), k
    index = json.loads((ckpt / "index.json").read_text())
    shards = index["tensors"]["model/model.embed_tokens.weight"]["shards"]
    assert [(s["rank"], s["offset"], s["shape"]) for s in shards] == [(0, [0, 0], [32, 64]), (1, [32, 0], [32, 64])]
    # the 2-rank checkpoint loads into a 1-rank engine (this process): every shard lands in place
    one = FSDPEngine(model_factory(5), CFG)
    one.load(ckpt)
    _assert_snapshots_equal(res[0]["saved"], engine_snapshot(one))


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_one_rank_checkpoint_loads_into_two_ranks(one_rank_into_two):
    saved, res = one_rank_into_two
    for r in res:
        _assert_snapshots_equal(saved, r["snapshot"])


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_planted_pickle_in_every_binary_file_never_runs(tmp_path, two_rank_ckpt):
    ckpt = two_rank_ckpt
    probe = tmp_path / "probe"
    pickle.loads(_pickle_payload(probe))  # the payload is live: unpickling it does run code
    assert probe.exists()

    marker = tmp_path / "marker"
    payload = _pickle_payload(marker)
    binaries = [p for p in ckpt.iterdir() if p.suffix != ".json"]
    assert len(binaries) == 4  # model + optim shard per rank
    for p in binaries:
        p.write_bytes(payload)
    for name in (".metadata", "__0_0.distcp"):  # what torch.distributed.checkpoint would have unpickled
        (ckpt / name).write_bytes(payload)
    eng = FSDPEngine(model_factory(1), CFG)
    with pytest.raises(CheckpointError, match=r"rank0000\d-of-00002\.safetensors.*(sha256|size)"):
        eng.load(ckpt)
    assert not marker.exists()
    # an attacker who also rewrites the index hashes still gets nothing run: the format is not pickle
    index = json.loads((ckpt / "index.json").read_text())
    for name in index["files"]:
        index["files"][name] = {"bytes": len(payload), "sha256": _sha256(payload)}
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\.safetensors is not a valid safetensors file"):
        eng.load(ckpt)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        eng.load(ckpt, verify=False)
    assert not marker.exists()


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_corrupt_tensor_bytes_with_intact_header_are_detected(tmp_path):
    ckpt = tmp_path / "ckpt"
    _trained_engine(0, steps=1).save(ckpt)
    shard = ckpt / "model-rank00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)  # tensor bytes zeroed, header untouched: still a valid safetensors file
    shard.write_bytes(bytes(data))
    eng = FSDPEngine(model_factory(1), CFG)
    with pytest.raises(CheckpointError, match=r"model-rank00000-of-00001\.safetensors.*sha256"):
        eng.load(ckpt)


@pytest.mark.parametrize("name", ["index.json", "engine_state.json"])
def test_truncated_json_error_names_the_file(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    _trained_engine(0, steps=1).save(ckpt)
    text = (ckpt / name).read_text()
    (ckpt / name).write_text(text[: len(text) // 2])
    eng = FSDPEngine(model_factory(1), CFG)
    with pytest.raises(CheckpointError, match=rf"{name}.*not valid JSON"):
        eng.load(ckpt)


def test_missing_directory_is_not_a_checkpoint(tmp_path):
    eng = FSDPEngine(model_factory(1), CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"index\.json.*missing"):
        eng.load(tmp_path / "empty")


def test_load_into_another_model_names_the_mismatch(tmp_path):
    ckpt = tmp_path / "ckpt"
    _trained_engine(0, steps=1).save(ckpt)
    wider = FSDPEngine(lambda: build_causal_lm(tiny_qwen2_config(VOCAB * 2), seed=0), CFG)
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight.*\[64, 64\].*\[128, 64\]"):
        wider.load(ckpt)


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_shard_file_swapped_between_ranks_is_rejected(two_rank_ckpt):
    ckpt = two_rank_ckpt
    a, b = ckpt / "model-rank00000-of-00002.safetensors", ckpt / "model-rank00001-of-00002.safetensors"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    eng = FSDPEngine(model_factory(1), CFG)
    with pytest.raises(CheckpointError, match=r"model-rank0000\d-of-00002\.safetensors.*sha256"):
        eng.load(ckpt)


def test_load_keeps_working_after_failed_load(tmp_path):
    """A refused checkpoint leaves the engine as it was (the checks run before any tensor is touched)."""
    ckpt = tmp_path / "ckpt"
    _trained_engine(0, steps=1).save(ckpt)
    (ckpt / "optim-rank00000-of-00001.safetensors").write_bytes(b"\x00" * 16)
    eng = FSDPEngine(model_factory(1), CFG)
    before = engine_snapshot(eng)
    with pytest.raises(CheckpointError):
        eng.load(ckpt)
    after = engine_snapshot(eng)
    for k in before["model"]:
        assert torch.equal(before["model"][k], after["model"][k]), k
    assert eng.global_step == 0
    assert os.path.exists(ckpt / "index.json")


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_spawn_results_are_read_without_running_code(tmp_path):
    marker = tmp_path / "marker"
    with pytest.raises(Exception, match="exec"):  # weights_only refuses the global instead of calling it
        spawn(payload_worker, 1, str(marker))
    assert not marker.exists()


@pytest.mark.slow  # spawns fresh processes (each imports torch)
def test_a_shard_only_one_rank_reads_is_corrupt_so_no_rank_loads(two_rank_ckpt):
    ckpt = two_rank_ckpt
    shard = ckpt / "optim-rank00001-of-00002.safetensors"  # read by rank 1 only
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"  # a NaN where an Adam moment was
    shard.write_bytes(bytes(data))
    r0, r1 = spawn(load_error_worker, 2, CFG, str(ckpt))
    assert "optim-rank00001-of-00002.safetensors" in r1["error"] and "sha256" in r1["error"]
    assert "another rank found this checkpoint unusable" in r0["error"]
    assert r0["unchanged"] and r1["unchanged"] and r0["step"] == r1["step"] == 0
