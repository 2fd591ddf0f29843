"""Worker and @endpoint: how a user declares what a rank can do and how each call is dispatched over the group."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .dispatch import Dispatch, broadcast, pads

__all__ = ["Worker", "endpoint", "EndpointSpec", "MeshInfo"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MeshInfo:
    """A rank's place in a named data-parallel mesh: its DP replica and whether its outputs are collected."""

    dp_rank: int
    dp_size: int
    is_collector: bool = True


@dataclass(frozen=True)
class EndpointSpec:
    """What @endpoint records on a method: its dispatch, whether it streams, and the columns it needs."""

    name: str
    dispatch: Dispatch
    streaming: bool
    is_async: bool
    requires: tuple[str, ...] = ()
    zero_copy_inputs: bool = False
    signature: inspect.Signature | None = None


_SPEC_ATTR = "__orchestra_endpoint__"


def endpoint(dispatch: Dispatch | Callable[..., Any] | None = None, *, requires: Sequence[str] = (),
             zero_copy_inputs: bool = False) -> Any:
    """Mark a Worker method as callable on the whole group, with ``dispatch`` saying how a call is split and collected.

    Use bare (``@endpoint``: broadcast) or with a transform (``@endpoint(D.shard())``). ``requires`` names input
    columns checked before the method runs. Input batches are the method's own: writing into them changes nothing
    another reader sees. ``zero_copy_inputs=True`` skips the copy that costs for rows read whole from one stored
    part, handing the method views of the object store's shared memory instead — a promise never to write into
    them. Generator methods (sync or async) stream their yields.
    """

    def wrap(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@endpoint decorates a method, got {fn!r}")
        spec = EndpointSpec(
            name=fn.__name__,
            dispatch=dispatch if isinstance(dispatch, Dispatch) else broadcast(),
            streaming=inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn),
            is_async=inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
            requires=tuple(requires),
            zero_copy_inputs=zero_copy_inputs,
            signature=inspect.signature(fn),
        )
        if spec.streaming and pads(spec.dispatch):
            raise TypeError(f"@endpoint({spec.dispatch!r}) on generator {fn.__qualname__}: a streaming endpoint "
                            f"cannot pad its rows, since its yields are stored as they come and pad()'s filler rows "
                            f"could not be taken out of them. Drop pad (shard(allow_empty=True) takes any row "
                            f"count), or return one Batch instead of yielding")
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    if callable(dispatch) and not isinstance(dispatch, Dispatch):
        fn, dispatch = dispatch, None
        return wrap(fn)
    if dispatch is not None and not isinstance(dispatch, Dispatch):
        raise TypeError(f"@endpoint takes a dispatch transform such as D.shard(), got {dispatch!r}")
    return wrap


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    """Every @endpoint method of a Worker class (including inherited ones)."""
    out: dict[str, EndpointSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, _SPEC_ATTR, None)
            if isinstance(spec, EndpointSpec):
                out[name] = spec
    return out


class _Context:
    """Per-process facts a Worker reads: set by the host before the user's __init__ runs."""

    def __init__(self, group: str, role: str, rank: int, world_size: int, local_rank: int,
                 is_cancelled: Callable[[], bool] | None = None, own_process: bool = True,
                 declare_dead: Callable[[str], None] | None = None) -> None:
        self.group, self.role, self.rank, self.world_size, self.local_rank = group, role, rank, world_size, local_rank
        self.own_process = own_process
        self.meshes: dict[str, MeshInfo] = {}
        self.is_cancelled = is_cancelled or (lambda: False)
        self.declare_dead = declare_dead


class Worker:
    """Base class of the code that runs on each rank.

    ``self.rank``, ``self.world_size`` and ``self.local_rank`` (and the RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT environment variables) are set before ``__init__`` runs, so ``torch.distributed`` initializes
    with no arguments. Endpoints run in the process's single compute thread, in the order calls arrive.
    Under the in-process backend (``orc.init(backend="local")``) the ranks share one process: the environment
    variables are not set per rank and ``own_process`` is False (see ``orchestra._local``).
    """

    _orc: _Context

    @property
    def rank(self) -> int:
        """This rank's index in its group (0 .. world_size-1)."""
        return self._orc.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._orc.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of the group on the same node."""
        return self._orc.local_rank

    @property
    def own_process(self) -> bool:
        """False when the ranks share one process (the in-process backend): ``torch.distributed`` and the RANK /
        WORLD_SIZE environment cannot then be per rank, so a multi-rank collective cannot run."""
        return self._orc.own_process

    @property
    def role(self) -> str:
        """The role name this worker plays (the group name unless colocated)."""
        return self._orc.role

    def register_mesh(self, name: str, *, dp_rank: int, dp_size: int, is_collector: bool = True) -> None:
        """Declare this rank's data-parallel place in mesh ``name``, for ``shard(mesh=name)`` dispatch.

        Ranks of one DP replica (e.g. the TP/PP ranks of a model copy) share a ``dp_rank`` and get the same rows;
        only ranks with ``is_collector`` contribute results. A mesh keeps its layout: the controller looks it up once
        and shards by it from then on, so registering ``name`` again with another layout raises (the same one is
        fine); register a new layout under a new name.
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"register_mesh({name!r}): dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        info = MeshInfo(int(dp_rank), int(dp_size), bool(is_collector))
        had = self._orc.meshes.get(name)
        if had is not None and had != info:
            raise ValueError(
                f"register_mesh({name!r}): this rank is registered in mesh {name!r} as dp_rank {had.dp_rank} of "
                f"{had.dp_size} ({'a collector' if had.is_collector else 'not a collector'}), and a mesh keeps its "
                f"layout (the controller looks it up once and shards by it); register the new layout under another "
                f"name, e.g. {name + '_v2'!r}, and shard by that")
        self._orc.meshes[name] = info

    def cancelled(self) -> bool:
        """True once the call running now was cancelled by the controller; long loops should poll it and return."""
        return self._orc.is_cancelled()

    def declare_dead(self, reason: str) -> None:
        """Declare this rank unusable for good (for instance: it aborted its process groups, so a peer blocked in
        a collective is released only when this process ends). Supervision then treats the rank as dead, as if its
        process had exited: the group's calls fail with ``WorkerDiedError`` naming ``reason`` (its ``declared`` is
        True: the pipeline runner stops the run, as for an endpoint error, instead of restarting), ``health()`` and
        ``on_death`` callbacks report it, and closing the group ends the
        rank (its process, on Ray). The call running now still ends as usual on this rank, but the controller may
        learn of the death first (the call then fails with that WorkerDiedError); later calls do not run here."""
        ctx = getattr(self, "_orc", None)
        if ctx is None or ctx.declare_dead is None:
            raise RuntimeError(f"{type(self).__name__}.declare_dead: this Worker was not started by a WorkerGroup, "
                               f"so there is no group to tell")
        ctx.declare_dead(f"role {ctx.role!r}: {reason}")
