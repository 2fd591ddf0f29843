"""The fixtures of the orchestra pytest plugin (registered by ``orchestra.testing.pytest_configure``)."""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - make_group then says what to install
    pytest_asyncio = None

log = logging.getLogger("orchestra")

# Bounds on waits that only a leak exceeds: a passing test never waits for them.
LEAK_WAIT_S = 30.0


def check_options(config: pytest.Config) -> None:
    """Reject a bad ``--orc-backend`` or ``--orc-num-cpus`` at start-up, before any test runs."""
    backend(config)
    num_cpus(config)


def backend(config: pytest.Config) -> str:
    """``--orc-backend``, else the ``orc_backend`` ini option (default ``ray``)."""
    value = config.getoption("orc_backend", None) or config.getini("orc_backend") or "ray"
    if value not in ("ray", "local"):
        raise pytest.UsageError(f"orc_backend = {value!r}: choose 'ray' or 'local'")
    return value


def num_cpus(config: pytest.Config) -> float:
    """``--orc-num-cpus``, else the ``orc_num_cpus`` ini option (default 4): logical CPUs of the private cluster, a
    whole number >= 1 (Ray starts a cluster only with a whole CPU count; the in-process backend takes the same, so
    that a suite means the same on both). Anything else stops the run at start-up, before any test."""
    raw = config.getoption("orc_num_cpus", None)
    if raw is None:
        raw = config.getini("orc_num_cpus") or "4"
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"orc_num_cpus = {raw!r} is not a number") from None
    if not (math.isfinite(value) and value >= 1 and value.is_integer()):
        raise pytest.UsageError(f"--orc-num-cpus must be a whole number >= 1, got {raw}")
    return value


@pytest.fixture(scope="session")
def orc_cluster(pytestconfig: pytest.Config) -> Iterator[dict[str, float]]:
    """The session's cluster: a private local Ray cluster (loopback, token auth) with ``--orc-num-cpus`` CPUs, shut
    down at the end; or, when Ray is already initialized (the user started one), that cluster, left running. With
    ``--orc-backend=local``, the in-process backend instead (no Ray): one it starts and ends, or the in-process
    session the user started, left as it is. Yields its resources (``{"CPU": 4.0, ...}``). Reusing a session whose
    CPU count is not ``--orc-num-cpus`` warns, naming both."""
    import ray

    import orchestra as orc
    from orchestra import _backend

    n = num_cpus(pytestconfig)
    if backend(pytestconfig) == "local":
        current = _backend.current()
        if current.name == "local":  # orc.init(backend="local") ran before: the user's session
            resources = current.resources()
            reusing("in-process session (orc.init(backend='local'))", resources, n)
            yield resources
            return
        session = orc.init(backend="local", num_cpus=n)
        mine = _backend.current()
        try:
            yield dict(session.resources)
        finally:
            end_local_session(mine)  # not orc.shutdown(): that would also stop a Ray cluster the user started
        return
    if ray.is_initialized():
        resources = dict(ray.cluster_resources())
        reusing("Ray cluster", resources, n)
        yield resources
        return
    session = orc.init(num_cpus=int(n))
    try:
        yield dict(session.resources)
    finally:
        orc.shutdown()


def reusing(what: str, resources: dict[str, float], n: float) -> None:
    """Say that ``orc_cluster`` uses a session the user started (and leaves it running); warn when its CPU count is
    not the ``n`` that ``--orc-num-cpus`` asks for."""
    log.info("orc_cluster: reusing the %s already started; it is not shut down at the end", what)
    cpus = resources.get("CPU", 0.0)
    if cpus != n:
        msg = (f"orc_cluster: reusing the {what} started before the tests, with {cpus:g} CPU(s); --orc-num-cpus={n:g} "
               f"(or the orc_num_cpus ini option; 4 when unset) does not apply to it. Start it with {n:g} CPUs, or "
               f"pass --orc-num-cpus={cpus:g} to say that is what you want")
        log.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)


