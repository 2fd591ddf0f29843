"""One pickle per call and rank: the codec of the fast path's socket frames and of the general path's Ray calls.

A call's arguments for one rank are pickled once, by the C pickler, into one ``bytes`` frame — before any rank is
sent anything, so the frame is also the call's serialization check. Ray then carries that one bytes object (cheap:
no per-argument cloudpickle pass, no second pickling), and the rank unpickles it once.

ObjectRefs (and actor handles) cannot hide inside a frame: Ray must see every ref a call carries, to keep the objects
(and actors) alive while the rank holds them. ``dumps_call`` lifts them out into a list that travels next to the
frame as a Ray argument (nested, so Ray neither fetches them before the call nor lets a failed upstream stall the
rank's queue); ``loads_call`` puts them back. A ref given as an argument itself is one Ray resolves to its value
before the call: the caller leaves it a top-level argument of the Ray call and puts ``Resolved(i)`` in the frame,
which ``loads_call`` replaces by that value. ``dumps_frame`` (the socket, which Ray does not see) refuses refs and
handles with ``NeedsRay``.

Replies too: on the general path a Batch result's Output comes back from the rank as one frame (``Host._reply``),
which Ray carries as plain bytes; ``read_reply`` reads it in the controller's reply lane and on reading ranks.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray import cloudpickle

from . import _backend

__all__ = ["FRAME_BYTES", "NO_ARGUMENTS", "NeedsRay", "RefFrame", "Resolved", "dumps_frame", "loads_frame",
           "dumps_call", "loads_call", "dumps_reply", "read_reply", "reductions"]

FRAME_BYTES = 1 << 20  # a frame larger than this is not made: the call takes Ray's own per-argument path
_PLAIN, _OUT_OF_BAND = b"\x00", b"\x01"  # a frame's first byte: a pickle alone, or a pickle and its buffers
NO_ARGUMENTS = _PLAIN + pickle.dumps(((), {}), protocol=pickle.HIGHEST_PROTOCOL)  # the frame of a call with none


class NeedsRay(Exception):
    """A frame holds an ObjectRef or an actor handle (only Ray may carry one: it tracks who holds it) or is too
    large for a frame."""


def _refuse(obj: Any) -> Any:
    raise NeedsRay(type(obj).__name__)


def registered_for(*types: type) -> dict[type, Any]:
    """The reduction registered now for each of ``types`` (None: none), as ``reductions()`` would hold it, without
    merging the tables: copyreg's and cloudpickle's, looked up map by map (a call's frame template reads Batch's on
    every call)."""
    table = cloudpickle.CloudPickler.dispatch_table
    maps = table.maps if type(table) is collections.ChainMap else (table,)
    out: dict[type, Any] = {}
    for t in types:
        found = None
        for m in maps:
            if t in m:
                found = m[t]
                break
        out[t] = found
    return out


def reductions() -> dict:
    """The reductions Ray's own serializer would use, as they are now: copyreg's, then those registered with
    cloudpickle (``ray.util.register_serializer``, Ray's own), which win. Read once per call (every rank's frame
    of a call is pickled with the same table), so a registration applies from the next call on."""
    table: dict = {}
    registered = cloudpickle.CloudPickler.dispatch_table
    for m in reversed(registered.maps if isinstance(registered, collections.ChainMap) else [registered]):
        table.update(m)
    return table


def _table(on_ref: Callable[[Any], Any], base: dict | None = None) -> dict:
    """``base`` (default: ``reductions()`` now) with ObjectRefs and actor handles going to ``on_ref``. A plain dict,
    so the C pickler looks types up in C."""
    table = dict(reductions() if base is None else base)
    table.update(dict.fromkeys(_tracked(), on_ref))
    return table


def _tracked() -> tuple[type, ...]:
    """What only Ray may carry: ObjectRefs, and actor handles (Ray counts who holds one; a handle pickled out of
    band is not counted, so its actor could be ended while a rank still holds it)."""
    return ray.ObjectRef, ray.actor.ActorHandle


def _by_value_modules() -> Any:
    """Modules registered with ``cloudpickle.register_pickle_by_value``: their objects must travel by value."""
    return getattr(getattr(cloudpickle, "cloudpickle", cloudpickle), "_PICKLE_BY_VALUE_MODULES", ())


def _pickle(obj: Any, on_ref: Callable[[Any], Any],
            base: dict | None = None) -> tuple[io.BytesIO, list[pickle.PickleBuffer]]:
    """``obj`` pickled by the C pickler (cloudpickle where it cannot: lambdas, local classes, ``__main__``'s
    objects, modules registered by value), ObjectRefs reduced by ``on_ref``; out-of-band buffers apart. ``base``:
    the reductions to use (``reductions()``; read now when not given)."""
    buf, buffers = io.BytesIO(), []
    by_value = bool(_by_value_modules())
    table = _table(on_ref, base)
    if not by_value:
        try:
            p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffers.append)
            p.dispatch_table = table
            p.dump(obj)
        except NeedsRay:
            raise
        except (pickle.PicklingError, AttributeError, TypeError):
            by_value = True
        else:
            # the C pickler names __main__'s classes and functions by reference; a rank cannot import the driver
            # script (or a notebook), so those go by value, as Ray's cloudpickle sends them
            by_value = b"__main__" in buf.getvalue()
    if by_value:
        buf, buffers = io.BytesIO(), []
        _CloudPickler(buf, table, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffers.append).dump(obj)
    return buf, buffers


class _CloudPickler(cloudpickle.CloudPickler):
    """The fallback for what the C pickler cannot name (lambdas, local classes), as Ray would send it, with the same
    reductions as the C pickler's (``table``: the call's, ObjectRefs to ``on_ref``). (The pickler reads its dispatch
    table when made: it is set before.)"""

    def __init__(self, file: io.BytesIO, table: dict, **kwargs: Any) -> None:
        self.dispatch_table = table
        super().__init__(file, **kwargs)


_ALIGN = 16  # each out-of-band buffer starts at a multiple of this in its frame: aligned for every dtype's scalars


def _gap(at: int) -> int:
    """The zero bytes that put offset ``at`` on the next multiple of ``_ALIGN``."""
    return -at % _ALIGN


def _framed(buf: io.BytesIO, buffers: list[pickle.PickleBuffer], limit: int | None) -> bytes:
    """A frame: the pickle alone, or a header (sizes), the pickle, and each out-of-band buffer at an offset aligned
    to ``_ALIGN`` (a misaligned complex128 column crashed the process on an indexed write)."""
    raws = [b.raw() for b in buffers]
    size = buf.tell() + sum(r.nbytes for r in raws)
    if limit is not None and size > limit:
        raise NeedsRay(f"{size} bytes")
    if not raws:
        return _PLAIN + buf.getvalue()
    head = struct.pack(f"!cIQ{len(raws)}Q", _OUT_OF_BAND, len(raws), buf.tell(), *(r.nbytes for r in raws))
    pieces, at = [head, buf.getvalue()], len(head) + buf.tell()
    for r in raws:
        pad = _gap(at)
        if pad:
            pieces.append(bytes(pad))
        pieces.append(r)
        at += pad + r.nbytes
    return b"".join(pieces)


def _address(view: memoryview) -> int:
    """Where the first byte of ``view`` (a non-empty one) sits in memory."""
    return np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data


_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINERS = frozenset({list, tuple, dict})
_PLAIN_ITEMS = 64


def _plain(obj: Any) -> bool:
    """Whether ``obj`` is only None, bools, ints, floats, strings and bytes, in (exact) lists, tuples and dicts — at
    most ``_PLAIN_ITEMS`` values in all. The C pickler writes those types itself before it looks up any reduction
    (a dispatch table, copyreg, a ``reducer_override``), so such a value pickles to the same bytes without building
    the call's reductions table: a reply such as ``{"loss": 0.5}`` or ``None`` skips that work on every call."""
    if type(obj) in _ATOMS:
        return True
    todo, left = [obj], _PLAIN_ITEMS
    while todo:
        x = todo.pop()
        left -= 1
        if left < 0:  # a large (or self-holding) value: the general pickling, whose cost the walk would not save
            return False
        t = type(x)
        if t in _ATOMS:
            continue
        if t not in _CONTAINERS:
            return False
        if t is dict:
            todo.extend(x.keys())
            todo.extend(x.values())
        else:
            todo.extend(x)
    return True


