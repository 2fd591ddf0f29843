"""Stop a run that has stopped training: non-finite losses or gradient norms, or steps whose updates were all
skipped. Without this a diverged run "finishes" with NaN metrics and exit status 0."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NonFiniteGuard", "TrainingDivergedError"]

log = logging.getLogger("orchestra")

ROLES = ("actor", "critic")
WATCHED = ("loss", "grad_norm")


class TrainingDivergedError(RuntimeError):
    """The run diverged; ``step`` and ``metric`` (e.g. ``"actor/grad_norm"``) name where it was seen."""

    def __init__(self, message: str, step: int, metric: str) -> None:
        super().__init__(message)
        self.step = step
        self.metric = metric


@dataclass
class NonFiniteGuard:
    """Checks each step's metrics (``actor/*``, ``critic/*`` from the update endpoints) and raises
    :class:`TrainingDivergedError` when

    - ``<role>/loss`` or ``<role>/grad_norm`` has been non-finite for ``max_bad_steps`` consecutive steps, or
    - every optimizer update of a role in one step was skipped (``<role>/skipped == <role>/optimizer_steps``:
      the engine skips an update whose gradient is not finite, so nothing was learned this step).

    What it tolerates it says: a warning for each non-finite step short of ``max_bad_steps`` and for each step some
    of whose updates were skipped, and :meth:`at_end` one when the run ends inside a run of non-finite steps.
    """

    max_bad_steps: int = 3
    bad_run: int = field(default=0, init=False)  # consecutive steps with a non-finite watched metric

    def __post_init__(self) -> None:
        if self.max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {self.max_bad_steps}")

    def state_dict(self) -> dict[str, int]:
        """The count of consecutive bad steps, for a checkpoint (a resume or restart continues it)."""
        return {"bad_run": self.bad_run}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the count saved by :meth:`state_dict` (``max_bad_steps`` stays this guard's: the config's)."""
        bad_run = state.get("bad_run") if isinstance(state, Mapping) else None
        if isinstance(bad_run, bool) or not isinstance(bad_run, int) or bad_run < 0:
            raise ValueError(f"non-finite guard state: bad_run must be a whole number >= 0, got {state!r}")
        self.bad_run = bad_run

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``step``'s metrics; raise if the run has diverged."""
        for role in ROLES:
            updates = metrics.get(f"{role}/optimizer_steps", 0.0)
            skipped = metrics.get(f"{role}/skipped", 0.0)
            if 0 < skipped < updates:
                log.warning("step %d: %d of %d %s updates were skipped because the gradient was not finite (%s/loss="
                            "%s, %s/grad_norm=%s); the step learned from the others", step, int(skipped),
                            int(updates), role, role, metrics.get(f"{role}/loss"), role,
                            metrics.get(f"{role}/grad_norm"))
            if updates > 0 and skipped >= updates:
                raise TrainingDivergedError(
                    f"training diverged at step {step}: all {int(updates)} {role} updates were skipped because "
                    f"the gradient was not finite ({role}/skipped={int(skipped)}, {role}/loss="
                    f"{metrics.get(f'{role}/loss', float('nan'))}, {role}/grad_norm="
                    f"{metrics.get(f'{role}/grad_norm', float('nan'))}); lower the learning rate or check the "
                    f"inputs", step, f"{role}/skipped")
        bad = [(k, v) for role in ROLES for name in WATCHED
               if (v := metrics.get(k := f"{role}/{name}")) is not None and not math.isfinite(v)]
        if not bad:
            self.bad_run = 0
            return
        self.bad_run += 1
        if self.bad_run < self.max_bad_steps:
            log.warning("step %d: %s not finite (%d of runner.max_bad_steps=%d consecutive non-finite steps before "
                        "the run stops)", step, ", ".join(f"{k}={v}" for k, v in bad), self.bad_run,
                        self.max_bad_steps)
        if self.bad_run >= self.max_bad_steps:
            key, value = bad[0]
            raise TrainingDivergedError(
                f"training diverged at step {step}: {key}={value} (non-finite for {self.bad_run} consecutive steps, "
                f"runner.max_bad_steps={self.max_bad_steps}); lower the learning rate or check the inputs",
                step, key)

    def at_end(self, last_step: int) -> None:
        """The run ended after ``last_step``: warn when its last steps were non-finite (tolerated, short of
        ``max_bad_steps``), so a run whose final metrics are NaN does not end as if nothing had happened."""
        if self.bad_run:
            log.warning("the run ended after %d consecutive non-finite steps (steps %d-%d; runner.max_bad_steps=%d "
                        "stops a run at that many): %s, and a checkpoint of a later step holds the weights those "
                        "steps left", self.bad_run, last_step - self.bad_run + 1, last_step, self.max_bad_steps,
                        f"its last finite step is {last_step - self.bad_run}" if last_step >= self.bad_run else
                        "no step of it was finite")
