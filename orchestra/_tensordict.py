"""TensorDict, imported without importing ``torch._dynamo``.

When tensordict is imported it registers a few of its functions with torch.compile
(``torch.compiler.allow_in_graph``, ``assume_constant_result``). Each registration imports ``torch._dynamo``,
which costs about 1 s of CPU: 40 % of what a worker process spends importing orchestra, for a compiler most workers
never run. While tensordict imports, this module holds those registrations. They are made later, in order and
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

_lock = threading.Lock()
_pending: list[tuple[Callable[[Any], Any], Any]] = []  # (torch.compiler's function, its argument), in call order
_dynamo_ready = False


def held_registrations() -> int:
    """How many torch.compile registrations wait for ``torch._dynamo`` to be imported (0 once it is)."""
    with _lock:
        return len(_pending)


def _replay() -> None:
    """Make every held registration, in the order tensordict asked for them; later calls go straight through."""
    global _dynamo_ready
    with _lock:
        held = list(_pending)
        _pending.clear()
        _dynamo_ready = True
    for register, fn in held:
        register(fn)


def _holding(register: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A stand-in for ``register`` that returns its argument unchanged and holds the registration until dynamo loads.

    tensordict binds these stand-ins into its own modules (``from torch.compiler import ...``), so they stay correct
    for the life of the process: once ``torch._dynamo`` is imported they call ``register`` directly. An argument the
    real function would not return unchanged (a list, a non-callable) goes straight to it.
    """

    def hold(fn: Any) -> Any:
        if not callable(fn):
            return register(fn)
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
    """Runs ``torch._dynamo``'s own loader, then makes the held registrations; leaves the module's loader as found."""

    def __init__(self, loader: importlib.abc.Loader, finder: _WhenDynamoImports) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        try:
            self._loader.exec_module(module)
        except BaseException:
            sys.meta_path.insert(0, self._finder)  # a later import of torch._dynamo replays instead
            raise
        _replay()


class _WhenDynamoImports(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders would and wraps its loader to replay what was held."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        try:
            sys.meta_path.remove(self)  # one import only; the finders after us find the real spec
        except ValueError:
            pass
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
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
    return tensordict


TensorDict = _import_tensordict().TensorDict
