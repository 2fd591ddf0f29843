"""RolloutWorker: a rollout engine on a pool of its own (split placement), fed weights worker to worker.

The trainer's ``state_dict_for_sync`` (a ``D.from_rank(0)`` endpoint: every trainer rank takes part in the
gather, rank 0's dict is kept) is passed straight into ``load_weights``; the controller never holds the weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from engines.rollout import RolloutEngine, SamplingParams
from engines.workers import _base_seed, _before_pending, _read_state, _write_state, generation_seed, load_tokenizer
from orchestra import Batch, Worker, endpoint
from orchestra import dispatch as D

__all__ = ["RolloutWorker"]


class RolloutWorker(Worker):
    """One full model copy per rank for sampling; registers mesh ``"rollout"`` (pure DP)."""

    def __init__(self, model: Mapping[str, Any] | Any = None, *, model_path: str | os.PathLike | None = None,
                 seed: int = 0, sampling: SamplingParams | None = None, tokenizer: Any = "char",
                 micro_batch_size: int | None = None, device: str | None = None, num_threads: int | None = 1) -> None:
        """Build the model from plain config (as ``ActorRolloutRefWorker`` does); weights come from ``load_weights``."""
        from engines.models import build_causal_lm

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.seed = int(seed)
        self.tokenizer = load_tokenizer(tokenizer)
        dev = torch.device(device or (f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"))
        m = build_causal_lm(model, seed=self.seed, path=model_path).to(dev)
        m.config.use_cache = True
        self.engine = RolloutEngine(m, eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
                                    pad_token_id=getattr(self.tokenizer, "pad_token_id", None),
                                    micro_batch_size=micro_batch_size)
        self._version = 0
        self._gen_calls = 0
        self.register_mesh("rollout", dp_rank=self.rank, dp_size=self.world_size)

    @endpoint(D.broadcast())
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Copy the trainer's full weights in; ``version`` is the trainer's weights version they carry."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_weights needs a state dict, got {type(state_dict).__name__}; pass the trainer's "
                            f"state_dict_for_sync() future")
        self.engine.load_weights(state_dict)
        self._version = int(version)
        return self._version

    @endpoint(D.broadcast() | D.rank_zero())
    def weights_version(self) -> int:
        """The trainer version of the weights this pool samples with."""
        return self._version

    @endpoint(D.shard(mesh="rollout"), requires=["prompts"])
    def generate(self, batch: Batch, micro_batches: int = 1, **sampling_overrides: Any) -> Iterator[Batch]:
        """Sample ``n`` responses per prompt in ``micro_batches`` parts (same layout and ``seed`` / ``call``
        overrides as the colocated actor's)."""
        if len(batch) < 1:
            raise ValueError("generate: this rank got an empty shard; pass at least as many prompts as ranks")
        base = sampling_overrides.pop("seed", None)
        key = sampling_overrides.pop("call", None)  # the caller's key of this call (ActorRolloutRefWorker.generate)
        sampling_overrides.pop("pad_to_max_new_tokens", None)
        params = replace(self.sampling, **sampling_overrides, pad_to_max_new_tokens=True, seed=None)
        call = self._gen_calls if key is None else key
        self._gen_calls += 1
        gen = torch.Generator(device=self.engine.device)
        gen.manual_seed(generation_seed(_base_seed(base, self.sampling, self.seed), self.rank, call))
        meta = {**batch.meta, "weights_version": self._version}
        for piece in batch.chunk(min(micro_batches, len(batch))):
            out = self.engine.generate(piece.tensors, params, generator=gen)
            # each response row its own copy of its prompt's objects (np.repeat gave the n rows one shared object)
            nt = piece.select(*piece.non_tensors).repeat(params.n).non_tensors if piece.non_tensors else {}
            yield Batch(out, nt, meta)

    @endpoint(D.broadcast())
    def save(self, directory: str, pending_generate_calls: int = 0) -> str:
        """This rank's sampling counter and weights version (weights come from the trainer on resume);
        ``pending_generate_calls`` made before it are not counted (``ActorRolloutRefWorker.save``)."""
        _write_state(os.fspath(directory), f"rollout_rank{self.rank}.json",
                     {"gen_calls": _before_pending(self._gen_calls, pending_generate_calls),
                      "weights_version": self._version})
        return os.fspath(directory)

    @endpoint(D.broadcast())
    def load(self, directory: str) -> int:
        """Restore what ``save`` wrote; returns the weights version."""
        state = _read_state(os.fspath(directory), f"rollout_rank{self.rank}.json", "RolloutWorker.load")
        self._gen_calls, self._version = int(state["gen_calls"]), int(state["weights_version"])
        return self._version
