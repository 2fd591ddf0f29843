"""The engine workers on a real local Ray cluster: a colocated actor/rollout/ref + critic group (2 CPU ranks)
and a rule-reward group (2 ranks), driven the way an RL step drives them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.fsdp import EngineConfig
from engines.models import tiny_qwen2_config
from engines.rollout import SamplingParams
from engines.tokenizer import CharTokenizer
from engines.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker
from orchestra import Batch, ResourcePool, WorkerGroup

pytestmark = pytest.mark.timeout(240)

TOK = CharTokenizer()
N_SAMPLES = 2
MAX_NEW = 6


# -- picklable callables (module level, imported by the workers) ------------------------------------------------------
def length_reward(texts, truths):
    """A reward every response gets a different value from: its decoded length over 10, plus 1 if it equals the truth."""
    return [len(t) / 10 + float(t == g) for t, g in zip(texts, truths)]


def pg_loss(outputs, mb):
    """Policy gradient with advantage 1 + score (always a non-zero gradient)."""
    m = mb["response_mask"].float()
    adv = 1.0 + mb["scores"][:, None]
    loss = -(adv * outputs["log_probs"] * m).sum() / m.sum().clamp(min=1)
    return loss, {"pg_loss": loss.detach()}


def value_loss(outputs, mb):
    """Regress values onto the token-level scores."""
    m = mb["response_mask"].float()
    return (((outputs["values"] - mb["token_level_scores"]) ** 2) * m).sum() / m.sum().clamp(min=1), {}


# -- fixtures -----------------------------------------------------------------------------------------------------------
def prompts(n: int = 4) -> Batch:
    texts = [f"{i}+{7 ** i}=" for i in range(n)]  # different lengths: left padding
    ids, mask = TOK.batch_encode(texts, padding_side="left", add_bos=True)
    return Batch.from_dict({"prompts": ids, "attention_mask": mask, "answer": [str(i + 7 ** i) for i in range(n)],
                            "uid": [f"u{i}" for i in range(n)]}, meta={"step": 0})


@pytest.fixture(scope="module")
async def groups():
    model = tiny_qwen2_config(vocab_size=TOK.vocab_size)
    cfg = EngineConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=4)
    sampling = SamplingParams(n=N_SAMPLES, max_new_tokens=MAX_NEW, temperature=1.0)
    views = WorkerGroup.colocate(
        ResourcePool(process_on_nodes=[2]), {"actor": ActorRolloutRefWorker, "critic": CriticWorker},
        group_name="ac",
        actor={"model": model, "seed": 3, "engine": cfg, "sampling": sampling, "tokenizer": TOK},
        critic={"model": model, "seed": 3, "engine": EngineConfig(lr=1e-3, micro_batch_size=4)},
    )
    reward = WorkerGroup(ResourcePool(process_on_nodes=[2]), RewardWorker, length_reward, "char", group_name="reward")
    await asyncio.gather(views["actor"].ready(), reward.ready())
    yield views["actor"], views["critic"], reward
    views["actor"].shutdown()
    reward.shutdown()


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


async def test_rl_step_end_to_end(groups, tmp_path):
    actor, critic, reward = groups
    data = prompts(4)
    assert await actor.weights_version() == 0

    # -- rollout streams 2 parts per rank; downstream calls take the future, not the payload
    gen = actor.generate(data, micro_batches=2)
    parts = [p async for p in gen]
    assert sorted((p.slot, p.seq, p.rows) for p in parts) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    old = actor.compute_log_prob(gen)
    ref = actor.compute_ref_log_prob(gen)
    values = critic.compute_values(gen)
    scores = reward.score(gen)
    streamed = reward.score.options(stream=True)(gen)  # one reward call per generated part, as parts arrive
    g, old_b, ref_b, val_b, sc_b, st_b = await asyncio.gather(gen, old, ref, values, scores, streamed)

    B = 4 * N_SAMPLES
    assert len(g) == B and g["responses"].shape == (B, MAX_NEW)
    assert g.meta == {"step": 0, "weights_version": 0}
    assert list(g["uid"]) == [f"u{i}" for i in range(4) for _ in range(N_SAMPLES)]
    assert list(g["answer"]) == [str(i + 7 ** i) for i in range(4) for _ in range(N_SAMPLES)]
    assert torch.equal(g["input_ids"], torch.cat([g["prompts"], g["responses"]], 1))
    rm = g["response_mask"]
    assert rm.sum() > 0 and (rm[:, :1] == 1).all()
    # weights synced: the trainer's log-probs reproduce the sampler's at temperature 1
    close(old_b["old_log_probs"], g["rollout_log_probs"])
    assert torch.equal(ref_b["ref_log_probs"], old_b["old_log_probs"])  # frozen copy of the same init
    assert val_b["values"].shape == (B, MAX_NEW) and torch.all(val_b["values"][rm == 0] == 0)
    # as the reward reads them: cut at <eos>, the other special tokens kept
    texts = [TOK.decode(TOK.truncate_at_eos(r[m.bool()]), skip_special_tokens=False)
             for r, m in zip(g["responses"], rm)]
    expect = torch.tensor(length_reward(texts, list(g["answer"])), dtype=torch.float32)
    assert torch.equal(sc_b["scores"], expect)
    last = rm.sum(-1) - 1
    assert torch.equal(sc_b["token_level_scores"][torch.arange(B), last], expect)
    assert sc_b["token_level_scores"].sum() == pytest.approx(expect.sum().item())
    assert st_b == sc_b

    # -- one actor update (data joined worker-to-worker: rollout | rewards) and one critic update
    m = await actor.update_actor(gen | scores, pg_loss)
    assert m["actor/weights_version"] == 1.0 and m["actor/optimizer_steps"] == 1.0
    assert m["actor/grad_norm"] > 0 and "actor/pg_loss" in m and m["actor/tokens"] == float(rm.sum())
    mc = await critic.update_critic(gen | scores, value_loss, mini_batches=2)
    assert mc["critic/optimizer_steps"] == 2.0 and mc["critic/loss"] > 0
    assert await actor.weights_version() == 1
    new_b = await actor.compute_log_prob(gen)
    assert (new_b["old_log_probs"] - old_b["old_log_probs"]).abs().max() > 1e-3  # the policy moved
    assert torch.equal((await actor.compute_ref_log_prob(gen))["ref_log_probs"], ref_b["ref_log_probs"])

    # -- the next rollout samples from the updated weights
    gen2 = actor.generate(data, micro_batches=2)
    g2, lp2 = await asyncio.gather(gen2, actor.compute_log_prob(gen2))
    assert g2.meta["weights_version"] == 1
    close(lp2["old_log_probs"], g2["rollout_log_probs"])
    assert not torch.equal(g2["responses"], g["responses"])  # a fresh seed per call

    # -- checkpoint round trip: weights, version and the sampling counter come back
    ckpt = str(tmp_path / "ckpt")
    assert await actor.save(ckpt) == [ckpt, ckpt]
    await critic.save(ckpt)
    g_after_save = await actor.generate(data)
    await actor.update_actor(gen | scores, pg_loss)
    assert await actor.weights_version() == 2
    assert await actor.load(ckpt) == [1, 1]
    assert await critic.load(ckpt) == [1, 1]
    assert await actor.weights_version() == 1
    restored = await actor.compute_log_prob(gen)
    assert torch.equal(restored["old_log_probs"], new_b["old_log_probs"])
    g_again = await actor.generate(data)  # same weights + same counter = same samples
    assert torch.equal(g_again["responses"], g_after_save["responses"])
    close(g_again["rollout_log_probs"], g_after_save["rollout_log_probs"], atol=1e-6)

    assert await actor.offload() == [0, 0] and await actor.onload() == [0, 0]  # CPU: nothing moves


async def test_errors_say_what_to_change(groups):
    actor, _, reward = groups
    with pytest.raises(Exception, match="fields are"):
        await actor.generate(prompts(2), temprature=0.5)
    with pytest.raises(Exception, match="answer_key"):
        await reward.score(Batch.from_dict({"responses": torch.ones(2, 3, dtype=torch.long),
                                            "response_mask": torch.ones(2, 3, dtype=torch.long)}))
    g = actor.generate(prompts(3), n=1)  # mini-batches are global slices: 3 rows cannot make 4, on either rank
    with pytest.raises(Exception, match="3 rows over 2 data-parallel rank.*mini_batches=4"):
        await actor.update_actor(g, pg_loss, mini_batches=4)
    assert len(await actor.compute_log_prob(g)) == 3  # no rank was left waiting in a collective


async def test_the_responses_of_one_prompt_each_hold_their_own_objects(groups):
    """Was: the n response rows of a prompt held one shared object (a dict written for one response changed the
    others): generate repeated the prompt's values with np.repeat, and the copy an await makes (clone, concat) deep-
    copied the whole column, which keeps that sharing. Both now copy each row's objects on their own."""
    actor, _, _ = groups
    data = prompts(2) | Batch.from_dict({"info": [{"prompt": 0, "notes": []}, {"prompt": 1, "notes": []}]})
    g = await actor.generate(data)
    assert [d["prompt"] for d in g["info"]] == [i for i in range(2) for _ in range(N_SAMPLES)]
    g["info"][0]["notes"].append("graded")
    assert [d["notes"] for d in g["info"]][1:] == [[]] * (2 * N_SAMPLES - 1)


