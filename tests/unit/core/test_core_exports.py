"""The public surface of ``orchestra``: exactly the documented names, nothing private, and no heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import orchestra
from orchestra import dispatch

PUBLIC = {
    "Batch", "CallCancelledError", "CallTimeoutError", "DataFuture", "DispatchError", "GroupClosedError",
    "OrchestraError", "Part", "PlacementError",
    "ResourcePool", "Tracer", "Worker", "WorkerDiedError", "WorkerError", "WorkerGroup", "controller_stats",
    "dispatch", "endpoint", "init", "reset_controller_stats", "run", "shutdown",
}
DISPATCH_PUBLIC = {
    "Dispatch", "Plan", "ShardSpec", "broadcast", "scatter", "shard", "pad", "rank_zero", "metrics", "stream",
    "dp_with_func", "only_ranks", "from_rank",
}


def test_all_is_exactly_the_public_api():
    assert len(orchestra.__all__) == len(set(orchestra.__all__)), "duplicate names in orchestra.__all__"
    assert set(orchestra.__all__) == PUBLIC


def test_every_exported_name_exists_and_none_is_private():
    for name in orchestra.__all__:
        assert not name.startswith("_"), name
        assert getattr(orchestra, name, None) is not None, f"orchestra.{name} is in __all__ but missing"


def test_no_undeclared_public_names_at_top_level():
    public = {n for n in dir(orchestra) if not n.startswith("_")}
    assert public == set(orchestra.__all__), f"undeclared: {sorted(public - set(orchestra.__all__))}"
    assert isinstance(orchestra.__version__, str)


def test_errors_form_one_hierarchy():
    for name in ("CallTimeoutError", "DispatchError", "PlacementError", "WorkerDiedError", "WorkerError"):
        assert issubclass(getattr(orchestra, name), orchestra.OrchestraError), name
    assert issubclass(orchestra.WorkerDiedError, orchestra.WorkerError)


def test_dispatch_all():
    assert isinstance(orchestra.dispatch, types.ModuleType)
    assert len(dispatch.__all__) == len(set(dispatch.__all__))
    assert set(dispatch.__all__) == DISPATCH_PUBLIC
    for name in dispatch.__all__:
        assert not name.startswith("_")
        assert getattr(dispatch, name, None) is not None, f"orchestra.dispatch.{name} is in __all__ but missing"


def test_dispatch_factories_return_transforms():
    made = [dispatch.broadcast(), dispatch.scatter(), dispatch.shard(), dispatch.shard(mesh="m", pad=True),
            dispatch.pad(), dispatch.rank_zero(), dispatch.metrics("sum"), dispatch.stream(), dispatch.dp_with_func(),
            dispatch.only_ranks(0, 1), dispatch.from_rank(1)]
    assert all(isinstance(d, dispatch.Dispatch) for d in made)


def test_importing_orchestra_does_not_import_engines_pipelines_or_transformers():
    code = ("import json, sys; import orchestra; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('engines', 'pipelines', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
