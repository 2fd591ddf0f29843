"""What a pipeline step sees: the cluster, the config, and helpers to name stages and join futures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import torch

from orchestra import Batch, DataFuture, Tracer

from .algorithms import AdaptiveKLController
from .cluster import Cluster
from .config import Config
from .join import join

__all__ = ["StepContext", "join", "union"]


def union(*parts: DataFuture | Batch | None) -> DataFuture | Batch:
    """Row-aligned union of the given futures/batches, skipping None (optional stages)."""
    present = [p for p in parts if p is not None]
    out = present[0]
    for p in present[1:]:
        out = out | p
    return out


@dataclass
class StepContext:
    """Handed to a step function: the cluster and config, plus stage naming for timings and the trace. Use it as
    ``async with StepContext(...) as ctx:`` around the step so that its stage watchers end with it."""

    cluster: Cluster
    cfg: Config
    step: int
    tracer: Tracer | None = None
    kl_ctl: AdaptiveKLController | None = None  # the run's adaptive KL controller (algorithm.kl_target), else None
    prompts: Batch | None = None  # the step's prompts, one row each (what the rollouts were sampled from)
    # ReMax (adv_estimator=remax): the greedy rollout (n=1, temperature 0) of ``prompts``, launched with the sampled one
    greedy: DataFuture | None = None
    # DAPO dynamic sampling: ``sample_more(k)`` starts rollouts of k fresh prompts with the current weights
    sample_more: Callable[[int], DataFuture] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _watch: list[asyncio.Task] = field(default_factory=list)
    _t0: float = field(default_factory=time.time)

    def stage(self, name: str, fut: DataFuture) -> DataFuture:
        """Name a stage: its wall time (from the step's start to the stage's end) lands in the step's metrics
        as ``time/<name>`` and, when tracing, as a controller span. Returns ``fut`` unchanged."""
        start = time.time()

        async def watch() -> None:
            try:
                await fut.wait()
            except Exception:  # noqa: BLE001 - the step itself awaits the future and raises; cancellation is not
                return  # caught: a failed step's watchers are cancelled by __aexit__
            end = time.time()
            self.timings[f"time/{name}"] = end - self._t0
            if self.tracer is not None:
                self.tracer.add_span(name, start, end, track=name, step=self.step)  # stages overlap: a lane each

        self._watch.append(asyncio.get_running_loop().create_task(watch()))
        return fut

    async def settle(self) -> None:
        """Wait for the stage watchers (after the step's last await). Cancelled meanwhile: they are cancelled too,
        and awaited, before the cancellation goes on."""
        try:
            if self._watch:
                await asyncio.wait(self._watch)
        except asyncio.CancelledError:
            await self._cancel_watchers()
            raise

    async def _cancel_watchers(self) -> None:
        """Cancel the watchers and wait until they have ended, shielded: a cancelled watcher ends within a loop
        turn or two. ``asyncio.wait``, not ``gather``: a gather cancelled from outside raises its children's
        cancellation, whose message is not the canceller's, and an anyio cancel scope (the runner's supervision)
        then does not know the cancellation as its own and lets it escape."""
        for t in self._watch:
            t.cancel()
        if self._watch:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(self._watch)

    async def __aenter__(self) -> StepContext:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """The step's scope owns its stage watchers: awaited after a step that finished, cancelled (and awaited)
        after one that failed or was cancelled, so that none outlives its step."""
        if exc_type is None:
            await self.settle()
        else:
            await self._cancel_watchers()

    @staticmethod
    def score_metrics(scores: torch.Tensor) -> dict[str, float]:
        """Reward statistics of one step (``reward/mean`` is the headline number)."""
        s = scores.double()
        return {"reward/mean": float(s.mean()), "reward/std": float(s.std()) if len(s) > 1 else 0.0,
                "reward/max": float(s.max()), "reward/min": float(s.min()),
                "reward/solved": float((s >= 1.0).double().mean())}
