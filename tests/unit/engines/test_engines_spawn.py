"""``engines._dist.spawn`` forks ranks from a fork server that imported torch and the engines once, instead of
starting an interpreter per rank; a rank still sees the caller's environment at the call and nothing else of the
caller. The checks run in a fresh interpreter of their own, so that the fork server they see is one they started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys
    import engines._dist as d
    logging.basicConfig(level=logging.INFO)
    from engines_testutils import process_report_worker

    def run():
        return d.spawn(process_report_worker, 2, ["ORC_SPAWN_PROBE", "PYTEST_CURRENT_TEST"])

    d.parent_only = "set in the parent"  # module state of the caller: must not reach a rank
    out = {"first": run()}
    os.environ["PYTEST_CURRENT_TEST"] = "another test"  # changes between tests; no import reads it
    out["volatile"] = run()
    os.environ["ORC_SPAWN_PROBE"] = "changed"  # any other change: ranks start as fresh interpreters
    out["changed"] = run()
    del os.environ["ORC_SPAWN_PROBE"]
    out["back"] = run()
    print(json.dumps(out))
""")


@pytest.mark.slow  # a fresh interpreter and a fork server
def test_ranks_fork_from_the_server_with_the_callers_environment_and_nothing_else():
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k not in ("ORC_SPAWN_PROBE", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for run in out.values():
        assert [r["rank"] for r in run] == ["0", "1"]
        assert all(r["parent_only"] == "" for r in run), run
    assert [r["start_method"] for r in out["first"]] == ["forkserver"] * 2
    assert [r["env:ORC_SPAWN_PROBE"] for r in out["first"]] == ["", ""]
    # a variable pytest changes per test keeps the fork server, and the rank sees its value at the call
    assert [(r["start_method"], r["env:PYTEST_CURRENT_TEST"]) for r in out["volatile"]] == [("forkserver", "another test")] * 2
    # another change: fresh interpreters, which see it; once it is undone, the fork server again
    assert [(r["start_method"], r["env:ORC_SPAWN_PROBE"]) for r in out["changed"]] == [("spawn", "changed")] * 2
    assert [(r["start_method"], r["env:ORC_SPAWN_PROBE"]) for r in out["back"]] == [("forkserver", "")] * 2
    assert "spawn: ORC_SPAWN_PROBE changed since the fork server started" in proc.stderr
