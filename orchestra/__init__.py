"""orchestra: async-first orchestration of distributed RL post-training on Ray.

Every WorkerGroup call returns an awaitable DataFuture at once; futures passed to the next call are forwarded
worker to worker; dispatch transforms (``orchestra.dispatch``) say how a call is split over ranks.
"""

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

__all__ = [
    "Batch",
    "CallCancelledError",
    "CallTimeoutError",
    "DataFuture",
    "DispatchError",
    "GroupClosedError",
    "OrchestraError",
    "Part",
    "PlacementError",
    "ResourcePool",
    "Tracer",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "controller_stats",
    "dispatch",
    "endpoint",
    "init",
    "reset_controller_stats",
    "run",
    "shutdown",
]

__version__ = "0.1.0"
