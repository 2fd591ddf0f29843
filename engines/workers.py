"""Workers that put the engines on the cluster: one process per rank, endpoints dispatched over the group.

- :class:`ActorRolloutRefWorker` — trainable FSDP actor + in-process rollout copy (weights synced lazily from the
  actor) + optional frozen reference model; mesh ``"actor"``.
- :class:`CriticWorker` — FSDP value model; mesh ``"critic"``.
- :class:`RewardWorker` — rule-based rewards on CPU; :class:`RewardModelWorker` — a reward model, one copy per rank.

The workers know no RL algorithm: losses are picklable ``loss_fn(outputs, micro_batch) -> (loss, metrics)``
callables passed by the caller (broadcast next to the sharded batch; see ``engines.fsdp`` for the weighting).
Batch layout as in ``engines/__init__.py``.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from engines._dist import agreed
from engines.fsdp import EngineConfig, FSDPEngine, LossFn
from engines.rollout import RolloutEngine, SamplingParams
from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D

__all__ = [
    "ActorRolloutRefWorker",
    "CriticWorker",
    "RewardModelWorker",
    "RewardWorker",
    "generation_seed",
    "load_tokenizer",
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ModelConfig = Mapping[str, Any] | Any | None  # dict of tiny-Qwen2 overrides, a PretrainedConfig, or None


# ---------------------------------------------------------------------------------------------------------- helpers
def load_tokenizer(tokenizer: Any) -> Any:
    """``"char"`` -> CharTokenizer, another string -> a local HF tokenizer (name or path), an object -> itself."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if str(tokenizer) == "char":
        from engines.tokenizer import CharTokenizer

        return CharTokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True)
    except OSError as e:
        raise ValueError(f"tokenizer {tokenizer!r} is not available locally; pass 'char', a local directory, or a "
                         f"tokenizer object") from e


def generation_seed(base: int, dp_rank: int, call: int | Sequence[int]) -> int:
    """The sampling seed of a generate call on DP rank ``dp_rank`` (a hash, < 2**63). ``call``: the call's number
    on this rank (an int), or its key in the caller's numbering (a sequence of ints >= 0, e.g. the runner's step and
    round: the seed then does not depend on which calls came before it). Every bit of ``base`` counts (a seed of
    2**32 is not 0's)."""
    if int(base) < 0:
        raise ValueError(f"generation_seed: the base seed must be >= 0, got {base}")
    if isinstance(call, Sequence):
        key = [int(k) for k in call]
        if not key or min(key) < 0:
            raise ValueError(f"generation_seed: a call key must be a non-empty sequence of ints >= 0, got {call!r}")
        # tagged by its length (SeedSequence ignores trailing zero words): no key's entropy is a counter's
        entropy = [int(base), int(dp_rank), *key, len(key)]
    else:
        entropy = [int(base), int(dp_rank), int(call)]
    words = np.random.SeedSequence(entropy).generate_state(2)
    return int((int(words[0]) << 31) ^ int(words[1])) & ((1 << 63) - 1)


def _own_config(model: ModelConfig) -> ModelConfig:
    """A private copy of a config object: the builders return models that share (and FSDPEngine / the value-model
    builder mutate) the config object they are given, so each model of a process needs its own."""
    return copy.deepcopy(model) if model is not None and not isinstance(model, Mapping) else model


def _rows_of(batch: Batch, what: str) -> None:
    """Refuse an empty shard in an endpoint without collectives (one that has them leaves it to the engine, which
    refuses it on every rank: raised here on one rank alone, the others would wait in the engine's collectives)."""
    if len(batch) < 1:
        raise ValueError(f"{what}: this rank got an empty shard; pass at least as many rows as the data-parallel size")


