"""orchestra.testing without a cluster: importing orchestra (or the helpers workers unpickle) never imports pytest,
the plugin is installed through the pytest11 entry point, fail_rank refuses a Worker that did not opt in, and a bad
``orc_backend`` marker stops a run before any test starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from orchestra import ResourcePool, Worker, WorkerGroup, endpoint
from orchestra.testing import fail_rank


def test_importing_orchestra_and_its_test_helpers_does_not_import_pytest():
    code = ("import sys, orchestra, orchestra.testing; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest', 'pytest_asyncio')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_plugin_is_registered_through_the_pytest11_entry_point(pytestconfig):
    assert [ep.value for ep in entry_points(group="pytest11") if ep.name == "orchestra"] == ["orchestra.testing"]
    assert pytestconfig.pluginmanager.has_plugin("orchestra.testing.fixtures")


class Plain(Worker):
    @endpoint
    def work(self) -> int:
        return self.rank


def test_fail_rank_asks_for_the_fail_on_cue_mixin():
    group = WorkerGroup(ResourcePool(process_on_nodes=[2]), Plain)  # no event loop: nothing starts
    try:
        with pytest.raises(TypeError, match="mix orchestra.testing.FailOnCue into its Worker"):
            asyncio.run(fail_rank(group, 0, "work"))
        with pytest.raises(AttributeError, match="has no endpoint 'nope'"):
            asyncio.run(fail_rank(group, 0, "nope"))
        with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
            asyncio.run(fail_rank(group, 2, "work"))
    finally:
        group.shutdown()


def test_the_sequencer_actors_module_imports_no_torch():
    """The Sequencers' Ray actor process imports only the module its class is defined in: keep it free of torch (and
    of the core), or its start costs a torch import (~4 s of CPU on 2 cores)."""
    from orchestra.testing._helpers import _SequencerHost

    code = (f"import sys, {_SequencerHost.__module__}; "
            f"print(sorted(m for m in ('torch', 'tensordict', 'orchestra._group') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_marker_naming_no_backend_stops_the_run_before_any_test_runs(tmp_path):
    """An ``orc_backend`` marker naming neither backend is a usage error at collection: pytest exits with 4 and
    names the test, and no test ran (the marked test would create a file)."""
    ran = tmp_path / "ran"
    (tmp_path / "test_bad_marker.py").write_text(
        "import pytest\n\n\n"
        "def test_unmarked():\n"
        f"    open({str(ran)!r}, 'w').close()\n\n\n"
        "@pytest.mark.orc_backend('gpu')\n"
        "def test_marked():\n"
        "    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--orc-backend=local",
                           "-o", "asyncio_default_fixture_loop_scope=function", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "test_bad_marker.py::test_marked: write @pytest.mark.orc_backend('local')" in out, out
    assert not ran.exists()
