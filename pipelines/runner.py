"""The runner: drives a step function over many steps with streaming, bounded staleness, metrics, progress,
checkpoints, resume and a timeline trace.

A step function (``grpo_step``, ``ppo_step``, ``dapo_step``) is an async function over DataFutures; the runner adds
what a single step cannot: it launches the next step's rollout early when ``max_staleness=1`` (weights versioned;
data older than the bound is regenerated, never used), launches ReMax's greedy rollout next to the sampled one
(``StepContext.greedy``) and DAPO's extra sampling rounds from the same sampler (``StepContext.sample_more``), keeps
the sampler and RNG state in checkpoints so that ``--resume`` continues exactly, and writes ``metrics.jsonl``,
TensorBoard scalars, a reward plot and a Perfetto trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

import orchestra as orc
from orchestra import Batch, DataFuture

from . import checkpoint as ckpt
from .checkpoint import CheckpointError
from .cluster import Cluster, build_cluster, check_model_fits, wait_for_capacity
from .config import Config, ConfigError, config_to_dict, replace
from .dapo import dapo_step
from .data import PromptSampler
from .grpo import grpo_step
from .health import NonFiniteGuard, TrainingDivergedError
from .kl_control import make_kl_controller
from .metrics import MetricsSink, plot_metrics
from .objectives import SFTLoss
from .ppo import ppo_step
from .stage import StepContext
from .taskspec import TaskSpec, get_task, prompt_batch

__all__ = ["RunInterrupted", "Runner", "STEPS", "run"]

log = logging.getLogger("orchestra")

StepFn = Callable[[StepContext, DataFuture], Awaitable[dict[str, float]]]
STEPS: dict[str, StepFn] = {"grpo": grpo_step, "ppo": ppo_step, "dapo": dapo_step}

# Each generate call the runner makes is seeded by its key (``generate(call=...)``), not by how many calls its rank
# made before it: a call made again (a resume, a stale rollout regenerated, a restart) samples what it sampled the
# first time, whatever ran before it. A step's sampled rollout: its step number (the seed it always had with one
# generate call a step, as GRPO, PPO and RLOO make: their runs sample as before keys); DAPO's extra rounds
# ``(step, 0, round)``, ReMax's greedy rollout ``(step, 1, 0)``. Written into runner.json as ``generate_seeds``.
_SAMPLED, _GREEDY = 0, 1
_SEEDS_BY_KEY = "step-round"


@dataclass(frozen=True)
class _Rebuilt:
    """When each phase of a restart's rebuild ended (``time.time()``), for the restart's event."""

    started: float
    torn_down: float
    placed: float
    ready: float


@dataclass
class _Launched:
    """A step's rollout in flight: the prompts it was made from and the weights version that makes it."""

    step: int
    prompts: Batch
    rollouts: DataFuture
    version: int
    started: float
    greedy: DataFuture | None = None  # ReMax: the greedy rollout of the same prompts (same weights version)
    sampler_before: dict[str, Any] | None = None  # the prompt sampler's state before it drew these prompts

    def cancel(self) -> None:
        """Cancel the generate calls in flight."""
        self.rollouts.cancel()
        if self.greedy is not None:
            self.greedy.cancel()


