"""Batch: the unit of data that flows between workers.

A Batch is a ``tensordict.TensorDict`` with one batch dimension (N rows), per-row non-tensor columns (numpy object
arrays: strings, ids, ground truths) and a small ``meta`` dict that travels with every shard and part.
Tensor work (slicing, concatenation, selection) is delegated to TensorDict; what TensorDict lacks (row-aligned
non-tensor columns, padding that remembers its pad count, a zero-copy wire format) lives here.
"""

from __future__ import annotations

import copy
import ctypes
import math
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import torch

from ._tensordict import TensorDict
from tensordict import is_non_tensor, is_tensor_collection  # after ._tensordict: it imports tensordict first

__all__ = ["Batch"]

# The torch dtypes numpy has; a column of any other dtype (bfloat16, every float8 and float4, complex32, the sub-byte
# and bits dtypes) travels and concatenates as a view of the integer dtype of its element size, viewed back after.
_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                           torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128})
_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _NumpyViews(dict):
    """dtype -> the integer dtype numpy carries it as (None: numpy has it; computed once per dtype)."""

    def __missing__(self, dtype: torch.dtype) -> torch.dtype | None:
        view = None if dtype in _NUMPY_DTYPES else _BY_SIZE.get(dtype.itemsize)
        self[dtype] = view
        return view


_NUMPY_UNSUPPORTED = _NumpyViews()


def _cannot_travel(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot be a column on the wire (None when it can): the wire carries dense, strided tensors
    with data, of any dtype, on any device (copied to the CPU); a subclass that only adds Python behaviour arrives
    as a plain tensor, one that redefines the tensor's contents (``__torch_dispatch__``: DTensor, jagged) cannot
    travel. Each reason says what to pass instead."""
    if type(t) is torch.Tensor and t.layout is torch.strided and not t.is_quantized and not t.is_meta:
        return None  # (the common case, first: this runs for every column of a preflight's Batch)
    if t.is_nested:
        return ("a nested (jagged) tensor cannot travel between processes: pad its rows into a dense tensor (with a "
                "mask or lengths column), or pass a list of per-row tensors (an object column)")
    if t.layout is not torch.strided:
        return f"a tensor of layout {t.layout} cannot travel between processes: pass t.to_dense()"
    if t.is_quantized:
        return ("a quantized tensor cannot travel between processes: pass t.dequantize() (or its int_repr() with its "
                "scales and zero points)")
    if t.is_meta:
        return "a tensor on the meta device holds no data to send: materialize it (t.to_empty(device=...) and fill it)"
    if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        return (f"a tensor subclass ({type(t).__name__}) that redefines its contents (__torch_dispatch__) cannot "
                f"travel between processes: pass a plain tensor (e.g. a DTensor's full_tensor() or to_local())")
    return None


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # what a subclass without __torch_dispatch__ of its own has


def _storage_short(t: torch.Tensor) -> str | None:
    """Why strided tensor ``t``'s elements cannot be read from its storage (None when they can): its storage was
    freed or shrunk under it, or it views past the storage's end. torch lets such a tensor be read (it shows
    whatever memory lies there, or crashes the process); the wire would send that memory as the column's values."""
    n = t.numel()
    if not n or t.is_meta:
        return None
    last = t.storage_offset() + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))
    need, have = (last + 1) * t.element_size(), t.untyped_storage().nbytes()
    if need <= have:
        return None
    return (f"its elements lie in bytes {t.storage_offset() * t.element_size()}..{need} of its storage, which holds "
            f"{have} bytes: the storage was freed or shrunk under it (as FSDP frees a parameter's unsharded storage "
            f"with untyped_storage().resize_(0) after use), so its values are gone. Send a copy taken while they were "
            f"there (clone() it before the storage is freed)")


def _as_object_array(values: Any, name: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise ValueError(f"column {name!r}: a 0-d array has no rows; pass one value per row")
        return values
    if isinstance(values, (str, bytes, Mapping, AbstractSet)) or not hasattr(values, "__len__"):  # (a dict's keys,
        # a set's members in no fixed order, are no rows)
        raise TypeError(f"column {name!r}: expected one value per row (a list or numpy array), got "
                        f"{type(values).__name__}; put per-batch values in meta=...")
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


# A tensor column of at most this many bytes travels inside the pickle, as bytes: set up and read back with less
# work than an out-of-band buffer (what a call's small shards and replies hold, on every call's path); each reader
# gets a private, writable copy. Larger ones travel as out-of-band numpy buffers: zero-copy through Ray's store.
SMALL_COLUMN_BYTES = 16 << 10

_DTYPES: dict[str, torch.dtype] = {}  # a wire dtype name -> the torch dtype


_string_at = ctypes.string_at  # the bytes at an address (its size a C int: reads stay far below 2 GiB here)


def _memory_of(t: torch.Tensor, limit: int) -> bytes | None:
    """The bytes of ``t``'s elements read from its memory in one copy, when that is what the wire carries (the bytes
    ``_wire_array``'s numpy view gives, of any dtype) and they are at most ``limit``; else None. Only a plain,
    contiguous CPU tensor without a conjugate or negative bit, not quantized, whose elements lie in its storage: not
    a ZeroTensor (no memory), nor one whose storage was freed or shrunk (those take ``_wire_array``'s path, as
    before). Cheaper than ``numpy()``: ~1.8x in a controller among its ranks (``bench.rank_path``'s numpy-read rows)."""
    if not (type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu" and t.is_contiguous()
            and not (t.is_conj() or t.is_neg() or t.is_quantized)):
        return None
    size = t.element_size()
    nbytes = t.numel() * size
    if nbytes > limit:
        return None
    if not nbytes:
        return b""
    at = t.data_ptr()
    if not at or t.storage_offset() * size + nbytes > t.untyped_storage().nbytes():
        return None
    return _string_at(at, nbytes)


def _tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str | None] | tuple[bytes, str, tuple[int, ...]]:
    """A small column as (its bytes, its dtype's name, its shape); a larger one as a numpy view of ``t`` (zero-copy
    through Ray's object store) plus the dtype to restore, if numpy lacks it. A tensor that cannot travel
    (``_cannot_travel``) raises TypeError saying why."""
    data = _memory_of(t, SMALL_COLUMN_BYTES)
    if data is not None:
        return data, _dtype_name(t.dtype), tuple(t.shape)
    arr, viewed = _wire_array(t)
    if arr.nbytes <= SMALL_COLUMN_BYTES:
        return arr.tobytes(), _dtype_name(t.dtype), arr.shape
    return arr, (_dtype_name(t.dtype) if viewed else None)


