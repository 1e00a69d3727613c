"""Host time of SyncBatchNorm, measured without a GPU: the Python, dispatcher, autograd and
allocation work of one forward+backward call, with the kernels taken out.

The ``apex_parallel`` ops get stand-in kernels that allocate their outputs the way the CUDA
launchers do and compute nothing: C++ kernels registered for CPU (the default, ``--kernels
stub``; compiled once, about 30 s, into torch's extension cache), or the ops' Python fakes on
``meta`` tensors (``--kernels fake``; the fakes and meta ``empty_like`` are Python, so this
overstates the ops). What the stubs leave out is what only a GPU adds: each kernel launch
(``cudaLaunchKernel``, 2-5 us), the caching allocator and the autograd engine's hand-over to
its device thread in backward. The "floor" rows put the numbers in scale: an identity
autograd.Function and ``x * 2``, the least any differentiable call can cost on this host.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python packages/apex-parallel/benchmarks/host_syncbn.py

x = [64, 256, 56, 56] on meta, [4, 256, 4, 4] on CPU (shape-independent work; the stubs read
no data). Per row: microseconds per call, the fastest of 30 rounds of 200 back-to-back calls.
``--group`` runs under a one-rank gloo process group, as bench_syncbn.py does with NCCL.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist

from apex.parallel import SyncBatchNorm, ops  # noqa: F401 - ops defines the apex_parallel ops

# Stand-ins for the CUDA launchers of the ops SyncBatchNorm calls (welford.cu): the same
# signatures and output allocations, no work.
STUB_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>
#include <optional>
#include <tuple>

namespace {
using OptT = std::optional<at::Tensor>;

at::Tensor packed(const at::Tensor& x, int64_t k, int64_t extra) {
  return at::empty({k * x.size(1) + extra}, x.options().dtype(at::kFloat));
}

at::Tensor stats(const at::Tensor& x) { return packed(x, 2, 1); }

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const OptT&, const OptT&, const OptT&,
                                           const OptT&, const OptT&, const OptT&, const OptT&, double,
                                           std::optional<double>, bool) {
  return {at::empty_like(x), packed(x, 2, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce(const at::Tensor&, const at::Tensor& x, const at::Tensor&,
                                                      const OptT& w, const OptT&) {
  auto p = x.options().dtype(w.has_value() ? w->scalar_type() : at::kFloat);
  return {packed(x, 2, 0), at::empty({x.size(1)}, p), at::empty({x.size(1)}, p)};
}

at::Tensor backward(const at::Tensor&, const at::Tensor& x, const at::Tensor&, const OptT&, const at::Tensor&,
                    const OptT&) {
  return at::empty_like(x);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_local(const at::Tensor& g, const at::Tensor& x,
                                                              const at::Tensor& s, const OptT& w, const OptT& r) {
  auto p = x.options().dtype(w.has_value() ? w->scalar_type() : at::kFloat);
  return {at::empty_like(x), at::empty({x.size(1)}, p), at::empty({x.size(1)}, p)};
}
}  // namespace

TORCH_LIBRARY_IMPL(apex_parallel, CPU, m) {
  m.impl("syncbn_stats", &stats);
  m.impl("syncbn_forward", &forward);
  m.impl("syncbn_backward_reduce", &reduce);
  m.impl("syncbn_backward", &backward);
  m.impl("syncbn_backward_local", &backward_local);
}
"""


def load_stubs() -> None:
    from torch.utils.cpp_extension import load_inline

    load_inline(
        name="apex_parallel_host_stubs",
        cpp_sources=[STUB_SOURCE],
        is_python_module=False,
        extra_cflags=["-O2"],
    )


def per_call_us(fn, calls: int = 200, rounds: int = 30) -> float:
    """The fastest of ``rounds`` rounds of ``calls`` back-to-back calls, per call: on a shared
    machine the least disturbed round is the closest to the cost itself."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


class Identity(torch.autograd.Function):
    """The identity as an autograd.Function: the "floor" rows here and in bench_syncbn.py."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def rows(device: str):
    shape = (64, 256, 56, 56) if device == "meta" else (4, 256, 4, 4)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for layout in ("channels_last", "nchw"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            x = (
                torch.randn(shape, dtype=dtype)
                if device == "cpu"
                else torch.empty(shape, dtype=dtype, device=device)
            )
            x = x.contiguous(memory_format=fmt).requires_grad_()
            g = torch.ones_like(x)
            bn = SyncBatchNorm(shape[1]).to(device)
            params = (x, bn.weight, bn.bias)

            def step(bn=bn, x=x, g=g, params=params):
                for p in params:
                    p.grad = None
                bn(x).backward(g)

            def forward(bn=bn, x=x):
                bn(x)

            case = f"{str(dtype).replace('torch.', '')} {layout}"
            out.append(("apex SyncBatchNorm fwd+bwd", case, per_call_us(step)))
            out.append(("apex SyncBatchNorm fwd", case, per_call_us(forward)))
    x = torch.randn(shape) if device == "cpu" else torch.empty(shape, device=device)
    x.requires_grad_()
    g = torch.ones_like(x)

    def identity():
        x.grad = None
        Identity.apply(x).backward(g)

    def mul():
        x.grad = None
        (x * 2).backward(g)

    out.append(("floor: identity autograd.Function fwd+bwd", "float32", per_call_us(identity)))
    out.append(("floor: x * 2 fwd+bwd", "float32", per_call_us(mul)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", choices=["stub", "fake"], default="stub")
    p.add_argument("--group", action="store_true", help="a one-rank gloo process group")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.kernels == "stub":
        load_stubs()
    if args.group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    device = "cpu" if args.kernels == "stub" else "meta"
    print(
        f"kernels: {args.kernels} ({device}), process group: {'gloo, 1 rank' if args.group else 'none'}"
    )
    print("| call | case | host us |\n|---|---|---:|")
    for name, case, us in rows(device):
        print(f"| {name} | {case} | {us:.1f} |")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