def _bar_fields(rec: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields for a step's record: the ones it has (an algorithm of one's own need not log
    ``reward/mean``: the bar read it and a run without it died with KeyError at its first step)."""
    shown = {"reward": ("reward/mean", "{:.3f}"), "tok_s": ("perf/tokens_per_s", "{:.0f}")}
    return {name: fmt.format(rec[key]) for name, (key, fmt) in shown.items()
            if isinstance(rec.get(key), (int, float))}


class Runner:
    """Runs a training job described by a Config (see ``orchestra train --help``)."""

    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
                 resume_from: Path | None = None) -> None:
        """``resume``: continue from the newest good checkpoint in ``runner.output_dir``; ``overwrite``: start over
        in an output_dir that holds checkpoints (without it such a run is refused); ``resume_from``: a checkpoint
        directory already chosen and verified by ``pipelines.checkpoint.prepare_output_dir`` (implies resume)."""
        # runner.output_dir resolved once, here in the driver: every path a worker is given is absolute (a worker on
        # Ray runs in a copy of the driver's directory, where a relative path names another place)
        self.out = ckpt.resolve_output_dir(cfg.runner.output_dir)
        if cfg.runner.output_dir != str(self.out):
            cfg = replace(cfg, runner=replace(cfg.runner, output_dir=str(self.out)))
        self.cfg, self.overwrite, self.progress = cfg, overwrite, progress
        self.resume = resume or resume_from is not None
        self._resume_from: Path | None = resume_from
        self.step_fn = STEPS[cfg.algorithm.name]
        self.task: TaskSpec = _build_task(cfg)
        # user errors found before any worker starts: the model takes the task's tokens, the prompts fill a step,
        # the device exists
        check_model_fits(cfg, self.task)
        _check_records(cfg, self.task)
        _check_device(cfg)
        self.tok = self.task.tokenizer()
        self.sampler = self._new_sampler()
        self.cluster: Cluster | None = None
        self.tracer: orc.Tracer | None = None
        self.actor_version = 0
        self.rollout_version = 0
        self.start_step = 0
        self.history: list[dict[str, Any]] = []
        self.guard = NonFiniteGuard(cfg.runner.max_bad_steps)  # raises TrainingDivergedError on NaN/inf runs
        self.kl_ctl = make_kl_controller(cfg)  # adaptive KL coefficient (algorithm.kl_target); saved in checkpoints
        self.restarts: list[dict[str, Any]] = []  # the restart events of this run (also in metrics.jsonl)
        self._step = 0  # the step running now (a restart event names it)
        self._next = 0  # the first step whose metrics are not recorded yet (an interrupted run names it)
        self._last_record: float | None = None  # when the last step was recorded in this loop (perf/step_s)
        self._noticed = 0.0  # when the last death was seen (unix time)
        self._rebuilt: _Rebuilt | None = None  # the last restart's rebuild (its phases, for its event)
        # a checkpoint written while the next step's prompts were already drawn (max_staleness=1): the sampler state
        # to draw them again from, once, so the resumed step trains on the prompts the interrupted run had drawn
        self._redraw_from: dict[str, Any] | None = None
        self._state_time: dict[int, float] = {}  # step -> when the state after it was current (lost_s)
        self._extra_rounds: dict[int, int] = {}  # step -> DAPO extra rounds launched for it so far (their seeds' key)

    @property
    def current_step(self) -> int:
        """The step running now (or about to): the one a restart event names when a worker dies."""
        return self._step

    @property
    def next_step(self) -> int:
        """The first step whose metrics are not recorded yet: where a run that is stopped now stopped."""
        return max(self._next, self.start_step)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def run(self) -> list[dict[str, Any]]:
        """Run (or resume) the job to ``runner.total_steps``; returns the metrics of the steps run here. The run holds
        ``runner.output_dir`` (:func:`pipelines.checkpoint.lock_output_dir`) from before its first check there to the
        end of its cleanup: a second run into that directory fails at once instead of writing into this one."""
        cfg = self.cfg
        # shared with the CLI that holds it already, if any; a resume never makes the directory
        with ckpt.lock_output_dir(self.out, run=True, resume=self.resume):
            # before anything starts: refuse to clobber an earlier run, and check the checkpoint --resume will use
            if self._resume_from is None:
                self._resume_from = ckpt.prepare_output_dir(self.out, resume=self.resume, overwrite=self.overwrite)
            self.out.mkdir(parents=True, exist_ok=True)
            now = config_to_dict(cfg)
            resume_state: Any = None  # the checkpoint's runner.json, read once: the config check and _restore use it
            if self._resume_from is not None:
                resume_state = ckpt.read_json(self._resume_from / "runner.json")
                self._check_resumable(resume_state)  # before config.json is rewritten and anything starts
                _warn_config_changes(resume_state, self.out / "config.json", now)
            (self.out / "config.json").write_text(json.dumps(now, indent=2))
            _seed_everything(cfg.runner.seed)
            if cfg.resources.backend == "ray":  # (local: every pool runs its workers in this process; no cluster)
                orc.init(address=os.environ.get("RAY_ADDRESS") or None)  # a Ray cluster to attach to (docs/cluster.md)
            try:
                self.cluster = build_cluster(cfg, self.task)
            except orc.PlacementError as e:
                raise _unplaceable(e) from e
            failed = False
            try:
                try:
                    await self.cluster.ready()
                except orc.PlacementError as e:  # the job asks for more than the cluster has: a user error
                    raise _unplaceable(e) from e
                if cfg.runner.trace:
                    self.tracer = orc.Tracer(*self.cluster.groups())
                    await self.tracer.start()
                if self.resume:
                    await self._restore(resume_state)
                elif self.task.warm_start_steps:
                    await self._warm_start()
                await self._sync_rollout()
                sink = MetricsSink(self.out, tensorboard=cfg.runner.tensorboard, truncate_after=self.start_step - 1
                                   if self.resume else None, enabled=cfg.runner.metrics)
                try:
                    await self._train(sink)
                finally:
                    sink.close()
                self.guard.at_end(cfg.runner.total_steps - 1)  # a run that ends on tolerated NaN steps says so
                if cfg.runner.plot:  # (the config refuses it without runner.metrics or matplotlib)
                    plot_metrics(self.out / "metrics.jsonl", self.out / "reward.png",
                                 keys=("reward/mean", "reward/solved"))
                return self.history
            except BaseException:
                failed = True
                raise
            finally:
                await self._close(failed)

    def _new_sampler(self) -> PromptSampler:
        """The prompt sampler at the start of the run's data, as this config samples it: full batches of
        ``data.prompts_per_step`` (with ``data.shuffle=false`` a pass's last batch runs on into the next pass, so
        every record is trained on; shuffled, each epoch drops another remainder)."""
        d = self.cfg.data
        return PromptSampler(self.task.records, d.prompts_per_step, seed=d.seed, shuffle=d.shuffle)

    def _check_resumable(self, state: Any) -> None:
        """Refuse a resume this config cannot continue, naming what to change: nothing left to run, or prompts
        sampled another way than the checkpoint's (batch size, data, seed)."""
        d = self._resume_from
        if isinstance(state, dict):
            _check_runner_state(d / "runner.json", state)
        step = state.get("step") if isinstance(state, dict) else None
        total = self.cfg.runner.total_steps
        if isinstance(step, int) and step + 1 >= total:
            raise CheckpointError(f"--resume from {d}: the checkpoint is after step {step}, so runner.total_steps="
                                  f"{total} leaves no step to run; raise runner.total_steps to continue the run")
        if isinstance(state, dict) and "sampler" in state:
            try:
                self._new_sampler().load_state_dict(state["sampler"])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"--resume from {d}: the prompts were sampled another way than this config "
                                      f"samples them ({e}); resume with the data settings it was written with") from e

    async def _close(self, failed: bool) -> None:
        """Save the trace, then shut the cluster down, whatever happens. If saving the trace fails while the run
        itself failed, that error is logged and the run's own error propagates; otherwise it is raised."""
        try:
            if self.tracer is not None:
                await self.tracer.collect()
                self.tracer.save(self.out / "trace.json")
        except Exception:
            if not failed:
                raise
            log.exception("saving the trace failed while the run was failing (the run's error follows)")
        finally:
            self.cluster.shutdown()

    # -- elastic recovery -----------------------------------------------------------------------------------------
    async def _train(self, sink: MetricsSink) -> None:
        """The step loop, restarted after a dead worker or node (at most ``runner.max_restarts`` times): the job is
        torn down, rebuilt once the cluster fits it again, restored from the latest good checkpoint (or step 0
        state without one) and continued. Out of restarts: the death (naming group and rank) is raised."""
        max_restarts = self.cfg.runner.max_restarts
        bar = _progress(self.cfg.runner.total_steps, self.start_step) if self.progress else None
        try:
            died = await self._supervised(self._loop(sink, bar))
            while died is not None:
                if len(self.restarts) >= max_restarts:
                    if max_restarts == 0:
                        raise died
                    raise orc.WorkerDiedError(
                        f"{died.message}; giving up after {len(self.restarts)} restart(s) "
                        f"(runner.max_restarts={max_restarts})", group=died.group, rank=died.rank,
                        endpoint=died.endpoint, exc_type="WorkerDied") from died
                # the job being torn down is not watched: what it reports now is part of the failure being handled
                # (the awaited call failed first, or a lost node's ranks are reported one by one); a rank of the new
                # job dying while it starts fails ``ready()``, and while it is restored, supervision reports it
                died = await self._supervised(self._rebuild(died, bar), watch=False)
                if died is None:
                    died = await self._supervised(self._recover(sink, bar))
                if died is None:
                    died = await self._supervised(self._loop(sink, bar))
        finally:
            if bar is not None:
                bar.close()

    async def _supervised(self, work: Coroutine[Any, Any, None], watch: bool = True) -> orc.WorkerDiedError | None:
        """Await ``work``; with ``watch``, a rank dying anywhere in the job cancels it at once, even when ``work`` is
        awaiting another group (supervision's ``on_death``), and a rank already dead stops it before it starts.
        Returns the death (None when ``work`` finished)."""
        seen: list[orc.WorkerDiedError] = []
        noticed: list[float] = []
        with anyio.CancelScope() as scope:

            def on_death(err: orc.WorkerDiedError) -> None:
                if not seen:
                    noticed.append(time.time())
                seen.append(err)
                scope.cancel()

            # a rank that died before this watch began is reported at registration (on_death tells a new callback
            # of the deaths already seen): the work then never starts
            removers = [g.on_death(on_death) for g in self.cluster.groups()] if watch else []
            try:
                if seen:
                    work.close()  # never started: the job it would work on is already failing
                else:
                    await work
            except orc.WorkerDiedError as e:
                noticed.append(time.time())
                seen.insert(0, e)  # the awaited call's error also names the endpoint
            except orc.OrchestraError as e:
                if not seen and watch:  # a peer's error can come before the death that caused it is reported
                    behind = await self._death_behind()
                    if behind is not None and behind.declared:  # the endpoint's own error made its rank unusable
                        raise  # (Worker.declare_dead): an endpoint error, not retried
                    if behind is not None:
                        noticed.append(time.time())
                        seen.append(behind)
                if not seen:
                    raise
                # a consequence of the death (a sibling's call cancelled, a collective's peer gone): the death is the
                # cause
                log.warning("after %s: %s", seen[0], e)
            finally:
                for remove in removers:
                    remove()
        if not seen:
            return None
        died = seen[0]
        if died.declared:
            # a rank declares itself dead when its engine aborted after an error inside collective work: its own (an
            # endpoint error: not retried), or a peer's death (its collective failed): then that death is the cause
            behind = await self._death_behind()
            if behind is None or behind.declared:
                raise died
            died = behind
        self._noticed = min(noticed)
        return died

    async def _death_behind(self, bound_s: float = 30.0) -> orc.WorkerDiedError | None:
        """A call failed with no death reported. When a rank dies, its peers' collectives fail at once (gloo:
        "connection closed by peer"), often before supervision reports the death. So ask every rank of the job
        whether it is alive (a control-lane round trip) and return the first death found, at most ``bound_s``; a
        process that died comes before a rank that declared itself dead (whose peer's death may have caused it)."""
        declared: orc.WorkerDiedError | None = None
        with anyio.move_on_after(bound_s):
            for g in self.cluster.groups():
                try:
                    await g.ping()  # a dead process's error comes before a declared rank's (WorkerGroup.ping)
                except orc.WorkerDiedError as err:
                    if not err.declared:
                        return err
                    declared = declared or err
                except orc.OrchestraError as err:  # not a death (a closed group): that group tells nothing
                    log.debug("after a failed call, %r did not answer a ping: %s", g.name, err)
        return declared

    async def _rebuild(self, died: orc.WorkerDiedError, bar: Any) -> None:
        """Tear the job down, wait until its pools fit again and start the roles anew (``self._rebuilt``: when each
        phase ended, for the restart's event)."""
        cfg = self.cfg
        n = len(self.restarts) + 1
        step = self._step
        reason = f"group {died.group!r} rank {died.rank} died: {died.message}"
        log.warning("restart %d of %d (runner.max_restarts): %s", n, cfg.runner.max_restarts, reason)
        if bar is not None:
            bar.write(f"restart {n}/{cfg.runner.max_restarts} at step {step}: group {died.group!r} rank "
                      f"{died.rank} died; restoring the latest checkpoint")
        t0 = time.time()
        old = self.cluster
        self.restarts.append({"event": "restart", "step": step, "reason": reason})  # counted even if this fails
        if self.tracer is not None:  # the spans seen so far, the failed step's on the live ranks too (the dead
            try:  # rank is marked lost in the trace); the rebuilt groups get a tracer of their own
                await self.tracer.collect()
            except Exception as e:  # noqa: BLE001 - the restart goes on with what was collected before
                log.warning("restart %d: the trace's last spans could not be collected (%s); saving what it has", n, e)
            self.tracer.save(self.out / f"trace.before-restart-{n}.json")
            self.tracer = None
        await old.aclose()
        t_teardown = time.time()
        await wait_for_capacity(old.pools, cfg.runner.restart_timeout_s)
        self.cluster = build_cluster(cfg, self.task)
        with anyio.fail_after(cfg.runner.restart_timeout_s):
            await asyncio.gather(*[p.slots() for p in self.cluster.pools])
            t_slots = time.time()
            await self.cluster.ready()
        self._rebuilt = _Rebuilt(t0, t_teardown, t_slots, time.time())

    async def _recover(self, sink: MetricsSink, bar: Any) -> None:
        """Restore the rebuilt job from the latest good checkpoint (step 0 state without one; either way the count
        of consecutive non-finite steps is that of the state restored) and record the restart (metrics.jsonl event,
        log, progress bar)."""
        cfg = self.cfg
        n = len(self.restarts)
        step = self.restarts[-1]["step"]
        reason = self.restarts[-1]["reason"]
        r = self._rebuilt
        assert r is not None, "_recover runs after _rebuild"
        t0, t_teardown, t_slots, t_placed = r.started, r.torn_down, r.placed, r.ready
        if cfg.runner.trace:
            self.tracer = orc.Tracer(*self.cluster.groups())
            await self.tracer.start()
        root = self.out / "checkpoints"
        self._resume_from = (await asyncio.to_thread(ckpt.latest_good, root)) if ckpt.committed(root) else None
        if self._resume_from is not None:
            await self._restore()
        else:  # no checkpoint yet: step 0 state, the same seeds as the run's start
            self._redraw_from = None
            _seed_everything(cfg.runner.seed)
            self.sampler = self._new_sampler()
            self.actor_version = self.rollout_version = self.start_step = 0
            self.kl_ctl = make_kl_controller(cfg)
            self.guard = NonFiniteGuard(cfg.runner.max_bad_steps)  # (a checkpoint's count comes with _restore)
            if self.task.warm_start_steps:
                await self._warm_start()
        await self._sync_rollout()
        t_restored = time.time()
        restored_step = self.start_step - 1
        self.history = [h for h in self.history if h["step"] < self.start_step]
        event = {"event": "restart", "step": step, "reason": reason, "restart": n,
                 "checkpoint": self._resume_from.name if self._resume_from is not None else None,
                 "resume_step": self.start_step,
                 "lost_s": t_restored - self._state_time.get(restored_step, t0),
                 "noticed_at": self._noticed, "teardown_s": t_teardown - t0,
                 "placement_s": t_slots - t_teardown, "startup_s": t_placed - t_slots,
                 "restore_s": t_restored - t_placed, "time": t_restored}
        if self._resume_from is None:
            event["note"] = "no checkpoint yet: restarted from step 0 (fresh init, same seed)"
        self.restarts[-1] = event
        self._state_time[restored_step] = t_restored
        sink.truncate(restored_step)
        sink.event(event)
        log.warning("restarted (%d of %d): continuing at step %d from %s; %.1f s lost", n,
                    cfg.runner.max_restarts, self.start_step, event["checkpoint"] or "step 0 state", event["lost_s"])
        if bar is not None:
            bar.n = self.start_step
            bar.set_description(f"train (restarted {n}x)")
            bar.refresh()

    async def _loop(self, sink: MetricsSink, bar: Any) -> None:
        cfg = self.cfg
        total = cfg.runner.total_steps
        pending: _Launched | None = None
        self._state_time.setdefault(self.start_step - 1, time.time())
        self._last_record = None  # a first step, or the first after a restart: timed from its rollout's launch
        for step in range(self.start_step, total):
            self._step = step
            cur = pending if pending is not None and pending.step == step else self._launch(step)
            if self.actor_version - cur.version > cfg.runner.max_staleness:  # beyond the bound: never used
                cur.cancel()
                cur = self._launch(step)
            pending = None
            self._extra_rounds = {step: 0}  # this step's DAPO rounds (a step run again numbers them again)
            if cfg.runner.max_staleness >= 1 and step + 1 < total:
                pending = self._launch(step + 1)  # generated with the current weights while this step updates
            ctx = StepContext(self.cluster, cfg, step, self.tracer, kl_ctl=self.kl_ctl, prompts=cur.prompts,
                              greedy=cur.greedy, sample_more=functools.partial(self._sample_more, step))
            try:
                async with ctx:  # the step owns its stage watchers: none outlives it, even when it fails
                    with self.tracer.span(f"step {step}", step=step) if self.tracer else contextlib.nullcontext():
                        metrics = await self.step_fn(ctx, cur.rollouts)
                        self.actor_version += 1
                        await self._sync_rollout()
            except Exception as e:  # the error names its group, rank and endpoint; this says which step it ended
                e.add_note(f"(raised in step {step} of the {cfg.algorithm.name} run in {self.out}; steps count from 0)")
                raise
            rec = self._record(step, cur, metrics, ctx)
            sink.write(rec)
            self.history.append(rec)
            self._next = step + 1
            self.guard.check(step, metrics)  # after the step's metrics are written, so the bad step is on record
            if bar is not None:
                bar.update(1)
                bar.set_postfix(_bar_fields(rec))
            every = cfg.runner.checkpoint_every
            if every and ((step + 1) % every == 0 or step + 1 == total):  # and after the last step, always
                await self.save(step, pending)
            if self.tracer is not None:
                await self.tracer.collect()

    def _launch(self, step: int) -> _Launched:
        """Sample this step's prompts and start generating (returns at once)."""
        before = self.sampler.state_dict()
        if self._redraw_from is not None:  # the prompts the interrupted run drew for this step, then on as it went
            self.sampler.load_state_dict(self._redraw_from)
            recs = next(self.sampler)
            self.sampler.load_state_dict(before)
            before, self._redraw_from = self._redraw_from, None
        else:
            recs = next(self.sampler)
        prompts = prompt_batch(recs, self.tok, uid_offset=step * len(recs))
        rollouts = self.cluster.rollout.generate(prompts, micro_batches=self.cfg.runner.micro_batches_per_step,
                                                 seed=self.cfg.rollout.seed, call=step)
        greedy = None
        if self.cfg.algorithm.adv_estimator == "remax":  # its baseline: one greedy response per prompt
            greedy = self.cluster.rollout.generate(prompts, micro_batches=self.cfg.runner.micro_batches_per_step,
                                                   seed=self.cfg.rollout.seed, call=(step, _GREEDY, 0), n=1,
                                                   temperature=0.0)
        return _Launched(step, prompts, rollouts, self.rollout_version, time.time(), greedy, before)

    def _sample_more(self, step: int, count: int) -> DataFuture:
        """DAPO's extra sampling round for ``step``: the sampler's next ``count`` prompts (the next batch starts
        after them), generated with the current weights (returns at once), seeded by the step and the round's number.
        At most an epoch of records: a round rounded up to the rollout workers can ask for more than the data holds,
        and a draw longer than an epoch would hold a prompt twice."""
        limit = self.sampler.records_per_epoch
        if count > limit:
            log.info("step %d: DAPO's extra sampling round draws %d prompts, not %d: an epoch of the prompt data "
                     "holds only %d, and a round never holds a prompt twice", step, limit, count, limit)
            count = limit
        rnd = self._extra_rounds.get(step, 0) + 1
        rounds = self.cfg.algorithm.dynamic_sampling_max_rounds
        if rnd > rounds:
            raise ValueError(f"step {step}: extra sampling round {rnd}, but algorithm.dynamic_sampling_max_rounds is "
                             f"{rounds}: a step takes at most that many extra rounds (raise it to take more)")
        self._extra_rounds = {step: rnd}
        recs = self.sampler.take(count)
        # uids no other round of any step uses (a uid names one prompt): the steps' first rounds take
        # [0, total_steps x prompts_per_step); each extra round its own block of an epoch's size above them
        first = self.cfg.runner.total_steps * self.cfg.data.prompts_per_step
        prompts = prompt_batch(recs, self.tok, uid_offset=first + (step * rounds + rnd - 1) * limit)
        return self.cluster.rollout.generate(prompts, micro_batches=min(self.cfg.runner.micro_batches_per_step,
                                                                        len(recs)), seed=self.cfg.rollout.seed,
                                             call=(step, _SAMPLED, rnd))

    async def _sync_rollout(self) -> None:
        """Split placement: weights go from the actor to the rollout pool worker to worker. Colocated: the
        rollout engine syncs in-process, lazily, before it generates."""
        if self.cluster.split:
            await self.cluster.rollout.load_weights(self.cluster.actor.state_dict_for_sync(), self.actor_version)
        self.rollout_version = self.actor_version

    def _record(self, step: int, cur: _Launched, metrics: dict[str, float], ctx: StepContext) -> dict[str, Any]:
        """The step's line of metrics.jsonl. ``perf/step_s``: wall time since the previous step was recorded (the
        first step of a run, or after a restart: since its rollout was launched) — with ``max_staleness=1`` a
        rollout is launched during the step before, so counting from the launch made overlapped steps look longer;
        ``perf/tokens_per_s``: the update's response tokens (``actor/tokens``, each counted once) per step_s."""
        now = time.time()
        elapsed = now - (cur.started if self._last_record is None else self._last_record)
        self._last_record = now
        tokens = metrics.get("actor/tokens", 0.0)
        return {"step": step, **{k: float(v) for k, v in metrics.items()}, **ctx.timings,
                "perf/step_s": elapsed, "perf/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "staleness": self.actor_version - 1 - cur.version, "time": now}

    async def _warm_start(self) -> None:
        """The task's supervised warm start before RL (``TaskSpec.warm_start_batch``), at its own constant rate."""
        rows, steps = self.cfg.data.prompts_per_step * self.cfg.rollout.n, self.task.warm_start_steps
        lr = self.task.warm_start_lr or self.cfg.actor.lr  # constant; the actor's schedule starts after
        bar = _progress(steps, 0, "warm start") if self.progress else None
        t0, metrics = time.time(), {}
        try:
            for s in range(steps):
                batch = self.task.warm_start_batch(s, rows, self.cfg.runner.seed, self.cfg.rollout.max_new_tokens)
                metrics = await self.cluster.actor.update_actor(batch, loss_fn=SFTLoss(), lr=lr)
                if metrics.get("actor/skipped", 0.0) > 0:  # a skipped step would also shift the RL schedule
                    raise TrainingDivergedError(
                        f"the warm start diverged at its step {s} of {steps}: the update was skipped because the "
                        f"gradient was not finite (actor/loss={metrics.get('actor/loss', float('nan'))}, "
                        f"actor/grad_norm={metrics.get('actor/grad_norm', float('nan'))}); lower "
                        f"task.params.warm_start_lr (now {lr:g})", s, "actor/skipped")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics.get('actor/loss', float('nan')):.3f}")
        finally:
            if bar is not None:
                bar.close()
        log.info("warm start (%s answers): %d supervised steps of %d rows at lr %g in %.1f s, last loss %.4f",
                 self.task.warm_start_answers, steps, rows, lr, time.time() - t0,
                 metrics.get("actor/loss", float("nan")))
        self.actor_version = 0  # RL starts from the warm-started weights as version 0

    # -- checkpoints ----------------------------------------------------------------------------------------------
    async def save(self, step: int, pending: _Launched | None = None) -> Path:
        """Checkpoint after ``step``: actor (and critic) weights + optimizer + scheduler, sampler state, controller
        RNG, versions, the count of consecutive non-finite steps (``runner.max_bad_steps``). The rollouts' seeds need
        no state: each generate call is seeded by its key (step, stream, round), so the rollout launched ahead,
        generated again on resume, and every call after it sample as in an uninterrupted run.
        Written into a staging directory and renamed into place with a manifest (``pipelines.checkpoint``), so
        ``latest`` always names a complete checkpoint. ``pending``: the next step's rollout, already launched
        (``max_staleness=1``); its prompts were drawn before this checkpoint, so the sampler state they were drawn
        from is kept too, and a resume draws them again."""
        d = ckpt.stage(self.out / "checkpoints", step)  # absolute: self.out is
        c = self.cluster
        roles = ["actor/actor"]  # the engine checkpoints commit refuses to go without (each worker's save writes one)
        try:
            await c.actor.save(str(d / "actor"))
            if c.critic is not None:
                await c.critic.save(str(d / "critic"))
                roles.append("critic/critic")
            if c.split:
                await c.rollout.save(str(d / "rollout"))
            state = {"step": step, "sampler": self.sampler.state_dict(), "actor_version": self.actor_version,
                     "rng": _rng_state(), "config": json.loads(json.dumps(config_to_dict(self.cfg))),
                     "guard": self.guard.state_dict(),  # consecutive bad steps so far: runner.max_bad_steps
                     "generate_seeds": _SEEDS_BY_KEY}
            if pending is not None and pending.step == step + 1 and pending.sampler_before is not None:
                state["sampler_next_step"] = pending.sampler_before
            if self.kl_ctl is not None:
                state["kl_ctl"] = self.kl_ctl.state_dict()
            ckpt.write_json_atomic(d / "runner.json", state)
        except BaseException:
            ckpt.abort(d)
            raise
        try:
            final = await asyncio.to_thread(ckpt.commit, d, keep=self.cfg.runner.keep_checkpoints, roles=roles)
        except CheckpointError:  # a role's weights are not there: refused before anything was renamed
            ckpt.abort(d)
            raise
        self._state_time[step] = time.time()
        return final

    async def _restore(self, state: Any = None) -> None:
        """Load the checkpoint ``prepare_output_dir`` (or a restart) chose and verified before the cluster started.
        ``state``: its ``runner.json`` when the caller has read it already (``run`` reads it once for the config
        check too); None reads it here."""
        d = self._resume_from
        if d is None:
            raise CheckpointError("--resume: no checkpoint was selected; this is a bug in the runner")
        if state is None:
            state = ckpt.read_json(d / "runner.json")
        missing = [k for k in ("step", "sampler", "actor_version", "rng")
                   if not isinstance(state, dict) or k not in state]
        if missing:
            raise CheckpointError(f"{d / 'runner.json'} lacks {missing}; it was not written by this runner")
        c = self.cluster
        try:  # each rank checks the sha256 of the bytes it loads: a file changed since the manifest check is refused
            await c.actor.load(str(d / "actor"))
            if c.critic is not None:
                await c.critic.load(str(d / "critic"))
            if c.split:
                await c.rollout.load(str(d / "rollout"))
        except orc.WorkerError as e:
            if e.exc_type != "CheckpointError":
                raise
            raise CheckpointError(f"--resume from {d}: {e.role} rank {e.rank} cannot load it: {e.message}") from e
        self.sampler.load_state_dict(state["sampler"])
        self._redraw_from = state.get("sampler_next_step")
        if state.get("generate_seeds") != _SEEDS_BY_KEY:
            log.warning("--resume from %s: the checkpoint was written when rollouts were seeded by each rank's running "
                        "counter of generate calls; they are now seeded by step and round, so the resumed steps do "
                        "not sample what the interrupted run would have (training goes on as usual; checkpoints "
                        "written from now on resume exactly)", d)
        _set_rng_state(state["rng"])
        self.actor_version = state["actor_version"]
        self.start_step = state["step"] + 1
        self.kl_ctl = make_kl_controller(self.cfg)  # a checkpoint from before kl_target was set: start anew
        if self.kl_ctl is not None and "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        # the steps after the checkpoint are run again, so the count of consecutive non-finite steps is the
        # checkpoint's (a checkpoint from before it was saved: 0); runner.max_bad_steps is this run's
        self.guard = NonFiniteGuard(self.cfg.runner.max_bad_steps)
        if "guard" in state:
            try:
                self.guard.load_state_dict(state["guard"])
            except ValueError as e:
                raise CheckpointError(f"--resume from {d}: runner.json: {e}; it was not written by this runner") from e


