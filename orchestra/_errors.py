"""Errors of the orchestra API: each says what went wrong, where (group, role, rank, endpoint) and what to change."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["OrchestraError", "WorkerError", "WorkerDiedError", "CallTimeoutError", "CallCancelledError", "DispatchError",
           "PlacementError", "GroupClosedError", "UPSTREAM_FAILED", "DECLARED_DEAD"]

# exc_type of the WorkerError a rank raises when an upstream call it reads from failed; the controller replaces
# it with the upstream's own error (the group, rank and endpoint that actually failed).
UPSTREAM_FAILED = "UpstreamFailed"
#: ``WorkerDiedError.exc_type`` of a rank that declared itself dead (``Worker.declare_dead``): its process may live on
DECLARED_DEAD = "DeclaredDead"


class OrchestraError(Exception):
    """Base class of every error orchestra raises on purpose."""


def _where(group: str | None, role: str | None, rank: int | None, endpoint: str | None) -> str:
    bits = []
    if group:
        bits.append(f"group {group!r}")
    if role and role != group:
        bits.append(f"role {role!r}")
    if rank is not None:
        bits.append(f"rank {rank}")
    if endpoint:
        bits.append(f"endpoint {endpoint!r}")
    return ", ".join(bits) or "unknown location"


class WorkerError(OrchestraError):
    """An endpoint raised on a worker; carries the location and the remote traceback."""

    def __init__(self, message: str, *, group: str | None = None, role: str | None = None, rank: int | None = None,
                 endpoint: str | None = None, remote_traceback: str = "", exc_type: str = "") -> None:
        self.group, self.role, self.rank, self.endpoint = group, role, rank, endpoint
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        self.message = message
        text = f"{exc_type + ': ' if exc_type else ''}{message}\n  at {_where(group, role, rank, endpoint)}"
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild_worker_error, (type(self), self.message, self.group, self.role, self.rank, self.endpoint,
                                        self.remote_traceback, self.exc_type))


def _rebuild_worker_error(cls, message, group, role, rank, endpoint, tb, exc_type):
    return cls(message, group=group, role=role, rank=rank, endpoint=endpoint, remote_traceback=tb, exc_type=exc_type)


class WorkerDiedError(WorkerError):
    """The worker process of a rank died (crash, OOM kill, node loss) while a call needed it, or the rank declared
    itself dead (``Worker.declare_dead``: ``declared`` is True)."""

    @property
    def declared(self) -> bool:
        """Whether the rank declared itself dead (its process may live on until its group closes)."""
        return self.exc_type == DECLARED_DEAD


class CallTimeoutError(OrchestraError, TimeoutError):
    """A call ran past its deadline; names the ranks still running."""

    def __init__(self, message: str, *, group: str | None = None, endpoint: str | None = None,
                 pending_ranks: Sequence[int] = ()) -> None:
        self.group, self.endpoint, self.pending_ranks = group, endpoint, tuple(pending_ranks)
        super().__init__(message)


class CallCancelledError(OrchestraError):
    """The call was cancelled (``fut.cancel()``, a sibling rank's failure, or a cancelled awaiter) before it gave a
    result. Not an ``asyncio.CancelledError``: tasks that did not ask for the cancel see an ordinary error."""


class GroupClosedError(OrchestraError, RuntimeError):
    """The group (or orchestra itself) was shut down: calls in flight then, and calls made after, fail with this."""


class DispatchError(OrchestraError, ValueError):
    """The arguments of a call do not fit its dispatch; raised in the controller before anything is sent."""


class PlacementError(OrchestraError, RuntimeError):
    """A resource pool cannot be placed on the cluster (needed vs available, or a timeout)."""
