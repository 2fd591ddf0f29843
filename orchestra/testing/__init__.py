"""orchestra.testing: a pytest plugin and helpers for testing your own Workers, dispatch transforms and pipeline
steps (see docs/testing.md).

Installed with the package (entry point ``pytest11: orchestra``), so no conftest is needed. Fixtures:
``orc_cluster`` (session: a private local cluster, or the one already started), ``make_group`` (function, async:
``await make_group(WorkerCls, *init_args, ranks=2, **pool_kwargs)``; every group it made is closed at the end of the
test, and the test fails if calls, tasks or actors were left behind) and ``orc_sequencer``. Options:
``--orc-backend=ray|local`` (``local``: every rank in the test process, see ``orchestra._local``) and
``--orc-num-cpus``. Marker: ``@pytest.mark.orc_backend("local")`` runs one test's (or module's) groups in process
in a Ray session; ``orc_backend("ray")`` skips a test that needs real processes under ``--orc-backend=local``.

Helpers: ``Sequencer`` (order events across ranks without sleeps), ``FailOnCue`` + ``fail_rank`` (one rank's next
call of an endpoint raises), ``kill_rank`` (SIGKILL one rank — in-process: end it as a death — and wait until the
group reports it).

This module does not import pytest (the fixtures live in ``orchestra.testing._plugin``, registered when pytest
configures): worker processes import it to unpickle a Sequencer or a Worker mixing in ``FailOnCue``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ._helpers import FailOnCue, InjectedFailure, Sequencer, SequencerError, fail_rank, kill_rank

__all__ = ["FailOnCue", "InjectedFailure", "Sequencer", "SequencerError", "fail_rank", "kill_rank"]


def __getattr__(name: str) -> Any:
    # the helpers import Ray and the core: loaded on first use, so that loading the plugin (every pytest run in
    # the environment does) stays cheap
    if name not in __all__:
        raise AttributeError(f"module 'orchestra.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module("._helpers", __name__), name)
    globals()[name] = value
    return value


def pytest_addoption(parser: Any) -> None:
    """``--orc-backend`` and ``--orc-num-cpus`` (also settable as ini options ``orc_backend``/``orc_num_cpus``)."""
    group = parser.getgroup("orchestra", "orchestra test cluster")
    group.addoption("--orc-backend", choices=("ray", "local"), default=None,
                    help="where make_group's ranks run: 'ray' (a local Ray cluster; default) or 'local' (the "
                         "in-process backend: every rank in the test process, no Ray; seconds per test file)")
    group.addoption("--orc-num-cpus", default=None,
                    help="logical CPUs of the private local cluster orc_cluster starts: a whole number >= 1 "
                         "(default 4)")
    parser.addini("orc_backend", "default of --orc-backend", default="ray")
    parser.addini("orc_num_cpus", "default of --orc-num-cpus", default="4")


def pytest_configure(config: Any) -> None:
    """Register the fixtures (importing pytest only now) and reject bad options."""
    from . import _plugin

    _plugin.check_options(config)
    config.addinivalue_line("markers", "orc_backend(name): 'local' runs the test's make_group groups in process "
                                       "whatever --orc-backend says; 'ray' skips the test under --orc-backend=local")
    if not config.pluginmanager.is_registered(_plugin):
        config.pluginmanager.register(_plugin, "orchestra.testing.fixtures")