def _build_task(cfg: Config) -> TaskSpec:
    """``get_task(cfg)``; a ``data.train_path`` whose rows cannot be read (bad JSON, a missing column, an unsupported
    file type, no rows) is a :class:`ConfigError` naming it."""
    try:
        return get_task(cfg)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        if not cfg.data.train_path:  # only reading the file raises these here: anything else is a bug
            raise
        raise ConfigError(f"data.train_path: {e}; fix the file or point data.train_path at another",
                          "data.train_path") from e
    except ImportError as e:  # a parquet file without pyarrow (data.load_prompts): an install to make, not a bug
        if not cfg.data.train_path or e.name != "pyarrow":
            raise
        raise ConfigError(f"data.train_path: {e}, or convert the file to .jsonl", "data.train_path") from e


def _check_records(cfg: Config, task: TaskSpec) -> None:
    """One step draws ``data.prompts_per_step`` distinct records: refuse fewer, naming where they come from."""
    n, batch = len(task.records), cfg.data.prompts_per_step
    if n >= batch:
        return
    if cfg.data.train_path:
        source, more = f"data.train_path ({cfg.data.train_path})", "add prompts to the file"
    elif "num_prompts" in cfg.task.params:
        source, more = f"task.params.num_prompts of task {cfg.task.name!r}", "raise task.params.num_prompts"
    else:
        source, more = f"task {cfg.task.name!r}", "give the task more prompts"
    raise ConfigError(f"data.prompts_per_step: bad value {batch}; {source} gives only {n} prompt record(s), fewer "
                      f"than one step takes: lower data.prompts_per_step to {n} or less, or {more}",
                      "data.prompts_per_step")


