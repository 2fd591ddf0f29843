"""Spawned-rank workers for the engine's multi-rank reduction tests.

Kept in its own module (not a test file) so that ranks spawned by ``engines.spawn`` can import them.
"""

from __future__ import annotations

from typing import Any

import torch
from engines_testutils import model_factory

from engines.fsdp import EngineConfig


def data_dependent_metric_loss(outputs, mb):
    """Token-mean NLL with a metric whose *name* depends on the data: ``long_frac`` (value 100) when the
    micro-batch has a response of 6 tokens or more, else ``short_frac`` (value 1)."""
    m = mb["response_mask"].float()
    loss = -(outputs["log_probs"] * m).sum() / m.sum()
    name = "long_frac" if bool((m.sum(-1) >= 6).any()) else "short_frac"
    return loss, {name: torch.tensor(100.0 if name == "long_frac" else 1.0)}


data_dependent_metric_loss.loss_scale = "tokens"


def masked_token_mean_loss(outputs, mb):
    """``-adv * logp`` averaged over the response tokens, 0 (not 0/0) for a micro-batch without one, as the
    pipelines' losses (``masked_mean``) give it."""
    m = mb["response_mask"].float()
    return -(mb["advantages"] * outputs["log_probs"] * m).sum() / m.sum().clamp(min=1.0), {}