def _mini_batches(engine: FSDPEngine, batch: Batch, mini_batches: int, what: str) -> list[Batch]:
    """This rank's rows of each global mini-batch: mini-batch i holds the update's rows whose global index is i
    modulo ``mini_batches``, whatever the DP size. Rank r holds the r-th contiguous block of the rows (as
    ``dispatch.shard`` gives them), so every rank holds about 1/DP of every mini-batch and all ranks work on each
    optimizer step (contiguous global slices would leave a mini-batch on one rank while the others wait: the main
    job's update took 1.9x as long). A rank holding fewer rows than ``mini_batches`` has none of some mini-batches
    (collective when ``mini_batches > 1`` on several ranks: the ranks exchange their row counts)."""
    import torch.distributed as dist

    if mini_batches < 1:  # the same argument on every rank: every rank raises
        raise agreed(ValueError(f"{what}: mini_batches must be >= 1, got {mini_batches}"))
    if mini_batches == 1:
        return [batch]
    counts = torch.tensor([len(batch)], dtype=torch.int64, device=engine.device)
    if engine.dp_size > 1:
        gathered = [torch.zeros_like(counts) for _ in range(engine.dp_size)]
        dist.all_gather(gathered, counts)
        sizes = [int(t.item()) for t in gathered]
    else:
        sizes = [len(batch)]
    total = sum(sizes)
    if total < mini_batches:  # every rank learned the same total
        raise agreed(ValueError(f"{what}: the update has {total} rows over {engine.dp_size} data-parallel rank(s), fewer "
                         f"than mini_batches={mini_batches}; lower mini_batches or pass more rows (every mini-batch "
                         f"needs a row)"))
    start, n = sum(sizes[: engine.dp_rank]), len(batch)
    # local row j is global row start + j; a mini-batch whose first local row would be past n has none here (an
    # arange counting backwards raised on this rank alone, after the others had entered the update's collectives)
    return [batch[torch.arange(min((i - start) % mini_batches, n), n, mini_batches)] for i in range(mini_batches)]


def _train_versioned(worker: Worker, engine: FSDPEngine, *args: Any, **kwargs: Any) -> dict[str, float]:
    """``_train`` that bumps ``worker._version`` when it returns, and when it fails after an optimizer step: earlier
    mini-batches moved the weights all the same (the next generate must sync the rollout model and stamp the new
    version)."""
    before = engine.global_step
    try:
        metrics = _train(engine, *args, **kwargs)
    except BaseException:
        if engine.global_step != before:
            worker._version += 1
        raise
    worker._version += 1
    return metrics


def _train(engine: FSDPEngine, batch: Batch, loss_fn: LossFn, ppo_epochs: int, mini_batches: int, prefix: str,
           what: str, **train_kw: Any) -> dict[str, float]:
    """``ppo_epochs`` passes over ``mini_batches`` global mini-batches (``_mini_batches``: the same rows whatever
    the DP size), one optimizer step each; metrics averaged over the steps, except ``tokens`` and ``rows``: the
    update's response tokens and rows, each counted once."""
    if ppo_epochs < 1:
        raise ValueError(f"{what}: ppo_epochs must be >= 1, got {ppo_epochs}")
    if not callable(loss_fn):
        raise TypeError(f"{what}: loss_fn must be a callable loss_fn(outputs, micro_batch) -> (loss, metrics), "
                        f"got {type(loss_fn).__name__}")
    steps: list[dict[str, float]] = []
    seconds: list[float] = []
    # this rank's own work before the engine's collectives is guarded too: an error on one rank alone stops every
    # rank (the engine aborts the process groups) instead of leaving the others in train_step's collectives. Only
    # that work: train_step guards its own, and refuses what every rank refuses alike (an argument) without an abort
    with engine.collective(what):
        pieces = _mini_batches(engine, batch, mini_batches, what)
    for _ in range(ppo_epochs):
        for mb in pieces:
            t0 = time.perf_counter()
            steps.append(engine.train_step(mb.tensors, loss_fn, **train_kw))
            seconds.append(time.perf_counter() - t0)
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for s in steps for k in s):  # a skipped step may lack the loss_fn metrics
        vals = [s[k] for s in steps if k in s]
        if k in ("loss", "grad_norm"):  # a step without a response token trained nothing: its 0s are no measure
            vals = [s[k] for s in steps if k in s and s.get("tokens", 1.0) > 0] or [0.0]
        out[f"{prefix}/{k}"] = vals[-1] if k in ("step", "lr") else float(statistics.fmean(vals))
    # the update's rows and response tokens, each counted once (one epoch's mini-batches), not once per pass
    one_pass = steps[:len(pieces)]
    out[f"{prefix}/tokens"] = float(sum(s.get("tokens", 0.0) for s in one_pass))
    if any("rows" in s for s in one_pass):
        out[f"{prefix}/rows"] = float(sum(s.get("rows", 0.0) for s in one_pass))
    out[f"{prefix}/skipped"] = float(sum(s.get("skipped", 0.0) for s in steps))
    out[f"{prefix}/optimizer_steps"] = float(len(steps))
    out[f"{prefix}/train_step_seconds"] = float(statistics.fmean(seconds))
    out[f"{prefix}/update_seconds"] = float(sum(seconds))
    return out


