"""torch.distributed helpers shared by the engines, their tests and benchmarks.

- :func:`init_distributed` joins (or creates) the default process group from the usual env vars
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), picking gloo on CPU and nccl on CUDA.
- :func:`spawn` runs a function on N local ranks with ``torch.multiprocessing`` and returns the
  per-rank results (through ``torch.save`` files in a private temporary directory, so tensors survive the
  child's exit; read back with ``weights_only=True``, which loads tensors and plain containers and never runs
  code, whoever wrote the file).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["default_device", "init_distributed", "free_port", "spawn"]


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: torch.device | None = None) -> torch.device:
    """Make sure a default process group exists; return this rank's compute device.

    If a group is already initialised it is used as is. Otherwise RANK/WORLD_SIZE/MASTER_ADDR/
    MASTER_PORT are read from the environment; with none of them set, a private single-rank group
    (in-memory store, no port) is created so engines also work in a plain Python process.
    Backend: nccl for CUDA devices, gloo otherwise.
    """
    device = device if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size == 1 and "MASTER_PORT" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return device
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set: set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT (or call torch.distributed.init_process_group yourself "
            "before building the engine)"
        )
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        **kw,
    )
    return device


def _spawn_entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    threads: int,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
        if dist.is_initialized():
            dist.barrier()  # nobody tears down the group while a peer still uses it
            dist.destroy_process_group()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results.

    Each child gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT (a free port) and
    ``torch.set_num_threads(threads)``; ``fn`` must be importable (module level). ``fn`` should
    create its engine (which joins the group) and return tensors, numbers, strings, None and
    dicts/lists/tuples of them (what ``torch.load(weights_only=True)`` reads back; other objects
    fail to load with an error naming them). A child's exception is re-raised here with its traceback.
    """
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="engines_spawn_") as out_dir:
        try:
            mp.spawn(
                _spawn_entry,
                args=(world_size, port, out_dir, fn, args, threads),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:
            errors = []
            for r in range(world_size):
                p = os.path.join(out_dir, f"rank{r}.pt")
                if os.path.exists(p):
                    rec = torch.load(p, weights_only=True)
                    if not rec["ok"]:
                        errors.append(f"--- rank {r} ---\n{rec['error']}")
            raise RuntimeError("spawned rank failed:\n" + "\n".join(errors)) from exc
        results = []
        for r in range(world_size):
            rec = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
            results.append(rec["result"])
        return results