def end_local_session(local: Any) -> None:
    """End the in-process session ``orc_cluster`` started: close the groups on its backend (their ranks stop), forget
    the backend, make Ray the default again. Nothing else: a Ray cluster, or groups the user made on it, stay."""
    from orchestra import _backend, _runtime

    groups = [g for g in list(_runtime._groups) if g.pool.backend is local and g.closed is None]
    elsewhere = [g.name for g in groups if (loop := g.home_loop()) is not None and _runtime.runs_elsewhere(loop)]
    if elsewhere:
        raise RuntimeError(f"orc_cluster: in-process group(s) {elsewhere} live on an event loop running in another "
                           f"thread; close them on that loop (await group.aclose()) before the session ends")
    for g in groups:
        g.close("orchestra was shut down")
        g.finish_close()
    try:
        registered = _backend.by_name("local")
    except ValueError:  # already forgotten (an orc.shutdown() in a test)
        registered = None
    if registered is local:
        _backend.unregister("local")
    if _backend.current() is local:
        _backend.set_current(None)


_MARKED_LOCAL = pytest.StashKey[Any]()


def marked_local_backend(config: pytest.Config, resources: dict[str, float]) -> Any:
    """The in-process backend of the groups of tests marked ``orc_backend("local")`` in a Ray session: one for the
    session, with the session's CPUs (``resources``, what ``orc_cluster`` yields), as its Ray groups have."""
    local = config.stash.get(_MARKED_LOCAL, None)
    if local is None:
        from orchestra._local import LocalBackend

        local = config.stash[_MARKED_LOCAL] = LocalBackend(num_cpus=resources.get("CPU"))
    return local


@pytest.fixture
def orc_sequencer(orc_cluster: dict[str, float]) -> Iterator[Any]:
    """A fresh ``orchestra.testing.Sequencer`` for this test (closed afterwards: its waiting positions fail)."""
    from ._helpers import Sequencer

    seq = Sequencer()
    try:
        yield seq
    finally:
        seq.close()


@dataclass
class _Made:
    group: Any
    actors: list[Any] = field(default_factory=list)


class GroupFactory:
    """What the ``make_group`` fixture gives a test: ``await make_group(WorkerCls, *init_args, ranks=2,
    init_kwargs=None, group_name=None, **pool_kwargs)`` returns a ready ``WorkerGroup``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, backend: Any = None) -> None:
        self.loop = loop
        self.backend = backend  # its pools' backend (a name or a Backend), by the test's marker; None: the session's
        self.made: list[_Made] = []
        self._told: dict[int, int] = {}  # per made group (by index): how many of its callback errors were reported

    def new_callback_errors(self) -> list[str]:
        """The errors raised by ``on_death`` callbacks of this test's groups not reported yet (each reported once:
        after the test body, or by the teardown for those raised since)."""
        new = []
        for i, g in enumerate(self.groups):
            raised = g.death_callback_errors()
            new += raised[self._told.get(i, 0):]
            self._told[i] = len(raised)
        return new

    @property
    def groups(self) -> list[Any]:
        """Every group made in this test, in order."""
        return [m.group for m in self.made]

    async def __call__(self, cls: type, *init_args: Any, ranks: int = 2, init_kwargs: dict[str, Any] | None = None,
                       group_name: str | None = None, **pool_kwargs: Any) -> Any:
        """A ready group of ``ranks`` ranks of ``cls(*init_args, **init_kwargs)`` on a fresh
        ``ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.1, **pool_kwargs)``."""
        from orchestra import ResourcePool, WorkerGroup

        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("make_group was set up on another event loop than the one this test runs on: give "
                               "async fixtures and tests the same loop scope (pytest ini options "
                               "asyncio_default_fixture_loop_scope and asyncio_default_test_loop_scope, or "
                               "@pytest.mark.asyncio(loop_scope=...))")
        pool_kwargs.setdefault("cpus_per_worker", 0.1)
        if self.backend is not None:
            pool_kwargs.setdefault("backend", self.backend)
        pool = ResourcePool(process_on_nodes=[ranks], **pool_kwargs)
        group = WorkerGroup(pool, cls, *init_args, group_name=group_name, **(init_kwargs or {}))
        made = _Made(group)
        self.made.append(made)  # before ready(): a group whose start-up fails is still closed and checked
        await group.ready()
        made.actors = list(group._shared.hosts)  # not group.actors: that turns the fast path off
        return group


def in_flight(factory: GroupFactory) -> list[str]:
    """The calls still in flight on the groups ``factory`` made and the test did not close: closing a group ends
    its calls (they fail with ``GroupClosedError``), the test's own explicit act, as ``fut.cancel()`` is."""
    return [c for g in factory.groups if not g.closed for c in g.calls_in_flight()]