def dumps_frame(obj: Any, limit: int | None = FRAME_BYTES) -> bytes:
    """Pickle ``obj`` for a frame; NeedsRay when it holds a ref or is larger than ``limit`` (None: no limit). Out-of-band buffers
    (numpy arrays) travel after the pickle, so that ``loads_frame`` hands them out read-only, as Ray does."""
    if _plain(obj):  # the same bytes as below (see _plain), without the reductions table and Pickler set-up
        data = _PLAIN + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if limit is not None and len(data) - 1 > limit:
            raise NeedsRay(f"{len(data) - 1} bytes")
        return data
    return _framed(*_pickle(obj, _refuse), limit)


def loads_frame(data: bytes, private: bool = False) -> Any:
    """The object ``dumps_frame`` pickled; its out-of-band buffers are read-only views of ``data`` (a numpy array
    arrives read-only, as from Ray's object store). A Batch's tensors are views too, and torch lets them be
    written: ``private`` unpickles from a copy of ``data``, for bytes that are read again (a fast-path reply)."""
    view = memoryview(data)
    if view[:1] == _PLAIN:
        return pickle.loads(view[1:])
    if private or _address(view) % _ALIGN:  # (a frame that starts misaligned: its buffers would be too)
        data = view = memoryview(bytes(view))  # a copy: every read of ``data`` gets buffers of its own
    n, body = struct.unpack_from("!IQ", data, 1)
    sizes = struct.unpack_from(f"!{n}Q", data, 13)
    at = 13 + 8 * n
    main = view[at:at + body]
    at += body
    buffers = []
    for size in sizes:
        at += _gap(at)
        buffers.append(view[at:at + size])
        at += size
    return pickle.loads(main, buffers=buffers)