def _check_device(cfg: Config) -> None:
    """``resources.device=cuda`` with the workers in this process (``resources.backend=local``) needs a GPU here.
    (On Ray the nodes' GPUs are only known once attached: placement names what is missing.)"""
    if cfg.resources.device == "cuda" and cfg.resources.backend == "local" and not torch.cuda.is_available():
        raise ConfigError("resources.device: cuda, but this machine has no usable CUDA GPU (torch.cuda.is_available() "
                          "is false) and resources.backend=local runs every worker here: use resources.device=cpu, "
                          "or install a CUDA build of torch on a GPU machine", "resources.device")


def _unplaceable(e: BaseException) -> ConfigError:
    """A job whose pools the cluster cannot place when it starts: a user error naming what is missing."""
    return ConfigError(f"resources: the job's workers cannot be placed on this cluster: {e}; lower "
                       "resources.actor_workers / rollout_workers / reward_workers, use resources.device=cpu, or "
                       "attach to a cluster that has what is missing (RAY_ADDRESS, docs/cluster.md)", "resources")


# keys that change where and how a run reports or recovers, not what it computes
_NOT_TRAINING = frozenset({"runner.max_bad_steps", "runner.checkpoint_every", "runner.keep_checkpoints",
                           "runner.max_restarts", "runner.restart_timeout_s", "runner.output_dir", "runner.metrics",
                           "runner.tensorboard", "runner.plot", "runner.trace", "resources.backend"})


