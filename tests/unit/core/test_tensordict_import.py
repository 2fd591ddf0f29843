"""orchestra imports tensordict without torch._dynamo, and torch.compile still sees every registration tensordict
makes at import: the same functions allowed in graph and marked constant as after a plain ``import tensordict``."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter: optionally imports orchestra first, then makes torch._dynamo load (by import or by
# torch.compile), then lists every tensordict function torch.compile treats specially.
_PROBE = """
import json, sys, types
FIRST
import orchestra._tensordict as shim
import torch
report = {"dynamo_before": "torch._dynamo" in sys.modules, "held_before": shim.held_registrations()}
THEN
import torch._dynamo.trace_rules as rules
allowed, constant = set(), set()
for name, module in list(sys.modules.items()):
    if not name.startswith("tensordict") or module is None:
        continue
    for attr, obj in list(vars(module).items()):
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
            if id(obj) in rules._allowed_callable_ids:
                allowed.add(f"{name}.{attr}")
            if getattr(obj, "_dynamo_marked_constant", False):
                constant.add(f"{name}.{attr}")
report.update(allowed=sorted(allowed), constant=sorted(constant), held_after=shim.held_registrations(),
              finders=[type(f).__name__ for f in sys.meta_path])
print(json.dumps(report))
"""


def _probe(first: str, then: str) -> dict:
    code = _PROBE.replace("FIRST", first).replace("THEN", then)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_compile_sees_the_registrations_a_plain_tensordict_import_makes():
    plain = _probe("import tensordict, torch._dynamo", "")
    compiled = ("f = torch.compile(lambda x: x * 2 + 1, backend='eager', fullgraph=True)\n"
                "assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]")
    deferred = _probe("import orchestra._batch, orchestra._host, orchestra._worker", compiled)

    assert plain["dynamo_before"] and plain["held_before"] == 0  # already imported: nothing held
    assert not deferred["dynamo_before"], "importing orchestra imported torch._dynamo"
    assert deferred["held_before"] > 0
    assert deferred["held_after"] == 0
    assert "_WhenDynamoImports" not in deferred["finders"]
    assert "tensordict.base._foreach_copy_compiled" in plain["allowed"]
    assert "tensordict.utils._lock_warn" in plain["constant"]
    assert deferred["allowed"] == plain["allowed"]
    assert deferred["constant"] == plain["constant"]


def test_a_registration_after_torch_dynamo_loads_goes_straight_through():
    late = ("import torch._dynamo\n"
            "from tensordict.utils import _wrap_functorch_function\n"
            "def late_fn(x):\n    return x\n"
            "assert _wrap_functorch_function(late_fn) is late_fn\n"
            "import tensordict.utils as u; u.late_fn = late_fn")
    report = _probe("import orchestra._batch", late)
    assert report["held_after"] == 0
    assert "tensordict.utils.late_fn" in report["allowed"]

