"""TensorDict, imported without importing ``torch._dynamo``.

When tensordict is imported it registers a few of its functions with torch.compile
(``torch.compiler.allow_in_graph``, ``assume_constant_result``). Each registration imports ``torch._dynamo``,
which costs 1.3–1.8 s of CPU on a 2-core machine: about 40 % of what a worker process spends importing orchestra,
for a compiler most workers never run. While tensordict imports, this module holds those registrations. They are made later, in order and
unchanged, as soon as ``torch._dynamo`` is imported by anything (``torch.compile`` imports it first). A compiled
function therefore sees what a plain import would have registered. If tensordict or ``torch._dynamo`` is already
imported, tensordict is imported as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.compiler

__all__ = ["TensorDict", "held_registrations"]

_DYNAMO = "torch._dynamo"
_HELD = ("allow_in_graph", "assume_constant_result")
_log = logging.getLogger("orchestra")

# kept across importlib.reload(), which re-runs this module in the same namespace: held registrations stay held
_lock: threading.Lock = globals().get("_lock") or threading.Lock()
_pending: list[tuple[Callable[[Any], Any], Any]] = globals().get("_pending", [])  # (register, its argument), in order
_dynamo_ready: bool = globals().get("_dynamo_ready", False)


def held_registrations() -> int:
    """How many torch.compile registrations wait for ``torch._dynamo`` to be imported (0 once it is)."""
    with _lock:
        return len(_pending)


def _dynamo_loaded() -> bool:
    """True once ``torch._dynamo`` is fully imported (in ``sys.modules`` and no longer initializing)."""
    module = sys.modules.get(_DYNAMO)
    return module is not None and not getattr(module.__spec__, "_initializing", False)


def _replay() -> None:
    """Make every held registration, in the order tensordict asked for them; later calls go straight through.

    Runs as ``torch._dynamo`` finishes importing, so a registration that fails cannot be raised to whoever imported
    it without breaking that import: it is logged with its traceback, and the others are still made."""
    global _dynamo_ready
    with _lock:
        held = list(_pending)
        _pending.clear()
        _dynamo_ready = True
    for register, fn in held:
        try:
            register(fn)
        except Exception:
            _log.exception("torch.compiler.%s(%r), held while tensordict was imported, failed when torch._dynamo "
                           "loaded; torch.compile treats that function as if it had not been registered",
                           register.__name__, fn)


def _holding(register: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A stand-in for ``register`` that returns its argument unchanged and holds the registration until dynamo loads.

    tensordict binds these stand-ins into its own modules (``from torch.compiler import ...``), so they stay correct
    for the life of the process: once ``torch._dynamo`` is imported they call ``register`` directly. An argument the
    real function would not return unchanged (a list, a non-callable) goes straight to it.
    """

    def hold(fn: Any) -> Any:
        if not callable(fn):
            return register(fn)
        if not _dynamo_ready and _dynamo_loaded():  # loaded without our finder seeing it: make what is held now
            _replay()
        with _lock:
            if not _dynamo_ready:
                _pending.append((register, fn))
                return fn
        return register(fn)

    hold.__name__ = register.__name__
    hold.__qualname__ = register.__qualname__
    hold.__doc__ = register.__doc__
    hold.__wrapped__ = register  # type: ignore[attr-defined]
    return hold


class _ReplayAfterExec(importlib.abc.Loader):
    """Runs ``torch._dynamo``'s own loader, then makes the held registrations and retires the finder; leaves the
    module's loader as found."""

    def __init__(self, loader: importlib.abc.Loader, finder: _WhenDynamoImports) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)  # if this raises, the finder stays: a later import replays instead
        self._finder.retire()
        _replay()


class _WhenDynamoImports(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders would, with its loader wrapped to replay what was held. Stays on
    ``sys.meta_path`` until that import has run (a ``find_spec`` that only looks does not retire it)."""

    def retire(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO or _dynamo_ready:
            return None
        for finder in list(sys.meta_path):  # the other finders, in the order the import system asks them
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            _log.warning("torch._dynamo has no loader; %d held torch.compile registrations of tensordict stay unmade",
                         held_registrations())
            return spec
        spec.loader = _ReplayAfterExec(spec.loader, self)
        return spec


def _import_tensordict() -> ModuleType:
    global _dynamo_ready
    if "tensordict" in sys.modules or _DYNAMO in sys.modules:
        _dynamo_ready = _DYNAMO in sys.modules
        import tensordict

        return tensordict
    finder = _WhenDynamoImports()
    sys.meta_path.insert(0, finder)
    originals = {name: getattr(torch.compiler, name) for name in _HELD}
    for name, register in originals.items():
        setattr(torch.compiler, name, _holding(register))
    try:
        import tensordict
    finally:
        for name, register in originals.items():
            setattr(torch.compiler, name, register)
    if not _dynamo_ready and _dynamo_loaded():  # another thread imported torch._dynamo before our finder was in place
        finder.retire()
        _replay()
    return tensordict


TensorDict = _import_tensordict().TensorDict