def inplace_backward_loss_on_rank_1(outputs, mb):
    """Token-mean NLL, except on data-parallel rank 1, where the loss writes into a tensor its own backward needs:
    autograd raises inside that rank's backward, while rank 0 waits in the backward's gradient collectives."""
    import torch.distributed as dist

    m = mb["response_mask"].float()
    loss, metrics = -(outputs["log_probs"] * m).sum() / m.sum().clamp(min=1), {}
    if dist.get_rank() == 1:
        e = outputs["log_probs"].exp()
        loss = loss + e.sum() * 1e-3
        e.mul_(2.0)
    return loss, metrics


async def test_a_failure_inside_one_ranks_backward_fails_the_call_and_the_rank_is_declared_dead(groups):
    """Was: the call failed with rank 1's error, but rank 0 stayed in a gradient collective until the process group's
    timeout (30 minutes), and every later call on the group waited behind it; nothing said the group was wedged.
    Now rank 1 aborts its process groups and declares itself dead: supervision reports it, the group's calls fail
    with WorkerDiedError (``declared``), and closing the group ends both processes (rank 0's collective is released
    when rank 1's process ends). Runs last: it ends the shared group."""
    import anyio

    import orchestra as orc

    actor, critic, _ = groups
    told: list[orc.WorkerDiedError] = []
    seen = anyio.Event()
    actor.on_death(lambda err: (told.append(err), seen.set()))
    gen = actor.generate(prompts(4), n=1)
    await gen
    with pytest.raises(Exception, match=r"modified by an inplace operation") as failed:
        await actor.update_actor(gen, inplace_backward_loss_on_rank_1)  # rank 1's own error, or its death's
    assert "rank 1" in str(failed.value), failed.value
    with anyio.fail_after(60):  # a bound, not a measurement
        await seen.wait()
    assert told[0].rank == 1 and told[0].declared and "declared dead by its worker (role 'actor': FSDPEngine.train_step: rank 1 raised " \
        "RuntimeError inside train_step's collective work" in str(told[0]), told[0]
    with pytest.raises(orc.WorkerDiedError, match="modified by an inplace operation"):
        await actor.compute_log_prob(gen)
    with pytest.raises(orc.WorkerDiedError, match="declared dead"):
        await critic.compute_values(gen)  # colocated in the same processes
