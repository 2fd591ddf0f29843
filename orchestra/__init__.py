"""orchestra: async-first orchestration of distributed RL post-training on Ray.

Every WorkerGroup call returns an awaitable DataFuture at once; futures passed to the next call are forwarded
worker to worker; dispatch transforms (``orchestra.dispatch``) say how a call is split over ranks.

Names are imported on first use (PEP 562), so ``import orchestra`` — and the pytest plugin ``orchestra.testing``,
which every pytest run in the environment loads — costs nothing until torch or Ray is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from . import dispatch
    from ._batch import Batch
    from ._errors import (
        CallCancelledError,
        CallTimeoutError,
        DispatchError,
        GroupClosedError,
        OrchestraError,
        PlacementError,
        WorkerDiedError,
        WorkerError,
    )
    from ._future import DataFuture, Part
    from ._group import WorkerGroup
    from ._pool import ResourcePool
    from ._runtime import init, run, shutdown
    from ._stats import controller_stats, reset_controller_stats
    from ._trace import Tracer
    from ._worker import Worker, endpoint

_WHERE = {
    "Batch": "._batch",
    "CallCancelledError": "._errors",
    "CallTimeoutError": "._errors",
    "DataFuture": "._future",
    "DispatchError": "._errors",
    "GroupClosedError": "._errors",
    "OrchestraError": "._errors",
    "Part": "._future",
    "PlacementError": "._errors",
    "ResourcePool": "._pool",
    "Tracer": "._trace",
    "Worker": "._worker",
    "WorkerDiedError": "._errors",
    "WorkerError": "._errors",
    "WorkerGroup": "._group",
    "controller_stats": "._stats",
    "dispatch": ".dispatch",
    "endpoint": "._worker",
    "init": "._runtime",
    "reset_controller_stats": "._stats",
    "run": "._runtime",
    "shutdown": "._runtime",
}

__all__ = sorted(_WHERE, key=lambda n: (n[0].islower(), n))

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'orchestra' has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if name == "dispatch" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
