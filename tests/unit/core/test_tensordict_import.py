"""orchestra imports tensordict without torch._dynamo, and torch.compile still sees every registration tensordict
makes at import: the same functions allowed in graph and marked constant as after a plain ``import tensordict``."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter: optionally imports orchestra first, then makes torch._dynamo load (by import or by
# torch.compile), then lists every tensordict function torch.compile treats specially. ``calls`` are the
# registrations tensordict made (plain: seen by dynamo as they happen; deferred: as held before dynamo loaded), and
# ``made`` says whether each held one was in effect once dynamo had loaded.
_PROBE = """
import json, sys, types
calls, fns = [], []
def name(fn):
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"
FIRST
import orchestra._tensordict as shim
import torch
report = {"dynamo_before": "torch._dynamo" in sys.modules, "held_before": shim.held_registrations()}
if not report["dynamo_before"]:
    fns = [(register.__name__, fn) for register, fn in shim._pending]
    calls = [(kind, name(fn)) for kind, fn in fns]
THEN
import torch._dynamo.trace_rules as rules
allowed, constant = set(), set()
for mod_name, module in list(sys.modules.items()):
    if not mod_name.startswith("tensordict") or module is None:
        continue
    for attr, obj in list(vars(module).items()):
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
            if id(obj) in rules._allowed_callable_ids:
                allowed.add(f"{mod_name}.{attr}")
            if getattr(obj, "_dynamo_marked_constant", False):
                constant.add(f"{mod_name}.{attr}")
made = [id(fn) in rules._allowed_callable_ids if kind == "allow_in_graph" else
        getattr(fn, "_dynamo_marked_constant", False) for kind, fn in fns]
report.update(allowed=sorted(allowed), constant=sorted(constant), held_after=shim.held_registrations(),
              finders=[type(f).__name__ for f in sys.meta_path], calls=calls, made=made)
print(json.dumps(report))
"""

# Records each registration as torch._dynamo receives it, while tensordict is imported the plain way.
_PLAIN = """import torch._dynamo as dynamo
def recording(kind, real):
    def record(fn):
        calls.append((kind, name(fn)))
        return real(fn)
    return record
real = dynamo.allow_in_graph, dynamo.assume_constant_result
dynamo.allow_in_graph = recording("allow_in_graph", real[0])
dynamo.assume_constant_result = recording("assume_constant_result", real[1])
import tensordict
dynamo.allow_in_graph, dynamo.assume_constant_result = real"""


def _probe(first: str, then: str) -> dict:
    code = _PROBE.replace("FIRST", first).replace("THEN", then)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_compile_sees_the_registrations_a_plain_tensordict_import_makes():
    plain = _probe(_PLAIN, "")
    compiled = ("f = torch.compile(lambda x: x * 2 + 1, backend='eager', fullgraph=True)\n"
                "assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]")
    deferred = _probe("import orchestra._batch, orchestra._host, orchestra._worker", compiled)

    assert plain["dynamo_before"] and plain["held_before"] == 0  # already imported: nothing held
    assert not deferred["dynamo_before"], "importing orchestra imported torch._dynamo"
    assert deferred["held_before"] > 0
    assert deferred["held_after"] == 0
    assert "_WhenDynamoImports" not in deferred["finders"]
    # every registration tensordict makes at import was held, in its order, and is in effect once dynamo loads
    assert [tuple(c) for c in deferred["calls"]] == [tuple(c) for c in plain["calls"]]
    assert len(plain["calls"]) == deferred["held_before"] and all(deferred["made"])
    assert "tensordict.base._foreach_copy_compiled" in plain["allowed"]
    assert "tensordict.utils._lock_warn" in plain["constant"]
    assert deferred["allowed"] == plain["allowed"]
    assert deferred["constant"] == plain["constant"]


def test_a_lookup_keeps_registrations_held_until_the_import_and_later_ones_go_straight_through():
    steps = ("import importlib.util\n"
             "assert importlib.util.find_spec('torch._dynamo') is not None\n"  # looks, imports nothing
             "assert 'torch._dynamo' not in sys.modules and shim.held_registrations() == report['held_before']\n"
             "import torch._dynamo\n"
             "from tensordict.utils import _wrap_functorch_function\n"
             "def late_fn(x):\n    return x\n"
             "assert _wrap_functorch_function(late_fn) is late_fn\n"  # tensordict's bound stand-in, after the load
             "import tensordict.utils as u; u.late_fn = late_fn")
    report = _probe("import orchestra._batch", steps)
    assert report["held_before"] > 0 and report["held_after"] == 0 and all(report["made"])
    assert "_WhenDynamoImports" not in report["finders"]
    assert "tensordict.utils.late_fn" in report["allowed"]