def rows_with_response_length(n: int, length: int, R: int = 8, P: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` rows whose responses all have ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    rm = (torch.arange(R)[None] < length).long().repeat(n, 1)
    prompts = torch.randint(3, 64, (n, P), generator=g)
    resp = torch.randint(3, 64, (n, R), generator=g) * rm
    return {"prompts": prompts, "responses": resp, "input_ids": torch.cat([prompts, resp], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), rm], 1), "response_mask": rm}


def metric_keys_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 holds two rows of 8-token responses, rank 1 two rows of 2-token ones: the loss reports
    ``long_frac`` on rank 0 only and ``short_frac`` on rank 1 only. One train_step; its metrics."""
    from engines.fsdp import FSDPEngine

    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4), model_kind="causal_lm")
    batch = rows_with_response_length(2, 8 if rank == 0 else 2, seed=rank)
    return eng.train_step(batch, data_dependent_metric_loss)


def token_less_step_worker(rank: int, world: int) -> list[dict[str, Any]]:
    """Two train_steps after a normal one: first with no response token on any rank, then with none on rank 0
    only. Per step: its metrics, and whether the weights moved."""
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    eng = FSDPEngine(model_factory(0), EngineConfig(lr=1e-2, weight_decay=0.1, micro_batch_size=2))
    batch = make_batch(B=3, seed=rank)
    eng.train_step(batch, masked_token_mean_loss)
    masked = {**batch, "response_mask": torch.zeros_like(batch["response_mask"])}
    out = []
    for b in (masked, masked if rank == 0 else batch):
        before = eng.full_state_dict(rank0_only=False)
        m = eng.train_step(b, masked_token_mean_loss)
        after = eng.full_state_dict(rank0_only=False)
        out.append({"metrics": m, "moved": any(not torch.equal(before[k], after[k]) for k in before)})
    return out


def bad_mask_on_one_rank_worker(rank: int, world: int) -> dict[str, str]:
    """Rank 1's response_mask holds 0.5s, rank 0's is fine: train_step and compute_log_prob must raise on *every*
    rank (a rank that raised alone would leave the others waiting in a collective). The messages, per call."""
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    batch = make_batch(B=3, seed=rank)
    if rank == 1:
        batch["response_mask"] = batch["response_mask"] * 0.5
    out = {}
    for name, call in (("compute_log_prob", lambda: eng.compute_log_prob(batch)),
                       ("train_step", lambda: eng.train_step(batch, masked_token_mean_loss))):
        try:
            call()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


class _RaisesOnRank:
    """A token-mean loss that raises (or returns a loss detached from the outputs) on one rank, in one micro-batch."""

    def __init__(self, rank: int, micro: int, how: str) -> None:
        self.rank, self.micro, self.how, self.calls = rank, micro, how, 0

    def __call__(self, outputs, mb):
        import torch.distributed as dist

        i, self.calls = self.calls, self.calls + 1
        if dist.get_rank() == self.rank and i == self.micro:
            if self.how == "raise":
                raise ArithmeticError("my loss failed here")
            if self.how == "zero":  # a constant zero loss for this micro-batch: legal, it trains nothing
                return torch.zeros((), requires_grad=True), {}
            return outputs["log_probs"].detach().sum(), {}
        return masked_token_mean_loss(outputs, mb)


def loss_fails_on_one_rank_worker(rank: int, world: int, how: str, accumulate: bool = False,
                                  micro: int = 1) -> dict[str, object]:
    """Rank 1's loss fails in micro-batch ``micro``: every rank's train_step must raise at once (the process
    group's 60 s timeout is what a rank waiting in a collective would hit instead), nothing trained; then a good
    step on the same engine equals that step on a fresh engine (nothing of the failed step is left). ``how="zero"``:
    rank 1 returns a constant zero loss there instead, which is legal: the step must complete on every rank."""
    import datetime

    import torch
    import torch.distributed as dist

    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    batch = make_batch(B=6, seed=rank)
    cfg = EngineConfig(micro_batch_size=2, accumulate_without_sync=accumulate)
    eng = FSDPEngine(model_factory(0), cfg)
    before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    out: dict[str, object] = {}
    try:
        got = eng.train_step(batch, _RaisesOnRank(1, micro, how))
        out["error"] = ""
        out["failed_step_loss"] = torch.tensor([got["loss"], got["grad_norm"]])
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = f"{type(e).__name__}: {e}"
    out["step_after_failure"] = eng.global_step
    out["unchanged"] = all(torch.equal(v.detach(), before[k]) for k, v in eng.model.state_dict().items())
    good = eng.train_step(batch, masked_token_mean_loss)
    fresh = FSDPEngine(model_factory(0), cfg).train_step(batch, masked_token_mean_loss)
    out["good"] = torch.tensor([good["loss"], good["grad_norm"]])
    out["fresh"] = torch.tensor([fresh["loss"], fresh["grad_norm"]])
    return out


def refused_on_one_rank_worker(rank: int, world: int) -> dict[str, str]:
    """Rank 1's batch is bad in one way per call (a token id past the vocabulary, an empty batch, no responses),
    rank 0's is fine: each call must raise on *every* rank at once (the process group's 60 s timeout is what a rank
    left waiting in a collective would hit instead). The messages, per call."""
    import datetime

    import torch.distributed as dist

    from engines.fsdp import FSDPEngine
    from engines_testutils import VOCAB, make_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    good = make_batch(B=3, seed=rank)
    past = {**good, "responses": good["responses"].clone(), "input_ids": good["input_ids"].clone()}
    past["responses"][0, 0] = VOCAB
    past["input_ids"][0, good["prompts"].shape[1]] = VOCAB
    empty = {k: v[:0] for k, v in good.items()}
    no_responses = {k: v for k, v in good.items() if k != "responses"}
    float_ids = {**good, "input_ids": good["input_ids"].float()}
    flat_responses = {**good, "responses": good["responses"][0]}
    short_mask = {**good, "response_mask": good["response_mask"][:, :-1]}
    train = lambda b: eng.train_step(b, masked_token_mean_loss)  # noqa: E731
    calls = {"train_step past the vocabulary": (train, past),
             "compute_log_prob past the vocabulary": (eng.compute_log_prob, past),
             "compute_log_prob of an empty batch": (eng.compute_log_prob, empty),
             "compute_log_prob without responses": (eng.compute_log_prob, no_responses),
             "compute_log_prob of float ids": (eng.compute_log_prob, float_ids),
             "train_step of float ids": (train, float_ids),
             "compute_log_prob of 1-D responses": (eng.compute_log_prob, flat_responses),
             "compute_log_prob of a short mask": (eng.compute_log_prob, short_mask),
             "compute_log_prob of no batch": (eng.compute_log_prob, {}),
             "train_step of no batch": (train, {}),
             "train_step at lr nan": (lambda b: eng.train_step(b, masked_token_mean_loss,
                                                               lr=float("nan") if rank == 1 else 1e-4), good)}
    out = {}
    for name, (call, bad) in calls.items():
        try:
            call(bad if rank == 1 else good)
            out[name] = "accepted"
        except (KeyError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e.args[0] if e.args else e}"
    out["after"] = "ok" if eng.compute_log_prob(good) is not None else "?"  # still in step
    return out


class _FailsInsideOnRank:
    """A token-mean loss whose failure on ``rank`` comes from inside the collective work itself: ``backward`` (the
    loss writes into a tensor its own backward needs, so autograd raises in the backward), ``interrupt`` (a
    KeyboardInterrupt, which the loss agreement does not catch); in micro-batch 1."""

    def __init__(self, rank: int, how: str) -> None:
        self.rank, self.how, self.calls = rank, how, 0

    def __call__(self, outputs, mb):
        import torch.distributed as dist

        i, self.calls = self.calls, self.calls + 1
        loss, metrics = masked_token_mean_loss(outputs, mb)
        if dist.get_rank() == self.rank and i == 1:
            if self.how == "interrupt":
                raise KeyboardInterrupt("stopped inside my loss")
            e = outputs["log_probs"].exp()
            loss = loss + e.sum() * 1e-3
            e.mul_(2.0)  # exp's backward needs its output: autograd raises "modified by an inplace operation"
        return loss, metrics


def collective_failure_on_one_rank_worker(rank: int, world: int, where: str) -> dict[str, str]:
    """Rank 1 fails inside the collective work of a call (``where``: "backward" or "interrupt" in train_step,
    "forward" in train_step's or "log_prob_forward" in compute_log_prob's model forward), rank 0 does not. Every
    rank must raise at once, rank 1 its own error, the others one naming it (the process group's 60 s timeout is
    what a rank left waiting in a collective hits instead), and a later call on the engine must be refused at once
    on every rank. Per rank: the error text (type: message, notes), and the later call's."""
    import datetime

    import torch.distributed as dist

    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    aborted: list[str] = []
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2), on_abort=aborted.append)
    batch = make_batch(B=6, seed=rank)
    if rank == 1 and where in ("forward", "log_prob_forward"):
        layer = eng.model.model.layers[0]
        forward, calls = layer.forward, [0]

        def failing(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise FloatingPointError("my model failed in its forward")
            return forward(*a, **k)

        layer.forward = failing
    if where == "log_prob_forward":
        return _failure_outcomes(lambda: eng.compute_log_prob(batch), eng, batch, aborted)
    return _failure_outcomes(lambda: eng.train_step(batch, _FailsInsideOnRank(1, where)), eng, batch, aborted)


def _failure_outcomes(call: Any, eng: Any, batch: Any, aborted: list[str]) -> dict[str, str]:
    """What ``call()`` raised on this rank (type: message, notes; "" if nothing), what a later train step raised,
    and what ``on_abort`` was told."""
    def text(e: BaseException) -> str:
        return f"{type(e).__name__}: {e}" + "".join(f"\nnote: {n}" for n in getattr(e, "__notes__", ()))

    out: dict[str, str] = {}
    try:
        call()
        out["error"] = ""
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result (a KeyboardInterrupt too)
        out["error"] = text(e)
    try:
        eng.train_step(batch, masked_token_mean_loss)
        out["later"] = ""
    except BaseException as e:  # noqa: BLE001
        out["later"] = text(e)
    out["on_abort"] = "\n".join(aborted)
    return out


def save_fails_on_one_rank_worker(rank: int, world: int, directory: str, where: str) -> dict[str, Any]:
    """One rank cannot write its part of a checkpoint: ``shard`` (rank 1's shard file: a full disk), ``index``
    (rank 0's index and state JSON). Every rank must raise at once (the process group's 60 s timeout is what a rank
    left waiting in the save's collectives hits instead), and the engine must still work: a train step, then a save
    to another directory that loads back. Per rank: the error text, whether the later step and save worked."""
    import datetime
    import os

    import safetensors.torch
    import torch.distributed as dist

    import engines.checkpoint as ckpt
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    batch = make_batch(B=4, seed=rank)
    eng.train_step(batch, masked_token_mean_loss)
    real_save_file, real_write_json = safetensors.torch.save_file, ckpt.write_json_atomic

    def full_disk(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    if where == "shard" and rank == 1:
        safetensors.torch.save_file = full_disk
    if where == "index" and rank == 0:
        ckpt.write_json_atomic = full_disk
    out: dict[str, Any] = {}
    try:
        eng.save(os.path.join(directory, "bad"))
        out["error"] = ""
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = f"{type(e).__name__}: {e}"
    safetensors.torch.save_file, ckpt.write_json_atomic = real_save_file, real_write_json
    out["step_after"] = eng.train_step(batch, masked_token_mean_loss)["step"]
    eng.save(os.path.join(directory, "good"))
    eng.load(os.path.join(directory, "good"))
    out["loaded_step"] = eng.global_step
    return out


def load_fails_after_its_checks_on_one_rank_worker(rank: int, world: int, directory: str) -> dict[str, str]:
    """Rank 1's load fails after every check passed, while it copies the checkpoint into its shards (an allocation
    failure: a ``MemoryError``), with some of them already overwritten. Its engine is then half-loaded: it must never
    train again, and neither may its peers, whose shards belong to the same model. Per rank: the load's error text,
    a later train step's, and what ``on_abort`` was told."""
    import datetime
    import os

    import torch.distributed as dist

    import engines.checkpoint as ckpt
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    aborted: list[str] = []
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2), on_abort=aborted.append)
    batch = make_batch(B=4, seed=rank)
    eng.train_step(batch, masked_token_mean_loss)
    eng.save(os.path.join(directory, "ckpt"))
    eng.train_step(batch, masked_token_mean_loss)  # the weights move on from the checkpoint's
    if rank == 1:
        read, reads = ckpt._Shards.read, [0]

        def failing(self: Any, *a: Any, **k: Any) -> Any:
            reads[0] += 1
            if reads[0] == 3:
                raise MemoryError("could not allocate while copying the checkpoint")
            return read(self, *a, **k)

        ckpt._Shards.read = failing
    return _failure_outcomes(lambda: eng.load(os.path.join(directory, "ckpt")), eng, batch, aborted)


def update_prep_fails_on_one_rank_worker(rank: int, world: int) -> dict[str, str]:
    """Rank 1 fails in a worker's update before the engine's first collective (its mini-batch split raises, as an
    arange counting backwards once did), rank 0 does not and goes on into the update's collectives. Every rank must
    raise at once, rank 1 its own error, rank 0 one naming it (not the process group's 60 s timeout), and a later
    call must be refused. Per rank: the error text, the later call's, and what ``on_abort`` was told."""
    import datetime

    import torch.distributed as dist

    import engines.workers as workers
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch
    from orchestra import Batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    aborted: list[str] = []
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2), on_abort=aborted.append)
    tensors = make_batch(B=6, seed=rank)
    if rank == 1:
        def split_fails(*a: Any, **k: Any) -> Any:
            raise RuntimeError("upper bound and lower bound inconsistent with step sign")

        workers._mini_batches = split_fails
    return _failure_outcomes(
        lambda: workers._train(eng, Batch.from_dict(tensors), masked_token_mean_loss, 1, 2, "actor", "update_actor"),
        eng, tensors, aborted)


def update_refused_alike_on_every_rank_worker(rank: int, world: int) -> dict[str, str]:
    """Every rank's update is refused alike for an argument (temperature 0) before any collective: each raises the
    ValueError and the engine goes on (a later update trains). Per rank: the error text and the later call's."""
    import datetime

    import torch.distributed as dist

    import engines.workers as workers
    from engines.fsdp import FSDPEngine
    from engines_testutils import make_batch
    from orchestra import Batch

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    eng = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=2))
    batch = Batch.from_dict(make_batch(B=4, seed=rank))
    out: dict[str, str] = {}
    for key, temperature in (("error", 0.0), ("later", None)):
        kw = {} if temperature is None else {"temperature": temperature}
        try:
            workers._train(eng, batch, masked_token_mean_loss, 1, 2, "actor", "update_actor", **kw)
            out[key] = ""
        except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
            out[key] = f"{type(e).__name__}: {e}"
    return out