def _wire_array(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """``t`` as the wire carries its elements: a C-contiguous numpy array on the CPU (a view of ``t`` when it is one
    already), and whether it holds them as the integer dtype of their size (numpy lacks ``t``'s dtype). A tensor
    that cannot travel (``_cannot_travel``) raises TypeError saying why."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized:  # (meta: below)
        why = _cannot_travel(t)
        if why is not None:
            raise TypeError(why)
    short = _storage_short(t)  # (before any copy below, which would read the memory that is not the column's)
    if short is not None:
        raise TypeError(short)
    if t.requires_grad:  # each of these makes a new tensor object: only when it changes something (per-call path)
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        if t.device.type == "meta":
            raise TypeError(_cannot_travel(t))
        t = t.cpu()
    view = _NUMPY_UNSUPPORTED[t.dtype]
    if view is not None:  # (first: torch cannot copy some of these dtypes, e.g. the sub-byte ones, into contiguity)
        t = t.view(view)
    if not t.is_contiguous():
        t = t.contiguous()
    return t.numpy(), view is not None


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # a torch dtype -> its name on the wire


def _dtype_name(dtype: torch.dtype) -> str:
    """The name a column's dtype travels as (``_dtype`` reads it back)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _dtype(name: str) -> torch.dtype:
    """The torch dtype a column on the wire names (``_tensor_to_wire``)."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"a Batch column on the wire names {name!r}, which is not a torch dtype")
        _DTYPES[name] = dtype
    return dtype


def _small_from_wire(data: bytes, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A small column (``_tensor_to_wire``) as a tensor of its own: a writable copy of ``data``."""
    dtype = _dtype(name)
    if not data:  # (frombuffer refuses an empty buffer)
        if math.prod(shape):  # a frame cut short: never uninitialised memory in its place
            raise ValueError(f"a Batch column on the wire holds no bytes for its shape {tuple(shape)}")
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    # (a row of one element: as it is; ``shape[0]`` of the tensor, not ``len``, which is a Python call in torch)
    return t if len(shape) == 1 and t.shape[0] == shape[0] else t.view(shape)


_READ_ONLY_SPENT = False  # torch's one read-only warning of this process was spent by a conversion here, silenced


def _tensor_from_wire(arr: np.ndarray, dtype: str | None) -> torch.Tensor:
    global _READ_ONLY_SPENT
    if arr.flags.writeable or (_READ_ONLY_SPENT and not torch.is_warn_always_enabled()):
        t = torch.from_numpy(arr)  # (torch warns once per process, TORCH_WARN_ONCE, unless warn-always is on)
    else:
        # A view of the object store's shared memory. It never reaches user code as is: workers and the controller
        # hand out private copies (see Host._resolve and Invocation.result), so torch's not-writable warning is
        # silenced for this conversion. It is the process's one such warning (unless warn-always is on): later
        # conversions need no filter of their own, whose set-up costs more than the conversion. (Spent only when
        # orchestra converts such an array, so a process that never does keeps the warning for its own.)
        always = torch.is_warn_always_enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        _READ_ONLY_SPENT = _READ_ONLY_SPENT or not always
    if dtype is not None:
        t = t.view(_dtype(dtype))
    return t


# Above this many bytes, CPU columns are concatenated into a numpy-allocated buffer. numpy asks the kernel for
# transparent huge pages on large allocations (madvise); torch's allocator does not (unless THP_MEM_ALLOC_ENABLE=1
# is set before the process starts), and the first-touch page faults of a fresh 4 KiB-page buffer dominate the
# copy: 256 MiB via torch.cat ~155 ms, via numpy ~45 ms on the 2-core CI box.
_NUMPY_CAT_BYTES = 1 << 20


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` along rows, copying large CPU columns through a huge-page-backed numpy buffer."""
    first = tensors[0]
    if (first.device.type != "cpu" or first.dim() == 0 or first.requires_grad
            or sum(t.numel() for t in tensors) * first.element_size() < _NUMPY_CAT_BYTES
            or any(t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                   or t.requires_grad or t.is_conj() or t.is_neg() for t in tensors)):
        return torch.cat(tensors)
    view = _NUMPY_UNSUPPORTED[first.dtype]
    try:
        arrays = [(t.view(view) if view is not None else t).numpy() for t in tensors]
    except (TypeError, RuntimeError):  # a dtype numpy lacks and that has no view here
        return torch.cat(tensors)
    # into a C-ordered buffer: np.concatenate of column-major inputs alone would return a column-major array
    buf = np.empty((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    out = torch.from_numpy(np.concatenate(arrays, out=buf))
    return out.view(first.dtype) if view is not None else out


_IMMUTABLE = (str, int, float, bool, bytes, type(None))


def _own(arr: np.ndarray) -> np.ndarray:
    """``arr`` with each element deep-copied on its own when they are Python objects (numbers and strings are
    immutable): a row repeated in ``arr`` gets a copy of its own, not one copy shared by its repeats (a deepcopy of
    the whole array would keep that sharing)."""
    if arr.dtype != object or all(type(x) in _IMMUTABLE for x in arr.flat):
        return arr
    out = np.empty(arr.shape, dtype=object)
    for i, x in enumerate(arr.flat):
        out.flat[i] = x if type(x) in _IMMUTABLE else _copied(x)
    return out


def _copied(x: Any) -> Any:
    """A deep copy of ``x``, or ``x`` itself when it cannot be copied (a lock, an open file, a handle: shared as
    before, since no copy of it exists to give)."""
    try:
        return copy.deepcopy(x)
    except (TypeError, copy.Error):  # deepcopy refuses it ("cannot pickle"): kept, as rows held it before copies
        return x


def _meta_copied(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``meta``; when a value cannot be copied (a lock, a handle), each value copied on its own and
    that one kept as it is, as an object column keeps such a row (``_copied``)."""
    try:
        return copy.deepcopy(meta)
    except (TypeError, copy.Error):
        return {k: _copied(v) for k, v in meta.items()}


_KINDS = {torch.bool: "bool", torch.uint8: "uint",
          **dict.fromkeys((torch.int8, torch.int16, torch.int32, torch.int64), "int"),
          **dict.fromkeys((torch.float16, torch.bfloat16, torch.float32, torch.float64), "float"),
          **dict.fromkeys((torch.complex32, torch.complex64, torch.complex128), "complex")}


def _kind(dtype: torch.dtype) -> str:
    """A tensor dtype's kind: columns of one kind concatenate into the wider dtype without losing a value. torch
    promotes no float8, float4, sub-byte, bits or wide unsigned dtype to another, so each is a kind of its own."""
    return _KINDS.get(dtype) or str(dtype).removeprefix("torch.")


def _checked(td: TensorDict) -> TensorDict:
    """A caller's TensorDict as a call delivers it, or a ValueError naming what would not arrive: the wire carries
    tensors (nested ones too) and the row dimension, so a Batch is the same before and after a call. Nested
    columns' batch sizes are cut to the row dimension, as the top level's is (rebuilt only if one is longer); a
    nested column without a tensor in it, or a value that is not a tensor (NonTensorData), is refused: nothing of
    it would reach a rank."""
    return _rows_only(td) if _walk(td, td.batch_size[:1], ())[1] else td


def _walk(t: TensorDict, n: torch.Size, path: tuple[str, ...]) -> tuple[int, bool]:
    """(tensors directly in ``t``, whether a nested column must be rebuilt to carry rows ``n`` alone); a ValueError
    naming a value the wire would drop."""
    leaves, longer = 0, False
    for k, v in t.items():
        name = ".".join((*path, k))
        if isinstance(v, torch.Tensor):
            leaves += 1
        elif _nested(v):  # a TensorDict, or a collection of tensors the wire carries as one (tensorclass, lazy stack)
            inner, deeper = _walk(v, n, (*path, k))
            if not inner:
                raise ValueError(f"nested column {name!r} holds no tensor: a Batch carries its nested columns' "
                                 f"tensors and nothing else would reach a rank; give it a tensor, or leave it out")
            longer = longer or deeper or v.batch_size != n or not isinstance(v, TensorDict)
            leaves += 1
        else:
            raise ValueError(f"column {name!r} of the TensorDict holds a {type(v).__name__}, not a tensor: a Batch "
                             f"carries tensors and nothing else would reach a rank; put per-row values in a "
                             f"non-tensor column (Batch.from_dict({{{k!r}: [...]}})) and per-batch ones in meta")
    return leaves, longer


def _nested(v: Any) -> bool:
    return isinstance(v, TensorDict) or (is_tensor_collection(v) and not is_non_tensor(v))


def _wire_problem(td: TensorDict) -> str | None:
    """What of ``td`` the wire (tensor leaves and rows) would drop, as an error message; None when nothing."""
    try:
        _walk(td, td.batch_size[:1], ())
    except ValueError as e:
        return f"this Batch cannot travel as it is: {e}"
    return None


def _rows_only(td: TensorDict) -> TensorDict:
    """``td`` with every nested TensorDict's batch size cut to the row dimension."""
    n = td.batch_size[:1]
    return TensorDict({k: _rows_only(TensorDict(dict(v.items()), batch_size=n)) if _nested(v) else v
                       for k, v in td.items()}, batch_size=n, device=td.device)


def _element_kind(v: Any) -> str:
    """The numpy kind a value of an object column would have in a typed column ("O": none)."""
    if isinstance(v, (bool, np.bool_)):
        return "b"
    if isinstance(v, (int, np.integer)):
        return "i"
    if isinstance(v, (float, np.floating)):
        return "f"
    if isinstance(v, (complex, np.complexfloating)):
        return "c"
    return "U" if isinstance(v, str) else "S" if isinstance(v, bytes) else "O"


def _odd_element(a: np.ndarray, b: np.ndarray) -> tuple[Any] | None:
    """Of an object column and a typed one (either order), the object column's first value that is not of the typed
    one's kind, as a 1-tuple (None when all are: boxed integers join integers, strings join strings)."""
    typed, boxed = (b, a) if a.dtype == object else (a, b)
    want = {"u": "i"}.get(typed.dtype.kind, typed.dtype.kind)
    return next(((v,) for v in boxed.flat if _element_kind(v) != want), None)


def _name(key: str | tuple[str, ...]) -> str:
    """A column's name as users write it: a nested TensorDict leaf ``("a", "b")`` is ``"a.b"``."""
    return ".".join(key) if isinstance(key, tuple) else key


def _joined_kind(a: np.ndarray, b: np.ndarray) -> str | None:
    """The kind of the dtype numpy would join two columns in; None when it cannot join them (structured columns of
    other fields, ...)."""
    try:
        return np.result_type(a, b).kind
    except TypeError:  # (numpy's DTypePromotionError is one)
        return None


def _names(leaves: Mapping[Any, Any]) -> list[str]:
    return sorted(_name(k) for k in leaves)


def _same(a: Any, b: Any) -> bool:
    """Equal values, looking inside dicts, lists and tuples: tensors and arrays by dtype, shape and values (their
    ``==`` is elementwise, which ``bool`` refuses); a value is its own equal, and two NaNs are equal (a NaN metric
    in meta does not make a batch unequal to itself)."""
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape):
            return False
        if torch.equal(a, b):
            return True
        nan = a.isnan() if (a.is_floating_point() or a.is_complex()) else None
        return nan is not None and torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fcmM"))  # (mM: NaT is its own equal)
        return all(_same(x, y) for x, y in zip(a.flat, b.flat))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # a value whose == is not one truth value
        return a is b


_NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)  # TensorDict without its checks, for what is known good


def _flat(columns: Mapping[Any, Any]) -> bool:
    """Whether every column is named by a string and is a plain dense tensor (no nesting of any kind)."""
    return all(type(k) is str and type(v) is torch.Tensor and not v.is_nested for k, v in columns.items())


def _cut_by_column(td: TensorDict) -> bool:
    """Whether ``Batch.split`` may cut ``td`` column by column and make its pieces without TensorDict's checks: an
    exact TensorDict of flat columns, unnamed, unlocked, neither shared nor memory-mapped (the pieces have nothing
    else to carry over). Any other takes ``TensorDict.split``."""
    return (_NEW_UNSAFE is not None and type(td) is TensorDict and getattr(td, "_td_dim_names", ()) is None
            and not td.is_locked and not getattr(td, "_is_shared", True) and not getattr(td, "_is_memmap", True)
            and _flat(td))


def _rebuild(n: int, tensors: dict, non_tensors: dict, meta: dict, pad: int) -> Batch:
    # flat columns of n rows each, as __reduce__ wrote them: made without the constructor's checks of what holds
    # (a Batch is rebuilt on every call's path, on the rank and in the controller); every value is a plain dense
    # tensor made here, so only the names say whether a column was nested (a tuple key). Flat columns are kept as a
    # plain dict until something asks for the TensorDict (``Batch._td``): an endpoint that reads a column, its
    # length or its bytes never builds one (each Python frame a call runs costs it a few µs on a rank woken cold).
    columns = {}
    flat = True
    for k, w in tensors.items():
        columns[k] = _small_from_wire(*w) if len(w) == 3 else _tensor_from_wire(*w)
        if type(k) is not str:
            flat = False
    # as Batch(td, non_tensors, meta, _pad=pad, _validate=False) makes it, without the checks a TensorDict of
    # one row dimension made from these columns passes
    b = Batch.__new__(Batch)
    b._t = (n, columns) if flat else TensorDict(columns, batch_size=[n])
    b._nt = dict(non_tensors) if non_tensors else {}
    b.meta = dict(meta) if meta else {}
    b._pad = pad
    return b


_BUILD_LOCK = threading.Lock()  # one TensorDict per batch off the wire, whichever threads ask at once (``Batch._td``)


def _built(n: int, columns: dict) -> TensorDict:
    """The TensorDict of a Batch's flat columns kept as a dict (``_rebuild``): made without its checks, which
    plain dense tensors of ``n`` rows named by strings pass."""
    if _NEW_UNSAFE is not None:
        return _NEW_UNSAFE(columns, batch_size=torch.Size((n,)), nested=False)
    return TensorDict(columns, batch_size=[n])


class Batch:
    """Rows of tensor and non-tensor columns plus a ``meta`` dict; the value every data endpoint takes and returns.

    Build one with ``Batch.from_dict({...})``. Column access is ``b["key"]``; ``len(b)`` is the row count.
    Tensors received from another worker share read-only memory with the object store: replace columns
    (``b["x"] = b["x"] + 1``) rather than writing into them, or take ``b.clone()`` first.
    """

    # ``_t``: the tensor columns, a TensorDict — or, for a batch unpickled from the wire with flat columns only,
    # (rows, {name: tensor}) until something asks for the TensorDict (``_td``; see ``_rebuild``)
    __slots__ = ("_t", "_nt", "meta", "_pad")

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        _pad: int = 0,
        _validate: bool = True,
    ) -> None:
        nt = dict(non_tensors or {})
        given = isinstance(tensors, TensorDict)  # the caller's own TensorDict: checked for what the wire carries
        if given:
            td = tensors
        else:
            tensors = dict(tensors or {})
            n = None
            for k, v in tensors.items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    raise TypeError(f"column {k!r}: tensor columns need a tensor with a row dimension, got {v!r:.60}")
                n = v.shape[0] if n is None else n
            if n is None:
                n = len(next(iter(nt.values()))) if nt else 0
            td = TensorDict(tensors, batch_size=[n])
        if len(td.batch_size) == 0:
            raise ValueError("a Batch needs a TensorDict with a row (batch) dimension, got batch_size=[]")
        if len(td.batch_size) != 1:
            td = TensorDict(dict(td.items()), batch_size=td.batch_size[:1])
        if _validate and given:
            td = _checked(td)
        self._t = td
        self._nt = {k: _as_object_array(v, k) for k, v in nt.items()} if _validate else nt
        self.meta = dict(meta or {})
        self._pad = _pad
        if _validate:
            n = self._td.batch_size[0]
            for k, v in self._nt.items():
                if len(v) != n:
                    raise ValueError(f"column {k!r} has {len(v)} rows but the batch has {n}; every column needs one value per row")
                if k in self._td.keys():
                    raise ValueError(f"column {k!r} is both a tensor and a non-tensor column")

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, columns: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Batch:
        """Tensors become tensor columns; lists, tuples and numpy arrays become per-row non-tensor columns."""
        tensors, others = {}, {}
        for k, v in columns.items():
            if isinstance(v, torch.Tensor):
                if v.dim() == 0:
                    raise ValueError(f"column {k!r}: a 0-d tensor has no rows; pass a tensor of shape [N, ...] "
                                     f"(one entry per row), or put per-batch values in meta=...")
                tensors[k] = v
            elif isinstance(v, (list, tuple, np.ndarray)):
                if isinstance(v, np.ndarray) and v.ndim == 0:
                    raise ValueError(f"column {k!r}: a 0-d array has no rows; pass one value per row, or put "
                                     f"per-batch values in meta=...")
                others[k] = v
            else:
                raise TypeError(
                    f"column {k!r}: expected a tensor, list or numpy array with one entry per row, got "
                    f"{type(v).__name__}; put per-batch values in meta=..."
                )
        n_t = {v.shape[0] for v in tensors.values()}
        n_o = {len(v) for v in others.values()}
        if len(n_t | n_o) > 1:
            sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in columns.items()}
            raise ValueError(f"columns have different row counts: {sizes}")
        n = next(iter(n_t | n_o), 0)
        return cls(TensorDict(tensors, batch_size=[n]), others, meta)

    @property
    def _td(self) -> TensorDict:
        """The tensor columns as a TensorDict, built now when the batch still holds them as a dict (``_rebuild``)."""
        t = self._t
        if type(t) is tuple:
            with _BUILD_LOCK:  # (two threads must not each build one: a write into the one not kept would be lost)
                t = self._t
                if type(t) is tuple:
                    t = self._t = _built(*t)
        return t

    # -- basic protocol -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        t = self._t
        return t[0] if type(t) is tuple else t.batch_size[0]  # (an int: torch.Size holds ints)

    def __getitem__(self, key: str | slice | Sequence[int] | torch.Tensor) -> Any:
        if isinstance(key, str):
            if key in self._nt:
                return self._nt[key]
            t = self._t
            # (one lookup, no key view; ``td[key]`` would unwrap a NonTensorData)
            value = t[1].get(key) if type(t) is tuple else t.get(key, None)
            if value is None:  # (a TensorDict holds no None: the column is not there)
                raise KeyError(f"no column {key!r}; the batch has {sorted(self.keys())}")
            return value
        return self._rows(key)

    def __setitem__(self, key: str, value: Any) -> None:
        n = len(self)
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(f"column {key!r} needs {n} rows, got shape {tuple(value.shape)}")
            self._nt.pop(key, None)
            self._td.set(key, value)
        else:
            if not isinstance(value, (list, tuple, np.ndarray)):  # what from_dict takes (a dict's keys are no rows)
                raise TypeError(f"column {key!r}: expected a tensor, list or numpy array with one entry per row, got "
                                f"{type(value).__name__}; put per-batch values in meta=...")
            arr = _as_object_array(value, key)
            if len(arr) != n:
                raise ValueError(f"column {key!r} needs {n} rows, got {len(arr)}")
            if key in self._td.keys():
                del self._td[key]
            self._nt[key] = arr

    def __delitem__(self, key: str) -> None:
        if key in self._nt:
            del self._nt[key]
        else:
            del self._td[key]

    def __contains__(self, key: object) -> bool:
        if key in self._nt:
            return True
        t = self._t
        if type(t) is tuple and type(key) is str:  # (any other key asks the TensorDict: ("x",) names "x" there)
            return key in t[1]
        return key in self._td.keys()

    def keys(self) -> list[str]:
        """All column names: tensor columns first, then non-tensor columns."""
        t = self._t
        return [*(t[1] if type(t) is tuple else t.keys()), *self._nt.keys()]

    @property
    def tensors(self) -> TensorDict:
        """The tensor columns as a TensorDict (batch size [N])."""
        return self._td

    @property
    def non_tensors(self) -> dict[str, np.ndarray]:
        """The non-tensor columns: name -> numpy array with one entry per row."""
        return self._nt

    @property
    def pad_count(self) -> int:
        """How many trailing rows are padding added by ``pad_to_multiple`` (0 if none)."""
        return self._pad

    @property
    def nbytes(self) -> int:
        """Bytes held by tensor columns and numeric non-tensor columns (object columns count 8 bytes a row)."""
        # tensor columns summed over the top level when every column there is a plain dense tensor (the usual case,
        # and cheaper than walking the leaves: this runs on every call's path, on both sides), else over every leaf
        total = 0
        t = self._t
        if type(t) is tuple:  # flat columns kept as a dict: every one a plain dense tensor (``_rebuild``)
            for c in t[1].values():
                total += c.numel() * c.element_size()
            if self._nt:
                for a in self._nt.values():
                    total += a.nbytes
            return total
        for t in self._td.values():
            if type(t) is not torch.Tensor or t.is_nested:  # nesting of any kind: every leaf, as it always was
                total = sum(x.numel() * x.element_size() for x in self._td.values(include_nested=True,
                                                                                   leaves_only=True))
                break
            total += t.numel() * t.element_size()
        if self._nt:
            for a in self._nt.values():
                total += a.nbytes
        return total

    def _schema(self) -> tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]:
        """What another batch's columns must match for ``concat`` to join the two, as plain data a part header
        carries (``Output.schema``): each tensor leaf's name, kind and row shape; each non-tensor column's name,
        numpy kind ('O': an object column, whose values decide; a structured dtype itself, which joins another by
        numpy's promotion) and row shape.
        Compared by ``_wire.columns_apart``."""
        tensors = tuple(sorted((_name(k), _kind(t.dtype), ("nested", t.dim()) if t.is_nested else tuple(t.shape[1:]))
                               for k, t in self._td.items(include_nested=True, leaves_only=True)))
        return tensors, tuple(sorted(((k, a.dtype if a.dtype.kind == "V" else a.dtype.kind, a.shape[1:])
                                      for k, a in self._nt.items()), key=lambda c: c[0]))

    def _bytes_per_row(self) -> int | None:
        """``nbytes`` of one row: every column's bytes are proportional to its rows, so a piece of ``k`` rows holds
        ``k`` times this. None for a batch without rows, or with a jagged (``torch.nested``) tensor column, whose rows
        differ in size."""
        n = len(self)
        if n == 0 or (not _flat(self._td)
                      and any(t.is_nested for t in self._td.values(include_nested=True, leaves_only=True))):
            return None
        return self.nbytes // n

    def __repr__(self) -> str:
        cols = ", ".join(
            [f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self._td.items()]
            + [f"{k}: [{v.dtype}]" for k, v in self._nt.items()]
        )
        pad = f", pad={self._pad}" if self._pad else ""
        return f"Batch(rows={len(self)}{pad}, {{{cols}}}, meta={self.meta!r:.80})"

    def __eq__(self, other: object) -> bool:
        """Same rows, same columns (each with the same kind, dtype, shape and values) and the same meta."""
        if not isinstance(other, Batch) or len(self) != len(other) or set(self._nt) != set(other._nt):
            return False
        mine = dict(self._td.items(include_nested=True, leaves_only=True))
        theirs = dict(other._td.items(include_nested=True, leaves_only=True))
        if set(mine) != set(theirs):
            return False
        for k, v in mine.items():
            o = theirs[k]
            if not _same(v, o):
                return False
        return (self._pad == other._pad and all(_same(v, other._nt[k]) for k, v in self._nt.items())
                and _same(self.meta, other.meta))

    __hash__ = None  # type: ignore[assignment]

    # -- row operations -------------------------------------------------------------------------------------------
    def _rows(self, index: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        if isinstance(index, slice):
            td, nt = self._td[index], {k: v[index] for k, v in self._nt.items()}
            pad = self._pad and self._pad_picked(torch.arange(len(self))[index])
        else:
            bad_int = isinstance(index, (int, np.integer)) or (isinstance(index, (torch.Tensor, np.ndarray))
                                                               and index.ndim == 0)
            if bad_int:
                raise TypeError(f"b[{index}]: index rows with a slice (b[i:i+1]) or a list of positions (b[[i]]); "
                                f"a column by name (b['key'])")
            idx = torch.as_tensor(index)
            if idx.dim() != 1:
                raise IndexError(f"row positions must be one-dimensional, got shape {tuple(idx.shape)}")
            if idx.dtype == torch.bool:  # a row mask, not positions 0/1
                if idx.shape != (len(self),):
                    raise IndexError(f"a boolean row mask needs shape ({len(self)},), got {tuple(idx.shape)}")
                idx = idx.nonzero().flatten()
            elif idx.is_floating_point() and idx.numel():
                raise TypeError(f"row positions must be integers, got {idx.dtype}")
            if idx.dtype == torch.uint64 and idx.numel() and int(idx.numpy().max()) >= len(self):
                # (to int64 it would wrap to a negative position, which picks a row from the end)
                raise IndexError(f"row position {int(idx.numpy().max())} is out of range for {len(self)} rows")
            idx = idx.to(torch.long)
            pad = self._pad and self._pad_picked(idx)
            np_idx = idx.numpy()
            # rows picked by position are copies, as the tensor columns' are: a row's objects too, each repeat its own
            td, nt = self._td[idx], {k: _own(v[np_idx]) for k, v in self._nt.items()}
        return Batch(td, nt, self.meta, _pad=pad, _validate=False)

    def _pad_picked(self, positions: torch.Tensor) -> int:
        """How many of ``positions`` are padding rows (``pad_to_multiple``'s), which must come last in them so that
        the picked rows keep a trailing pad count; a ValueError otherwise (filler rows would pass for real ones)."""
        n = len(self)
        is_pad = torch.where(positions < 0, positions + n, positions) >= n - self._pad
        count = int(is_pad.sum())
        if count and not bool(is_pad[-count:].all()):
            first = int(positions[is_pad.nonzero()[0, 0]])
            raise ValueError(f"row {first % n} is padding (pad_to_multiple), and rows after it in the selection are "
                             f"not: unpad() first, or pick the padding rows last")
        return count

    def slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as views (no copy)."""
        return self._rows(slice(start, stop))

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given row counts (they must add up to ``len(self)``); views, no copy."""
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != len(self):
            raise ValueError(f"split sizes {sizes} must be >= 0 and add up to the batch's {len(self)} rows")
        if not sizes:
            return []
        # one split per column (views) instead of one TensorDict index per piece: the controller splits every
        # sharded argument, so this is on the per-call path
        td = self._td
        if _cut_by_column(td):
            # each column cut once, the pieces made without the constructor's checks (each piece's columns have its
            # rows by construction); TensorDict.split does more than this
            cut = {k: v.split(sizes) for k, v in td.items()}
            tds = [_NEW_UNSAFE({k: c[i] for k, c in cut.items()}, batch_size=torch.Size([s]), device=td.device,
                               nested=False) for i, s in enumerate(sizes)]
        else:
            tds = td.split(sizes, dim=0)
        out, start, pad_from = [], 0, len(self) - self._pad
        for s, td in zip(sizes, tds):
            pad = max(0, min(s, start + s - pad_from)) if self._pad else 0  # its share of the trailing padding
            out.append(Batch(td, {k: v[start:start + s] for k, v in self._nt.items()}, self.meta, _pad=pad,
                             _validate=False))
            start += s
        return out

    def chunk(self, n: int) -> list[Batch]:
        """``n`` balanced pieces (sizes differ by at most one, larger first), e.g. 10 rows in 4 -> 3, 3, 2, 2."""
        return self.split(balanced_sizes(len(self), n))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of all batches in order, sharing nothing writable with them (one batch is returned as is); meta is
        (a copy of) the first one's. Batches without rows are left out (a rank's empty result decides no column's
        type); the others must have the same columns, each of one kind (bool, integer, float, complex, strings: a
        wider dtype of the kind is taken; an object column's values must be of the kind a typed one holds) and row
        shape (a ValueError names the one that differs: ``torch.cat`` would convert it), and padding rows
        (``pad_to_multiple``) only at the end."""
        batches = list(batches)
        return Batch._concat(batches, [f"batch {i}" for i in range(len(batches))])

    @staticmethod
    def _concat(batches: list[Batch], names: list[str]) -> Batch:
        """``concat``, its errors naming each batch by ``names`` (the controller names ranks)."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        meta = batches[0].meta
        numbered = [(i, b) for i, b in enumerate(batches) if len(b)] or list(enumerate(batches[:1]))
        i0, first = numbered[0]
        leaves = {k: v for k, v in first._td.items(include_nested=True, leaves_only=True)}
        for i, b in numbered[1:]:
            theirs = dict(b._td.items(include_nested=True, leaves_only=True))
            if set(theirs) != set(leaves) or set(b._nt) != set(first._nt):
                raise ValueError(
                    f"Batch.concat: {names[i]} has tensor columns {_names(theirs)} and non-tensor columns "
                    f"{sorted(b._nt)}, {names[i0]} has {_names(leaves)} and {sorted(first._nt)}")
            for k, t in theirs.items():
                mine = leaves[k]
                if _kind(t.dtype) != _kind(mine.dtype) or t.shape[1:] != mine.shape[1:]:
                    raise ValueError(f"Batch.concat: column {_name(k)!r} of {names[i]} is {t.dtype} with rows of "
                                     f"shape {tuple(t.shape[1:])}, {names[i0]}'s is {mine.dtype} with rows of shape "
                                     f"{tuple(mine.shape[1:])}; make them one kind (bool, integer, float, complex) "
                                     f"and row shape: a wider dtype of the same kind is taken, another kind would "
                                     f"be converted (torch promotes no float8, float4, sub-byte, bits or wider "
                                     f"unsigned dtype: those join only their own dtype)")
            for k, a in b._nt.items():
                mine_a = first._nt[k]
                if a.shape[1:] != mine_a.shape[1:]:
                    raise ValueError(f"Batch.concat: column {k!r} of {names[i]} has rows of shape {a.shape[1:]}, "
                                     f"{names[i0]}'s of shape {mine_a.shape[1:]}; make them one row shape")
                if a.dtype == mine_a.dtype:
                    continue
                if a.dtype.kind in "mM" or mine_a.dtype.kind in "mM":
                    raise ValueError(f"Batch.concat: column {k!r} of {names[i]} is {a.dtype}, {names[i0]}'s is "
                                     f"{mine_a.dtype}; time columns join only their own dtype and unit (numpy "
                                     f"converts to the finer unit, and a value beyond its range wraps around without "
                                     f"an error): convert both to one unit first, e.g. .astype('datetime64[s]')")
                if object in (a.dtype, mine_a.dtype):
                    odd = _odd_element(a, mine_a)
                    if odd is not None:
                        raise ValueError(f"Batch.concat: column {k!r} of {names[i]} is {a.dtype}, {names[i0]}'s is "
                                         f"{mine_a.dtype}, and the object column holds {odd[0]!r:.40} "
                                         f"({type(odd[0]).__name__}), not a value of the other's kind: make them one "
                                         f"kind (an object column of any values concatenates with another)")
                elif not a.dtype.kind == mine_a.dtype.kind == _joined_kind(a, mine_a):
                    raise ValueError(f"Batch.concat: column {k!r} of {names[i]} is {a.dtype}, {names[i0]}'s is "
                                     f"{mine_a.dtype}; make them one kind (strings of any width, integers, floats: "
                                     f"a wider dtype of the same kind is taken, another kind would be converted)")
        pad = 0
        for j, (i, b) in enumerate(numbered):
            if pad and b._pad != len(b):
                prev = next(k for k, c in reversed(numbered[:j]) if c._pad)
                raise ValueError(f"Batch.concat: {names[prev]} ends in {dict(numbered)[prev]._pad} padding row(s) "
                                 f"(pad_to_multiple), and {names[i]} after it has rows that are not padding: unpad() "
                                 f"each batch first")
            pad += b._pad
        parts = [b for _, b in numbered]
        n = sum(len(b) for b in parts)
        td = TensorDict({k: _cat([b._td.get(k) for b in parts]) for k in leaves}, batch_size=[n],
                        device=first._td.device)
        nt = {k: _own(np.concatenate([b._nt[k] for b in parts])) for k in first._nt}
        return Batch(td, nt, _meta_copied(meta), _pad=pad, _validate=False)

    def select(self, *keys: str) -> Batch:
        """A batch with only the named columns (views)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: no column(s) {missing}; the batch has {sorted(self.keys())}")
        tk = [k for k in keys if k not in self._nt]
        return Batch(self._td.select(*tk), {k: self._nt[k] for k in keys if k in self._nt}, self.meta,
                     _pad=self._pad, _validate=False)

    def exclude(self, *keys: str) -> Batch:
        """A batch without the named columns (views); a name the batch lacks is refused, as ``select`` refuses one
        (a misspelt name kept the column it meant to drop, silently)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"exclude: no column(s) {missing}; the batch has {sorted(self.keys())}")
        keep = [k for k in self.keys() if k not in keys]
        return self.select(*keep)

    def union(self, other: Batch) -> Batch:
        """Columns of both batches, row-aligned; ``other`` wins on a name clash; meta is merged the same way."""
        if len(self) != len(other):
            raise ValueError(f"union of row-misaligned batches: {len(self)} rows | {len(other)} rows")
        td = self._td.clone(recurse=False)
        td.update(other._td)
        nt = {**self._nt, **other._nt}
        for k in other._td.keys():
            nt.pop(k, None)
        for k in other._nt:
            if k in td.keys():
                del td[k]
        return Batch(td, nt, {**self.meta, **other.meta}, _pad=max(self._pad, other._pad), _validate=False)

    def __or__(self, other: Batch) -> Batch:
        if not isinstance(other, Batch):
            return NotImplemented
        return self.union(other)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: interleaved (a a b b) or tiled (a b a b)."""
        if n < 1:
            raise ValueError(f"repeat needs n >= 1, got {n}")
        rows = len(self)
        idx = torch.arange(rows).repeat_interleave(n) if interleave else torch.arange(rows).repeat(n)
        return self._rows(idx)

    def pad_to_multiple(self, multiple: int) -> Batch:
        """Pad with copies of the first rows up to a multiple of ``multiple``; ``unpad`` removes them again."""
        if multiple < 1:
            raise ValueError(f"pad_to_multiple needs multiple >= 1, got {multiple}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty batch: there is no row to repeat")
        pad = (-n) % multiple
        if pad == 0:
            return self
        idx = torch.cat([torch.arange(n), torch.arange(pad) % n])
        out = self._pad_free()._rows(idx)  # the new filler rows are padding too, after any the batch had
        out._pad = self._pad + pad
        return out

    def _pad_free(self) -> Batch:
        """The same rows, columns and meta (views), with no pad count: rows the caller counts as padding itself."""
        return Batch(self._td, self._nt, self.meta, _validate=False)

    def unpad(self) -> Batch:
        """Remove padding added by ``pad_to_multiple``."""
        if not self._pad:
            return self
        out = self.slice(0, len(self) - self._pad)
        out._pad = 0
        return out

    def clone(self) -> Batch:
        """A private, writable copy of every column and of meta, down to the objects in object columns (a row's
        dict written by its reader is not another reader's row)."""
        return Batch(self._td.clone(), {k: _own(v.copy()) for k, v in self._nt.items()}, _meta_copied(self.meta),
                     _pad=self._pad, _validate=False)

    def to(self, device: str | torch.device) -> Batch:
        """Tensor columns moved to ``device``."""
        td = self._td.to(device)
        if td is self._td:  # (TensorDict hands itself back on its own device: the result's columns are its own)
            td = td.copy()
        return Batch(td, self._nt, self.meta, _pad=self._pad, _validate=False)

    def iter_slices(self, rows: int) -> Iterator[Batch]:
        """Consecutive pieces of at most ``rows`` rows (micro-batches)."""
        if rows < 1:
            raise ValueError(f"iter_slices({rows}): a piece has at least 1 row")
        for start in range(0, len(self), rows):
            yield self.slice(start, min(start + rows, len(self)))

    # -- wire format ----------------------------------------------------------------------------------------------
    def __reduce__(self):  # numpy views pickle out of band: Ray stores them without a copy and readers map them
        self._check_wire()
        try:
            tensors = {k: _tensor_to_wire(v) for k, v in self._td.items(include_nested=True, leaves_only=True)}
        except TypeError:
            self._check_tensors()  # names the column
            raise
        return _rebuild, (len(self), tensors, self._nt, self.meta, self._pad)

    def _check_tensors(self) -> None:
        """Raise TypeError naming the first tensor column the wire cannot carry, and why (``_cannot_travel``)."""
        for v in self._td.values():  # a flat batch of plain tensors, the common case, at the top level alone
            if not (type(v) is torch.Tensor and v.layout is torch.strided and not v.is_quantized and not v.is_meta
                    and _storage_short(v) is None):
                break
        else:
            return
        for k, v in self._td.items(include_nested=True, leaves_only=True):
            why = _cannot_travel(v)
            if why is None and v.layout is torch.strided:
                why = _storage_short(v)
            if why is not None:
                raise TypeError(f"Batch column {_name(k)!r}: {why}") from None

    def _check_wire(self) -> None:
        """Raise TypeError naming a column the wire would drop: a value of the TensorDict that is not a tensor, or a
        nested column without one, put there past the construction check (``b.tensors[k] = ...``)."""
        for k, v in self._td.items():
            if not isinstance(v, torch.Tensor):
                problem = _wire_problem(self._td)
                if problem is not None:
                    raise TypeError(problem)
                return


def schemas_apart(a: tuple, b: tuple) -> str | None:
    """How two ``Batch._schema()`` differ in a way ``concat`` refuses, or None: concat's rule (``Batch._concat``)
    over what a header carries (an object column matches any non-tensor column by its header: its values decide,
    which the join checks). Kept next to concat so the two rules change together."""
    (ta, na), (tb, nb) = a, b
    if ta != tb:
        da, db = {c[0]: c[1:] for c in ta}, {c[0]: c[1:] for c in tb}
        if set(da) != set(db):
            return f"have tensor columns {sorted(db)} and {sorted(da)}"
        k = next(k for k in sorted(da) if da[k] != db[k])
        return (f"hold tensor column {k!r} as {db[k][0]} with rows of shape {db[k][1]} and as {da[k][0]} with rows "
                f"of shape {da[k][1]}")
    if na != nb:
        da, db = {c[0]: c[1:] for c in na}, {c[0]: c[1:] for c in nb}
        if set(da) != set(db):
            return f"have non-tensor columns {sorted(db)} and {sorted(da)}"
        for k in sorted(da):
            (ka, sa), (kb, sb) = da[k], db[k]
            if ka == "O" or kb == "O":
                continue
            if isinstance(ka, np.dtype) and isinstance(kb, np.dtype):  # structured: joined as numpy promotes them
                try:
                    joined = np.result_type(ka, kb).kind == "V"
                except TypeError:
                    joined = False
                if not joined:
                    return f"hold non-tensor column {k!r} as structured dtypes {kb} and {ka}, which do not join"
            elif ka != kb:
                return f"hold non-tensor column {k!r} as numpy kind {kb!r} and {ka!r}"
            if sa != sb:
                return f"hold non-tensor column {k!r} with rows of shape {sb} and {sa}"
    return None


def balanced_sizes(n: int, parts: int) -> list[int]:
    """Row counts for ``parts`` near-equal pieces of ``n`` rows, larger pieces first (10 over 4 -> 3, 3, 2, 2)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)