async def replies_of_calls_read(factory: GroupFactory, bound: float = LEAK_WAIT_S) -> None:
    """Until the calls in flight that another call read (or something awaits) have received their ranks' replies,
    up to ``bound`` s: such a call has run (its reader read its rows), but its replies may reach the controller
    after the reader's (Ray delivers the replies of different actors in any order). A call nobody awaited nor read
    is not waited for: it is reported at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while True:
        pending = {f for g in factory.groups if not g.closed for inv in list(g._shared.live) if inv.read_elsewhere()
                   for f in inv.unreceived()}
        left = deadline - loop.time()
        if not pending or left <= 0:
            return
        await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)


def not_drained(factory: GroupFactory) -> list[str]:
    """The streams of the groups ``factory`` made and the test left open that finished, but whose parts the test
    stopped reading before the end (``async for ...: break``) and never awaited after (``streams_not_drained``)."""
    return [c for g in factory.groups if not g.closed for c in g.streams_not_drained()]


def failed_unawaited(factory: GroupFactory) -> list[str]:
    """The calls of the groups ``factory`` made that failed with nothing awaiting them, closed groups included (a
    group keeps them after its close): a test that closes its group itself hides no failure."""
    return [c for g in factory.groups for c in g.failed_calls_not_awaited()]


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    """After a test body that passed: fail the test when calls of groups made by ``make_group`` are still in flight
    (a call never awaited, or a stream never drained; a call another call read is given its replies first:
    ``replies_of_calls_read``), or failed with nothing awaiting them (an error no one saw,
    whether or not the test closed the group). A body that raised is reported as is."""
    result = yield
    factory = getattr(pyfuncitem, "funcargs", {}).get("make_group")
    if isinstance(factory, GroupFactory):
        problems = []
        left = in_flight(factory)
        if left and not factory.loop.is_running() and not factory.loop.is_closed():
            factory.loop.run_until_complete(replies_of_calls_read(factory))
            left = in_flight(factory)
        if left:
            problems.append(f"calls still in flight when the test ended: {left}; await every call (or cancel it) "
                            f"before the test returns")
        undrained = not_drained(factory)
        if undrained:
            problems.append(f"streams not drained when the test ended: {undrained}; their parts were read only in "
                            f"part (async for ...: break): read them to the end, or await (or cancel) the future")
        failed = failed_unawaited(factory)
        if failed:
            problems.append(f"calls failed and nothing awaited them: {failed}; await every call (one expected to "
                            f"fail: with pytest.raises(...): await fut)")
        raised = factory.new_callback_errors()
        if raised:
            problems.append(callback_errors_message(raised))
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)
    return result


def callback_errors_message(raised: list[str]) -> str:
    """The failure text for errors raised by ``on_death`` callbacks of a test's groups."""
    return ("on_death callbacks of its groups raised (each traceback is in the captured log); a callback's error "
            "fails the test: fix the callback, or let it record what it saw and assert on that in the test body:\n  - "
            + "\n  - ".join(raised))


async def close_and_check(factory: GroupFactory, before: set[asyncio.Task], bound: float = LEAK_WAIT_S) -> list[str]:
    """Close every group ``factory`` made; return what was left behind: pools still held, orchestra tasks still
    running (waited for up to ``bound`` s), actors still alive after close (each given ``bound`` s to die; an
    in-process rank: its threads, still running an endpoint that never polls ``cancelled()``, given ``bound`` s
    from the start of the close to end). A failing ``aclose()`` raises (after the other groups were closed)."""
    import anyio

    from orchestra import WorkerDiedError
    from orchestra._invocation import convert_error
    from orchestra._local import LocalActor

    loop = asyncio.get_running_loop()
    closing = loop.time()
    errors: list[BaseException] = []
    for m in factory.made:
        try:
            await m.group.aclose()
        except Exception as e:  # noqa: BLE001 - every group is closed first; the errors are raised below
            log.error("make_group: closing %r failed: %r", m.group, e)
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup("make_group: closing groups failed", errors)

    problems = [f"{m.group!r}: its resource pool is still held after close" for m in factory.made
                if m.group.pool.holds_refs()]
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and t not in before and t.get_name().startswith("orchestra:")]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=bound)
        if pending:
            problems.append(f"orchestra tasks still running {bound:g} s after the groups closed: "
                            f"{sorted(t.get_name() for t in pending)}")

    async def stops(group: Any, rank: int, actor: LocalActor) -> str | None:
        # an in-process rank is gone once its lanes' threads ended (its watch call fails as soon as it is killed)
        left = max(0.0, bound - (loop.time() - closing))
        running = await anyio.to_thread.run_sync(actor.wait_stopped, left, limiter=anyio.CapacityLimiter(1))
        if not running:
            return None
        what = ", ".join(w if w.startswith("(") else f"endpoint {w!r}" for w in running)
        return (f"{group!r} rank {rank}: still running {what} {bound:g} s after the group closed (an in-process "
                f"rank's thread cannot be killed: make the endpoint return when self.cancelled() is True)")

    async def dies(group: Any, rank: int, actor: Any) -> str | None:
        if isinstance(actor, LocalActor):
            return await stops(group, rank, actor)
        # the host's watch call never returns while the process lives, and fails once it is dead
        try:
            await asyncio.wait_for(asyncio.wrap_future(actor.watch.remote().future()), bound)
        except asyncio.TimeoutError:
            return f"{group!r} rank {rank}: its actor is still alive {bound:g} s after the group closed"
        except Exception as e:  # noqa: BLE001 - a death is what is expected; anything else is reported
            if isinstance(convert_error(e, group.name, "watch", rank), WorkerDiedError):
                return None
            return f"{group!r} rank {rank}: its watch call failed without a death after close: {e!r}"
        return f"{group!r} rank {rank}: its actor answered after the group closed"

    found = await asyncio.gather(*[dies(m.group, r, a) for m in factory.made for r, a in enumerate(m.actors)])
    problems += [p for p in found if p]
    return problems