class RefFrame:
    """A reply frame whose value holds ObjectRefs or actor handles, lifted out next to it (``dumps_call``): Ray
    pickles this small object, so it sees and tracks every ref, while the value itself stays one private pickle.
    (Returned as Ray's own object, a value's Batch was deserialized as a view of the buffer Ray keeps — its object
    store's shared memory, or the owner's in-process copy of a small one — the same memory for every reader.)"""

    __slots__ = ("data", "refs")

    def __init__(self, data: bytes, refs: list[Any]) -> None:
        self.data, self.refs = data, refs

    def __reduce__(self) -> tuple[type, tuple[bytes, list[Any]]]:
        return RefFrame, (self.data, self.refs)


def dumps_reply(obj: Any) -> bytes | RefFrame:
    """``obj`` as a reply Ray carries, whatever its size: a frame (``bytes``), or a RefFrame when it holds refs.
    Each read (``read_reply``) unpickles its own copy: Ray hands out ``bytes`` — alone or inside a RefFrame — as a
    fresh copy, so no two readers share the buffers of a Batch in it."""
    try:
        return dumps_frame(obj, limit=None)
    except NeedsRay:  # it holds a ref or a handle: Ray carries those next to the frame
        return RefFrame(*dumps_call(obj, limit=None))


def read_reply(x: Any) -> Any:
    """A rank's Ray reply as its value: a frame (exactly ``bytes``: ``Host._reply`` returns an output that fits a
    frame as one, and never a bare bytes value otherwise) or a RefFrame unpickled, anything else as it came. A frame
    that cannot be rebuilt here raises ``ReplyUnreadable``, as Ray's deserializer failing does."""
    kind = type(x)
    if kind is not bytes and kind is not RefFrame:
        return x
    try:
        return loads_frame(x) if kind is bytes else loads_call(x.data, x.refs)
    except Exception as e:  # noqa: BLE001 - reported as the reply's own failure (convert_error names the rank)
        raise _backend.ReplyUnreadable(e) from None


_loading = threading.local()  # the refs and resolved values of the call being unpickled on this thread


def _ref_at(i: int) -> Any:
    """Unpickling a call's frame: the ``i``-th ref that travelled next to it."""
    return _loading.refs[i]


def _value_at(i: int) -> Any:
    """Unpickling a call's frame: the value Ray resolved for the ``i``-th top-level ref argument."""
    return _loading.values[i]


class Resolved:
    """In a frame, the place of the ``i``-th ref given as a top-level argument: the rank gets its value."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
        return _value_at, (self.i,)


def dumps_call(obj: Any, limit: int | None = FRAME_BYTES, base: dict | None = None) -> tuple[bytes, list[Any]]:
    """A frame of ``obj`` for a Ray call, and the ObjectRefs and actor handles it holds, lifted out in order (each
    distinct one once): Ray carries the list, so it knows every ref and handle the call holds. NeedsRay when the
    frame is larger than ``limit`` (None: no limit). ``base``: the call's ``reductions()``, read once for all its ranks."""
    refs: list[Any] = []
    index: dict[Any, int] = {}

    def lift(ref: Any) -> tuple[Callable[[int], Any], tuple[int]]:
        i = index.get(ref)
        if i is None:
            i = index[ref] = len(refs)
            refs.append(ref)
        return _ref_at, (i,)

    return _framed(*_pickle(obj, lift, base), limit), refs


def loads_call(data: bytes, refs: list[Any], values: tuple = ()) -> Any:
    """The object ``dumps_call`` pickled, with ``refs`` (as Ray delivered them) back in their places, and ``values``
    (what Ray resolved the top-level ref arguments to) in the places of their ``Resolved``."""
    _loading.refs, _loading.values = refs, values
    try:
        return loads_frame(data)
    finally:
        _loading.refs = _loading.values = None