def _warn_config_changes(state: Any, fallback: Path, now: dict[str, Any]) -> None:
    """On resume: log every training key whose value differs from the config the checkpoint was written with
    (``state``: its parsed ``runner.json``, which keeps it; ``fallback``, the run's ``config.json``, for checkpoints
    from before it did), since the continuation is then not the run that was interrupted (``runner.total_steps``
    moves the LR schedule's end). The caller passes the parsed state so ``runner.json`` is read once per resume."""
    before = state.get("config") if isinstance(state, dict) else None
    try:
        if before is None:
            before = json.loads(fallback.read_text())
    except (OSError, ValueError) as e:
        log.warning("--resume: cannot read the config the checkpoint was written with (%s); config changes are "
                    "not checked", e)
        return

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict) or prefix == "task.params.":
            return {prefix[:-1]: d}
        return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}{key}.").items()}

    old, new = flat(before), flat(json.loads(json.dumps(now)))  # tuples compare as the lists JSON gives back
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
               if k not in _NOT_TRAINING and old.get(k) != new.get(k)]
    if changed:
        log.warning("--resume with a changed config (steps after the checkpoint are not those the interrupted run "
                    "would have taken%s): %s",
                    "; the LR schedule's end moves with runner.total_steps"
                    if any(c.startswith("runner.total_steps:") for c in changed) else "", "; ".join(changed))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """The controller's python, numpy (the legacy global generator, with its cached Gaussian: numpy draws normals
    in pairs and keeps the second) and torch RNG states, as JSON."""
    _, key, pos, has_gauss, cached = np.random.get_state()
    return {"python": repr(random.getstate()), "numpy": key.tolist(), "numpy_pos": int(pos),
            "numpy_gauss": [int(has_gauss), float(cached)], "torch": torch.get_rng_state().tolist()}