def marked_backend(item: pytest.Item) -> str | None:
    """The backend a test's ``@pytest.mark.orc_backend("local" | "ray")`` names (the closest marker: test, class or
    module), or None without one. Checked for every test at collection (``pytest_collection_modifyitems``)."""
    marker = item.get_closest_marker("orc_backend")
    if marker is None:
        return None
    name = marker.args[0] if len(marker.args) == 1 and not marker.kwargs else None
    if name not in ("ray", "local"):
        raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.orc_backend('local') or "
                                f"@pytest.mark.orc_backend('ray'), got orc_backend{marker.args!r}")
    return name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A bad ``orc_backend`` marker stops the run as a usage error before any test starts; a test marked
    ``orc_backend("ray")`` is skipped in a session on the in-process backend (with or without ``make_group``)."""
    local_session = backend(config) == "local"
    for item in items:
        if marked_backend(item) == "ray" and local_session:
            item.add_marker(pytest.mark.skip(reason="needs the Ray backend (marked orc_backend('ray')); this "
                                                    "session runs --orc-backend=local"))


if pytest_asyncio is not None:
    @pytest_asyncio.fixture
    async def make_group(orc_cluster: dict[str, float], request: pytest.FixtureRequest) -> AsyncIterator[GroupFactory]:
        """``group = await make_group(WorkerCls, *init_args, ranks=2, **pool_kwargs)``: a ready WorkerGroup (pool
        ``ResourcePool(process_on_nodes=[ranks], cpus_per_worker=0.1, **pool_kwargs)``; ``init_kwargs=`` and
        ``group_name=`` pass through). After the test every group it made is closed; the test fails if calls were
        left in flight, failed unawaited, or an ``on_death`` callback raised, and its teardown fails if orchestra
        tasks, actors or pools outlive the close. A test marked ``@pytest.mark.orc_backend("local")`` gets in-process
        groups whatever the session's backend (in a Ray session: one in-process backend for the session, with the
        session's CPUs)."""
        loop = asyncio.get_running_loop()
        before = {t for t in asyncio.all_tasks(loop) if t.get_name().startswith("orchestra:")}
        marked = marked_backend(request.node)
        if marked == "local" and backend(request.config) == "ray":  # in process, with the session's CPUs
            marked = marked_local_backend(request.config, orc_cluster)
        elif marked == "local":
            marked = None  # the session's own in-process backend
        factory = GroupFactory(loop, marked)
        yield factory
        problems = await close_and_check(factory, before)
        raised = factory.new_callback_errors()  # raised after the test body (or a body that failed: not checked)
        if raised:
            problems.append(callback_errors_message(raised))
        if problems:
            pytest.fail("make_group: left behind after the test:\n  - " + "\n  - ".join(problems), pytrace=False)
else:  # pragma: no cover
    @pytest.fixture
    def make_group() -> None:
        """Needs pytest-asyncio."""
        raise pytest.UsageError("the make_group fixture needs pytest-asyncio: pip install pytest-asyncio")