def _base_seed(call_seed: int | None, sampling: SamplingParams, worker_seed: int) -> int:
    """The base seed of a worker's generate call: the call's ``seed=`` override, else the worker's
    ``SamplingParams.seed``, else the worker's own seed (each call then draws from ``generation_seed(base, rank,
    call)``, a private generator)."""
    if call_seed is not None:
        return int(call_seed)
    return int(sampling.seed) if sampling.seed is not None else int(worker_seed)


def _before_pending(gen_calls: int, pending: int) -> int:
    """The generate-call counter as it was before the ``pending`` calls a checkpoint must not count."""
    if not 0 <= int(pending) <= gen_calls:
        raise ValueError(f"save: pending_generate_calls must be between 0 and the {gen_calls} generate calls made, "
                         f"got {pending}")
    return gen_calls - int(pending)


def _write_state(directory: str, name: str, state: dict[str, Any]) -> None:
    """A worker's per-rank JSON state next to its engine checkpoint (written atomically)."""
    from engines.checkpoint import write_json_atomic

    os.makedirs(directory, exist_ok=True)
    write_json_atomic(os.path.join(directory, name), state, indent=2)


def _read_state(directory: str, name: str, what: str, world_size: int | None = None) -> dict[str, Any]:
    """Read what :func:`_write_state` wrote; a missing file, bad JSON or another world size raises
    ``CheckpointError`` naming the file (and saved vs current world size)."""
    from engines.checkpoint import CheckpointError, read_json

    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise CheckpointError(f"{what}: {path} is missing; pass a directory written by save() with the same number "
                              f"of ranks")
    state = read_json(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{what}: {path} holds a {type(state).__name__}, not a JSON object")
    saved = state.get("world_size")
    if world_size is not None and saved is not None and saved != world_size:
        raise CheckpointError(f"{what}: {path} was written by a group of {saved} ranks, this group has {world_size}; "
                              f"per-rank sampling state cannot be resharded: resume with {saved} workers")
    return state


# ---------------------------------------------------------------------------------------------------------- actor
def _check_own_process(worker: Worker) -> None:
    """FSDP shards over ranks with torch.distributed, which needs one process per rank: refuse a multi-rank group
    whose ranks share a process (the in-process backend) instead of letting each rank train alone."""
    if not worker.own_process and worker.world_size > 1:
        raise RuntimeError(f"{type(worker).__name__} rank {worker.rank}: an FSDP engine of {worker.world_size} ranks "
                           f"needs one process per rank (torch.distributed), but this group's ranks share one "
                           f"process (the in-process backend). Use the Ray backend, or a 1-rank group in-process.")


class ActorRolloutRefWorker(Worker):
    """Actor (FSDP, trainable) + rollout (plain model, synced from the actor) + optional frozen reference, per rank.

    Registers mesh ``"actor"`` (pure DP: every rank is a collector of its own rows).
    """

    def __init__(
        self,
        model: ModelConfig = None,
        *,
        model_path: str | os.PathLike | None = None,
        seed: int = 0,
        engine: EngineConfig | None = None,
        sampling: SamplingParams | None = None,
        tokenizer: Any = None,
        with_ref: bool = True,
        ref_engine: EngineConfig | None = None,
        rollout_micro_batch_size: int | None = None,
        rollout_dtype: torch.dtype | None = None,
        attn_implementation: str | None = None,
        num_threads: int | None = 1,
    ) -> None:
        """Build the engines from plain config; ``model`` is a dict of tiny-Qwen2 overrides or a PretrainedConfig,
        ``model_path`` a local checkpoint. ``tokenizer`` (see ``load_tokenizer``) gives eos/pad ids, else the model
        config does. ``rollout_dtype`` defaults to bf16 with mixed precision, else fp32."""
        from engines._dist import init_distributed
        from engines.models import build_causal_lm

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.config = engine if engine is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"engine must be an engines.EngineConfig, got {type(self.config).__name__}")
        self.sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be an engines.SamplingParams, got {type(self.sampling).__name__}")
        self.seed = int(seed)
        self.tokenizer = load_tokenizer(tokenizer)
        _check_own_process(self)
        init_distributed(torch.device(self.config.device) if self.config.device else None)

        def factory() -> torch.nn.Module:
            return build_causal_lm(_own_config(model), seed=self.seed, path=model_path,
                                   attn_implementation=attn_implementation)

        # a rank whose engine aborted its process groups is dead to the group: its blocked peers need it to end
        self.actor = FSDPEngine(factory, self.config, model_kind="causal_lm", on_abort=self.declare_dead)
        self.ref: FSDPEngine | None = None
        if with_ref:
            self.ref = FSDPEngine(factory, ref_engine or self.config, model_kind="causal_lm",
                                  on_abort=self.declare_dead)
        dtype = rollout_dtype or (torch.bfloat16 if self.actor.mixed_precision else torch.float32)
        rollout_model = build_causal_lm(_own_config(model), seed=self.seed, path=model_path, dtype=dtype,
                                        attn_implementation=attn_implementation).to(self.actor.device)
        rollout_model.config.use_cache = True
        rollout_model.generation_config.use_cache = True
        eos = pad = None
        if self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            pad = getattr(self.tokenizer, "pad_token_id", None)
        self.rollout = RolloutEngine(rollout_model, eos_token_id=eos, pad_token_id=pad,
                                     micro_batch_size=rollout_micro_batch_size)
        self._version = 0  # bumped by every update_actor call that moved the weights (a failed one too, if it stepped)
        self._synced: int | None = None  # actor version the rollout model holds (None: unknown, sync next time)
        self._gen_calls = 0  # generate calls so far on this rank: part of the sampling seed and of checkpoints
        self.register_mesh("actor", dp_rank=self.actor.dp_rank, dp_size=self.actor.dp_size,
                           is_collector=self.actor.is_collector)

    # -- weights ----------------------------------------------------------------------------------------------------
    def _sync_rollout(self) -> bool:
        """Copy the actor's full weights into the rollout model if the actor changed since the last sync
        (collective: every rank calls it at the same point). Returns whether weights moved."""
        if self._synced == self._version:
            return False
        self.rollout.load_weights(self.actor.full_state_dict(rank0_only=False))
        self._synced = self._version
        return True

    @endpoint(D.broadcast())
    def sync_rollout_weights(self) -> bool:
        """Sync the rollout model now (``generate`` does it lazily anyway); True where weights moved."""
        return self._sync_rollout()

    @endpoint(D.broadcast() | D.rank_zero())
    def weights_version(self) -> int:
        """How many ``update_actor`` calls the actor's weights have seen (restored by ``load``)."""
        return self._version

    @endpoint(D.from_rank(0))
    def state_dict_for_sync(self) -> dict[str, torch.Tensor] | None:
        """The actor's full weights (gathered by every rank, kept from rank 0) for a rollout pool of its own:
        ``rollout.load_weights(actor.state_dict_for_sync(), version)`` moves them worker to worker."""
        sd = self.actor.full_state_dict(rank0_only=True)
        return sd if self.rank == 0 else None

    # -- rollout ----------------------------------------------------------------------------------------------------
    @endpoint(D.shard(mesh="actor"), requires=["prompts"])
    def generate(self, batch: Batch, micro_batches: int = 1, **sampling_overrides: Any) -> Iterator[Batch]:
        """Sample ``n`` responses per prompt, yielding ``micro_batches`` parts (prompt-major rows, every part padded
        to ``max_new_tokens``); non-tensor columns are repeated ``n`` times; meta gets ``weights_version``.
        ``seed`` (override): the base seed (default: the worker's ``SamplingParams.seed``, else the worker's seed);
        ``call`` (override): the call's key, a sequence of ints >= 0 (the runner's step and round), that seeds it
        instead of this rank's running count of generate calls, so a call made again (a resume, a stale rollout
        regenerated) samples what it sampled before."""
        if micro_batches < 1:
            raise ValueError(f"generate: micro_batches must be >= 1, got {micro_batches}")
        if sampling_overrides.get("pad_to_max_new_tokens") is False:
            raise ValueError("generate pads every part to max_new_tokens so that parts and ranks concatenate; drop "
                             "pad_to_max_new_tokens=False")
        base = sampling_overrides.pop("seed", None)
        key = sampling_overrides.pop("call", None)
        sampling_overrides.pop("pad_to_max_new_tokens", None)
        try:
            params = replace(self.sampling, **sampling_overrides, pad_to_max_new_tokens=True, seed=None)
        except TypeError:
            known = sorted(f for f in SamplingParams.__dataclass_fields__ if f not in ("seed", "pad_to_max_new_tokens"))
            raise TypeError(f"generate: unknown sampling override(s) {sorted(sampling_overrides)}; SamplingParams "
                            f"fields are {known} (plus seed)") from None
        with self.actor.collective("generate"):  # an empty shard on one rank alone must not leave the others in
            _rows_of(batch, "generate")         # the weight sync's collectives (which guard their own work)
        self._sync_rollout()
        call = self._gen_calls if key is None else key
        self._gen_calls += 1
        gen = torch.Generator(device=self.rollout.device)
        gen.manual_seed(generation_seed(_base_seed(base, self.sampling, self.seed), self.actor.dp_rank, call))
        meta = {**batch.meta, "weights_version": self._version}
        for piece in batch.chunk(min(micro_batches, len(batch))):
            out = self.rollout.generate(piece.tensors, params, generator=gen)
            # each response row its own copy of its prompt's objects (np.repeat gave the n rows one shared object)
            nt = piece.select(*piece.non_tensors).repeat(params.n).non_tensors if piece.non_tensors else {}
            yield Batch(out, nt, meta)

    # -- scoring ----------------------------------------------------------------------------------------------------
    def _temperature(self, temperature: float | None) -> float:
        if temperature is not None:
            return float(temperature)
        t = self.sampling.temperature
        return float(t) if t > 0 else 1.0

    @endpoint(D.shard(mesh="actor"))
    def compute_log_prob(self, batch: Batch, temperature: float | None = None, with_entropy: bool = False) -> Batch:
        """Actor log-probs of the responses -> ``old_log_probs`` [B, R] (+ ``entropy``); temperature defaults to
        the sampling temperature (1 when greedy)."""
        out = self.actor.compute_log_prob(batch.tensors, self._temperature(temperature), with_entropy)
        cols = {"old_log_probs": out["log_probs"]}
        if with_entropy:
            cols["entropy"] = out["entropy"]
        return Batch.from_dict(cols)

    @endpoint(D.shard(mesh="actor"))
    def compute_ref_log_prob(self, batch: Batch, temperature: float | None = None) -> Batch:
        """Reference-model log-probs of the responses -> ``ref_log_probs`` [B, R]."""
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: this worker was built with with_ref=False; build it with "
                               "with_ref=True (or drop the KL term that needs reference log-probs)")
        out = self.ref.compute_log_prob(batch.tensors, self._temperature(temperature), False)
        return Batch.from_dict({"ref_log_probs": out["log_probs"]})

    # -- training ---------------------------------------------------------------------------------------------------
    @endpoint(D.shard(mesh="actor") | D.metrics())
    def update_actor(self, batch: Batch, loss_fn: LossFn, ppo_epochs: int = 1, mini_batches: int = 1,
                     temperature: float | None = None, lr: float | None = None) -> dict[str, float]:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps of ``loss_fn`` on this rank's rows (collective);
        bumps the weights version. ``lr``: this call's own rate instead of the schedule's (a warm start's).
        Returns ``actor/*`` metrics averaged over the steps."""
        t = self._temperature(temperature)
        metrics = _train_versioned(self, self.actor, batch, loss_fn, ppo_epochs, mini_batches, "actor",
                                   "update_actor", temperature=t, lr=lr)
        metrics["actor/weights_version"] = float(self._version)
        return metrics

    # -- state ------------------------------------------------------------------------------------------------------
    @endpoint(D.broadcast())
    def save(self, directory: str, pending_generate_calls: int = 0) -> str:
        """Actor checkpoint (model + optimizer shards as safetensors, JSON index and state; see
        ``engines.checkpoint``) in ``directory/actor`` plus this rank's version and sampling counter as JSON;
        collective. ``pending_generate_calls``: generate calls made before this save whose rollouts belong after
        the checkpoint (a step launched ahead, ``max_staleness=1``): not counted, so a resume that generates them
        again samples with their seeds. Returns the directory."""
        directory = os.fspath(directory)
        gen_calls = _before_pending(self._gen_calls, pending_generate_calls)
        self.actor.save(os.path.join(directory, "actor"))
        _write_state(directory, f"actor_worker_rank{self.rank}.json",
                     {"weights_version": self._version, "gen_calls": gen_calls, "seed": self.seed,
                      "world_size": self.world_size})
        return directory

    @endpoint(D.broadcast())
    def load(self, directory: str, verify: bool = True) -> int:
        """Restore what ``save`` wrote (the rollout model resyncs on the next ``generate``); returns the version.
        ``verify``: check every shard's size and sha256 first (skip only when the caller already did)."""
        directory = os.fspath(directory)
        state = _read_state(directory, f"actor_worker_rank{self.rank}.json", "ActorRolloutRefWorker.load",
                            self.world_size)
        self.actor.load(os.path.join(directory, "actor"), verify=verify)
        self._version = int(state["weights_version"])
        self._gen_calls = int(state["gen_calls"])
        self._synced = None
        return self._version

    @endpoint(D.broadcast())
    def offload(self) -> int:
        """Move actor, reference and rollout weights (and optimizer state) to host memory; bytes moved on this rank
        (0 on CPU). Compute endpoints need ``onload`` first."""
        moved = self.actor.offload()
        if self.ref is not None:
            moved += self.ref.offload()
        if self.rollout.device.type != "cpu":
            moved += sum(p.numel() * p.element_size() for p in self.rollout.model.parameters())
            self.rollout.model.to("cpu")
            torch.cuda.empty_cache()
        return moved

    @endpoint(D.broadcast())
    def onload(self) -> int:
        """Move everything ``offload`` moved back to the device; bytes moved on this rank."""
        moved = self.actor.onload()
        if self.ref is not None:
            moved += self.ref.onload()
        if self.rollout.device != self.actor.device:
            self.rollout.model.to(self.actor.device)
            moved += sum(p.numel() * p.element_size() for p in self.rollout.model.parameters())
        return moved


# ---------------------------------------------------------------------------------------------------------- critic
class CriticWorker(Worker):
    """A value model sharded with FSDP over the group; registers mesh ``"critic"``."""

    def __init__(
        self,
        model: ModelConfig = None,
        *,
        model_path: str | os.PathLike | None = None,
        seed: int = 0,
        engine: EngineConfig | None = None,
        attn_implementation: str | None = None,
        num_threads: int | None = 1,
    ) -> None:
        """``model``/``model_path`` as for the actor; the value head is initialised from ``seed``."""
        from engines._dist import init_distributed
        from engines.models import build_value_model

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.config = engine if engine is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"engine must be an engines.EngineConfig, got {type(self.config).__name__}")
        _check_own_process(self)
        init_distributed(torch.device(self.config.device) if self.config.device else None)
        self.critic = FSDPEngine(
            lambda: build_value_model(_own_config(model), seed=int(seed), path=model_path, attn_implementation=attn_implementation),
            self.config, model_kind="value", on_abort=self.declare_dead)
        self._version = 0
        self.register_mesh("critic", dp_rank=self.critic.dp_rank, dp_size=self.critic.dp_size,
                           is_collector=self.critic.is_collector)

    @endpoint(D.shard(mesh="critic"))
    def compute_values(self, batch: Batch) -> Batch:
        """Values of the states before each response token -> ``values`` [B, R] (0 where response_mask is 0)."""
        return Batch.from_dict({"values": self.critic.compute_values(batch.tensors)["values"]})

    @endpoint(D.shard(mesh="critic") | D.metrics())
    def update_critic(self, batch: Batch, loss_fn: LossFn, ppo_epochs: int = 1,
                      mini_batches: int = 1) -> dict[str, float]:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps of ``loss_fn`` (outputs: ``values``); ``critic/*``
        metrics."""
        return _train_versioned(self, self.critic, batch, loss_fn, ppo_epochs, mini_batches, "critic",
                                "update_critic")

    @endpoint(D.broadcast())
    def save(self, directory: str) -> str:
        """Critic checkpoint (safetensors shards + JSON, as the actor's) in ``directory/critic``; collective.
        Returns the directory."""
        directory = os.fspath(directory)
        self.critic.save(os.path.join(directory, "critic"))
        _write_state(directory, f"critic_worker_rank{self.rank}.json",
                     {"updates": self._version, "world_size": self.world_size})
        return directory

    @endpoint(D.broadcast())
    def load(self, directory: str, verify: bool = True) -> int:
        """Restore what ``save`` wrote; returns the number of updates the critic had seen. ``verify`` as for the
        actor."""
        directory = os.fspath(directory)
        state = _read_state(directory, f"critic_worker_rank{self.rank}.json", "CriticWorker.load", self.world_size)
        self.critic.load(os.path.join(directory, "critic"), verify=verify)
        self._version = int(state["updates"])
        return self._version

    @endpoint(D.broadcast())
    def offload(self) -> int:
        """Critic parameters and optimizer state to host memory; bytes moved (0 on CPU)."""
        return self.critic.offload()

    @endpoint(D.broadcast())
    def onload(self) -> int:
        """Back to the device; bytes moved (0 on CPU)."""
        return self.critic.onload()


# ---------------------------------------------------------------------------------------------------------- rewards
class RewardWorker(Worker):
    """Rule-based reward on CPU: decode the (masked) responses, compare with a ground-truth column."""

    def __init__(self, reward: str | Callable[..., Sequence[float]], tokenizer: Any, *,
                 answer_key: str = "answer", num_threads: int | None = 1, task: str | None = None,
                 **reward_kwargs: Any) -> None:
        """``reward``: a name from ``engines.reward`` (``list_rewards()``) or ``fn(texts, truths, **kw)``;
        ``reward_kwargs`` go to it. ``task``: the job's task name, for the error a non-finite score raises."""
        from engines.reward import RuleRewardEngine, register_reward

        if num_threads:
            torch.set_num_threads(int(num_threads))
        if callable(reward):
            name = f"{getattr(reward, '__module__', '')}.{getattr(reward, '__qualname__', repr(reward))}"
            register_reward(name, overwrite=True)(reward)
        elif isinstance(reward, str):
            name = reward
        else:
            raise TypeError(f"reward must be a registered reward name or a callable fn(texts, truths), got "
                            f"{type(reward).__name__}")
        tok = load_tokenizer(tokenizer)
        if tok is None or not hasattr(tok, "decode"):
            raise TypeError("RewardWorker needs a tokenizer with decode(ids): pass 'char', a local HF tokenizer "
                            "name/path, or a tokenizer object")
        self.engine = RuleRewardEngine(name, tok, task=task, **reward_kwargs)
        self.answer_key = answer_key

    @endpoint(D.shard(), requires=["responses"])
    def score(self, batch: Batch) -> Batch:
        """``scores`` [B] float32 and ``token_level_scores`` [B, R] (the score on the last valid response token)."""
        if self.answer_key not in batch.non_tensors:
            raise KeyError(f"score: the batch has no non-tensor column {self.answer_key!r} with ground truths (it has "
                           f"{sorted(batch.keys())}); add it to the prompts or pass answer_key=... to RewardWorker")
        truths = [str(a) for a in batch[self.answer_key]]
        out = self.engine.score(batch.tensors, truths)
        return Batch(out)


class RewardModelWorker(Worker):
    """A sequence-classification reward model, one full copy per rank (data parallel, no training)."""

    def __init__(self, model: ModelConfig = None, *, model_path: str | os.PathLike | None = None, seed: int = 0,
                 micro_batch_size: int = 16, device: str | None = None, dtype: torch.dtype = torch.float32,
                 num_threads: int | None = 1) -> None:
        """``model``/``model_path`` as for the actor; ``device`` defaults to the rank's GPU, else CPU."""
        from engines._dist import default_device
        from engines.models import build_reward_model
        from engines.reward import RewardModelEngine

        if num_threads:
            torch.set_num_threads(int(num_threads))
        dev = torch.device(device) if device else default_device()
        net = build_reward_model(_own_config(model), seed=seed, path=model_path, dtype=dtype).to(dev)
        self.engine = RewardModelEngine(net, micro_batch_size=micro_batch_size)

    @endpoint(D.shard())
    def score(self, batch: Batch) -> Batch:
        """``scores`` [B] and ``token_level_scores`` [B, R] from the model's output at the last real token."""
        _rows_of(batch, "score")
        return Batch(self.engine.score(batch.tensors))