def _natural(v: Any) -> bool:
    return type(v) is int and v >= 0


def _check_runner_state(path: Path, state: dict[str, Any]) -> None:
    """Refuse a ``runner.json`` whose values are not what the runner writes, naming the field, before anything
    starts: the manifest's sha256 covers the bytes, not that they make sense (a NaN or negative KL coefficient, a
    negative step, a version that is a string would be taken as they are)."""
    def bad(field: str, value: Any, want: str) -> CheckpointError:
        return CheckpointError(f"{path}: {field} is {value!r:.80}, not {want}; it was not written by this runner")

    for field in ("step", "actor_version"):
        if field in state and not _natural(state[field]):
            raise bad(field, state[field], "a whole number >= 0")
    if "kl_ctl" in state:
        kl = state["kl_ctl"]
        coef = kl.get("coef") if isinstance(kl, dict) else None
        if type(coef) not in (int, float) or not math.isfinite(coef) or coef < 0:
            raise bad("kl_ctl", kl, "an object whose coef is a finite number >= 0")
    if "rng" in state:
        try:  # applied to generators of its own: each part must be a state its generator takes
            _set_rng_state(state["rng"], random.Random(), np.random.RandomState(), torch.Generator())
        except (KeyError, TypeError, ValueError, SyntaxError, RuntimeError, MemoryError, RecursionError) as e:
            raise bad("rng", state["rng"], f"the random states the runner saves ({type(e).__name__}: {e})") from None


