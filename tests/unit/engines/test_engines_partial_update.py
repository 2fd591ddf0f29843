"""What an update leaves behind when it fails part-way, and metric names a loss_fn may not take. An
``update_actor`` whose later mini-batch fails (an agreed, recoverable error) has already stepped the optimizer on the
earlier ones: the weights version was bumped only on success, so the next ``generate`` did not sync the rollout
model and sampled with stale weights, stamping them with the old version. A loss_fn metric named ``loss`` was added
into the step's reported loss (twice the loss), and ones named like train_step's other results were overwritten."""

from __future__ import annotations

import pytest
import torch
from engines_testutils import make_batch, model_factory, token_mean_loss

from engines.fsdp import EngineConfig, FSDPEngine
from engines.models import tiny_qwen2_config
from engines.rollout import SamplingParams
from engines.tokenizer import CharTokenizer
from engines.workers import ActorRolloutRefWorker
from orchestra import Batch, ResourcePool, WorkerGroup, endpoint
from orchestra import dispatch as D

TOK = CharTokenizer()


class _Probe(ActorRolloutRefWorker):
    @endpoint(D.broadcast())
    def weight_gap(self) -> float:
        """The largest difference between the actor's weights and the rollout model's."""
        a = self.actor.full_state_dict(rank0_only=False)
        r = self.rollout.model.state_dict()
        return max(float((a[k] - r[k]).abs().max()) for k in a)


def _fails_on_tagged_rows(outputs, mb):
    m = mb["response_mask"].float()
    if bool((mb["tag"] == 1).any()):
        raise ValueError("bad mini-batch")
    return -(outputs["log_probs"] * m).sum() / m.sum().clamp(min=1), {}


async def test_an_update_that_fails_after_an_optimizer_step_still_moves_the_weights_version():
    ids, mask = TOK.batch_encode(["1+1=", "2+2="], padding_side="left", add_bos=True)
    prompts = Batch.from_dict({"prompts": ids, "attention_mask": mask})
    async with WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01, backend="local"), _Probe,
                           model=tiny_qwen2_config(vocab_size=TOK.vocab_size), seed=3,
                           engine=EngineConfig(lr=1e-2, micro_batch_size=4),
                           sampling=SamplingParams(n=2, max_new_tokens=4), tokenizer=TOK, with_ref=False) as g:
        roll = await g.generate(prompts)
        assert await g.weight_gap() == [0.0]
        b = roll.select(*roll.tensors.keys())
        b["tag"] = torch.tensor([0.0, 1.0, 0.0, 1.0])  # mini-batch 0 (rows 0, 2) steps, mini-batch 1 fails
        with pytest.raises(Exception, match="bad mini-batch"):
            await g.update_actor(b, _fails_on_tagged_rows, mini_batches=2)
        assert await g.weights_version() == 1  # the weights moved: one optimizer step
        again = await g.generate(prompts)
        assert await g.weight_gap() == [0.0]  # the rollout model was synced before sampling
        assert again.meta["weights_version"] == 1


def _with_metric(name: str):
    def loss_fn(outputs, mb):
        loss, _ = token_mean_loss(outputs, mb)
        return loss, {name: loss.detach()}
    return loss_fn


@pytest.mark.parametrize("name", ["loss", "grad_norm", "lr", "tokens", "rows", "micro_batches", "step", "skipped"])
def test_a_loss_fn_metric_named_like_train_steps_own_results_is_refused(name):
    engine = FSDPEngine(model_factory(0), EngineConfig(lr=1e-3, micro_batch_size=2))
    before = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    with pytest.raises(ValueError, match=rf"loss_fn returned metric\(s\) \['{name}'\].*rename"):
        engine.train_step(make_batch(B=4, seed=1), _with_metric(name))
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.global_step == 0  # nothing trained
    ok = engine.train_step(make_batch(B=4, seed=1), _with_metric("pg_loss"))
    assert ok["pg_loss"] == pytest.approx(ok["loss"])


def test_a_token_less_optimizer_step_does_not_dilute_the_updates_loss_and_grad_norm():
    """A mini-batch without a response token trains nothing (skipped=1) and reports loss 0 and grad_norm 0: those
    were averaged into the update's ``actor/loss`` and ``actor/grad_norm`` as if measured (half the loss here),
    while the loss_fn's own metrics left the step out."""
    from engines.workers import _train

    data = make_batch(B=4, seed=2)
    data["response_mask"][1::2] = 0  # mini-batch 1 of 2 (rows 1, 3) has no response token
    batch = Batch.from_dict(data)
    update = _train(FSDPEngine(model_factory(0), EngineConfig(lr=1e-3, micro_batch_size=2)), batch,
                    _with_metric("pg_loss"), 1, 2, "actor", "update_actor")
    alone = FSDPEngine(model_factory(0), EngineConfig(lr=1e-3, micro_batch_size=2)).train_step(
        batch.slice(0, 4)[torch.tensor([0, 2])].tensors, _with_metric("pg_loss"))
    assert update["actor/skipped"] == 1.0 and update["actor/optimizer_steps"] == 2.0
    assert update["actor/loss"] == pytest.approx(alone["loss"]) == pytest.approx(update["actor/pg_loss"])
    assert update["actor/grad_norm"] == pytest.approx(alone["grad_norm"])
