"""Run a function on several gloo ranks on 127.0.0.1, each with a time limit.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn), initialises a
gloo (or ``backend=``) process group with a timeout in each, calls ``fn(rank, world_size, *args)`` and returns the
list of what each rank returned. A rank that raises makes the call raise with its traceback; a
run that outlives ``timeout`` is killed and raises, so a broken collective fails a test instead
of hanging it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, out_dir, backend, fn, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        torch.manual_seed(1234 + rank)
        result["value"] = fn(rank, world_size, *args)
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo"):
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, free_port(), out_dir, backend, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks ran past {timeout} s")
        except mp.ProcessRaisedException as e:
            raise AssertionError(str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(
                    f"rank {rank} left no result (exit code {ctx.processes[rank].exitcode})"
                )
            with open(path, "rb") as f:
                r = pickle.load(f)
            if "error" in r:
                raise AssertionError(f"rank {rank} failed:\n{r['error']}")
            results.append(r["value"])
        return results