def _set_rng_state(s: dict[str, Any], py: Any = random, npr: Any = np.random, gen: Any = None) -> None:
    """Restore what :func:`_rng_state` saved (into the process's generators, or the ones given: a check's own). A
    state from before the cached Gaussian was kept (no ``numpy_gauss``) resumes with none cached, as such checkpoints
    always did."""
    import ast

    py.setstate(ast.literal_eval(s["python"]))
    has_gauss, cached = s.get("numpy_gauss", (0, 0.0))
    npr.set_state(("MT19937", np.array(s["numpy"], dtype=np.uint32), int(s["numpy_pos"]), int(has_gauss),
                   float(cached)))
    state = torch.tensor(s["torch"], dtype=torch.uint8)
    if gen is None:
        torch.set_rng_state(state)
    else:
        gen.set_state(state)


def _progress(total: int, start: int, desc: str = "train") -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)


class RunInterrupted(Exception):
    """The run was ended by SIGINT or SIGTERM (:func:`run`): cancelled, its cleanup done. ``step``: the first step
    not finished (None: before the cluster started); ``checkpoint``: the newest committed checkpoint, where
    ``--resume`` restarts (the message names it and the steps redone); ``exit_code``: 128 + the signal (130, 143)."""

    def __init__(self, signum: int, step: int | None, checkpointed: bool, checkpoint: Path | None = None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.checkpointed = checkpointed or checkpoint is not None
        self.signal_name = signal.Signals(signum).name
        where = "" if step is None else f" at step {step}"
        if checkpoint is not None:
            after = int(checkpoint.name.removeprefix("step_"))  # a committed checkpoint holds the state after it
            redo = [] if step is None else list(range(after + 1, step))
            again = ("" if step is None else ", so no step is run again" if not redo else
                     f", so step {redo[0]} is run again" if len(redo) == 1 else
                     f", so steps {redo[0]}-{redo[-1]} are run again")
            then = f"the newest checkpoint is {checkpoint} (after step {after}){again}; resume with --resume"
        elif self.checkpointed:
            then = "resume with --resume"
        else:
            then = ("no checkpoint was written yet, so --resume has nothing to continue from; start over with "
                    "--overwrite (runner.checkpoint_every sets how often checkpoints are written)")
        super().__init__(f"interrupted ({self.signal_name}){where}; {then}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


class _SignalStop:
    """SIGINT and SIGTERM cancel the run's task, once: the run's finally blocks then run as for any cancellation
    (metrics closed, trace saved, cluster shut down) and :class:`RunInterrupted` is raised. A second signal ends the
    process at once, with the signal's default action. Before the task runs, a signal raises it directly."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.runner: Runner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._done = False

    def handler(self, signum: int, frame: Any) -> None:
        """The Python-level handler of both signals (runs in the main thread, which runs the event loop)."""
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._done:  # the run is over; nothing left to cancel
            return
        self.signum = signum
        if self._task is None:  # not running yet
            raise self._interrupted()
        self._loop.call_soon_threadsafe(self._task.cancel)

    def _interrupted(self) -> RunInterrupted:
        r = self.runner
        step = r.next_step if r is not None and r.cluster is not None else None
        checkpoint = ckpt.newest_committed(r.out / "checkpoints") if r is not None else None
        return RunInterrupted(self.signum, step, checkpoint is not None, checkpoint=checkpoint)

    async def guard(self, work: Coroutine[Any, Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Await ``work`` as the cancellable task; a signal turns its end into :class:`RunInterrupted`."""
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            if self.signum is not None:
                work.close()
                raise self._interrupted()
            return await work
        except asyncio.CancelledError:
            if self.signum is None:
                raise
            self._task.uncancel()
            raise self._interrupted() from None
        except Exception as e:  # a failure while the run was being stopped is part of stopping it
            if self.signum is None or isinstance(e, RunInterrupted):
                raise
            raise self._interrupted() from e
        finally:
            self._done = True


def run(cfg: Config, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
        resume_from: Path | None = None) -> list[dict[str, Any]]:
    """Run a job from synchronous code (the CLI): uvloop when available. Arguments as for :class:`Runner`.
    SIGINT and SIGTERM (handled when called from the main thread) cancel the run cleanly and raise
    :class:`RunInterrupted`."""
    stop = _SignalStop()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop.handler) for sig in stop.SIGNALS} if main_thread else {}
    try:
        stop.runner = Runner(cfg, resume=resume, overwrite=overwrite, progress=progress, resume_from=resume_from)
        return orc.run(stop.guard(stop.runner.run()))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
