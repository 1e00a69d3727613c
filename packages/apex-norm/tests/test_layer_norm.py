"""FusedLayerNorm and its functional forms against torch's layer_norm (CPU: the reference path)
and, under the ``cuda`` marker, the CUDA kernels against the reference and torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from norm_testing import (
    CUDA_H,
    DTYPES,
    LOW,
    MANY_ROWS,
    grad_tol,
    make,
    param,
    tol,
    torch_layer_norm,
    torch_rms_norm,
)

from apex.normalization import FusedLayerNorm, MixedFusedLayerNorm
from apex.normalization import reference as ref
from apex.normalization.fused_layer_norm import (
    FusedLayerNormAffineFunction,
    FusedLayerNormFunction,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
)

HERE = Path(__file__).resolve().parent

SHAPES = [  # (input shape, normalized_shape)
    ((4, 32), (32,)),
    ((3, 5, 7), (7,)),
    ((2, 3, 5, 7), (5, 7)),
    ((6, 1), (1,)),
    ((5, 129), (129,)),
]


# The routes a CPU call can take: the functional forms (eager, without memory_efficient: torch's
# own norms through the plain math) and the autograd Functions (the apex_norm ops, so the
# reference's forward and backward).
ROUTES = ["functional", "Function"]


def run(x, w, b, shape, eps, memory_efficient, route="functional"):
    if route == "Function":
        if w is None and b is None:
            return FusedLayerNormFunction.apply(x, shape, eps, memory_efficient)
        return FusedLayerNormAffineFunction.apply(x, w, b, shape, eps, memory_efficient)
    if w is None and b is None:
        return fused_layer_norm(x, shape, eps, memory_efficient)
    return fused_layer_norm_affine(x, w, b, shape, eps, memory_efficient)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,shape", SHAPES)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_forward_and_grads_match_torch(dtype, xshape, shape, affine, memory_efficient, route):
    x = make(xshape, dtype, requires_grad=True)
    w = param(shape, dtype) if affine in ("both", "weight") else None
    b = param(shape, dtype) if affine in ("both", "bias") else None
    y = run(x, w, b, shape, 1e-5, memory_efficient, route)
    assert y.dtype == dtype and y.shape == x.shape
    expected = torch_layer_norm(x, shape, w, b, 1e-5)
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    with torch.no_grad():  # recording nothing: on the CPU the eager forms' plain route
        y0 = run(x, w, b, shape, 1e-5, memory_efficient, route)
    assert y0.dtype == dtype and y0.is_contiguous()
    torch.testing.assert_close(y0.double(), expected, **tol(dtype))

    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    want = torch.autograd.grad(expected, [t for t in (x, w, b) if t is not None], dy.double())
    torch.testing.assert_close(got[0].double(), want[0].double(), **tol(dtype, torch.float16))
    for g, e in zip(got[1:], want[1:]):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e.double(), **grad_tol(shape[-1], dtype))


def test_module_matches_nn_layernorm_and_state_dict():
    x = make((8, 4, 16), torch.float32, requires_grad=True)
    ours, theirs = FusedLayerNorm(16), torch.nn.LayerNorm(16)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16))
        theirs.bias.copy_(torch.randn(16))
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    ours(x).square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    theirs(x).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad)


def test_bias_false_has_weight_only():
    m = FusedLayerNorm(16, bias=False)
    assert m.bias is None and list(m.state_dict()) == ["weight"]
    x = make((4, 16), torch.float32)
    with torch.no_grad():
        m.weight.copy_(torch.randn(16))
    torch.testing.assert_close(m(x), F.layer_norm(x, (16,), m.weight, None, 1e-5))


def test_zero_rows():
    x = make((0, 3, 16), torch.float32, requires_grad=True)
    m = FusedLayerNorm(16)
    y = m(x)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(m.weight.grad, torch.zeros(16))
    assert torch.equal(m.bias.grad, torch.zeros(16))


def test_non_contiguous_input():
    base = make((16, 8), torch.float32)
    x = base.t().requires_grad_(True)  # (8, 16), strides (1, 8)
    assert not x.is_contiguous()
    w, b = param((16,), torch.float32), param((16,), torch.float32)
    y = fused_layer_norm_affine(x, w, b, (16,), 1e-5)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w, b, 1e-5))
    (gx,) = torch.autograd.grad(y.sum(), [x])
    (ex,) = torch.autograd.grad(F.layer_norm(x, (16,), w, b, 1e-5).sum(), [x])
    torch.testing.assert_close(gx, ex)


@pytest.mark.parametrize("route", ROUTES)
def test_gradcheck_float64(route):
    x = make((3, 2, 5), torch.float64, requires_grad=True)
    w, b = param((2, 5), torch.float64), param((2, 5), torch.float64)
    for mem in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, w, b, mem=mem: run(x, w, b, (2, 5), 1e-5, mem, route), (x, w, b)
        )
    assert torch.autograd.gradcheck(lambda x: run(x, None, None, (5,), 1e-5, False, route), (x,))


@pytest.mark.parametrize("route", ROUTES)
def test_gradgradcheck_float64(route):
    """Double backward (create_graph=True), as torch.nn.LayerNorm has it: weight and bias or
    not, a non-contiguous input, the mixed form."""
    x = make((3, 2, 5), torch.float64, requires_grad=True)
    w, b = param((2, 5), torch.float64), param((2, 5), torch.float64)
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: run(x, w, b, (2, 5), 1e-5, False, route), (x, w, b)
    )
    assert torch.autograd.gradgradcheck(
        lambda x: run(x, None, None, (5,), 1e-5, False, route), (x,)
    )
    xt = make((5, 4), torch.float64).t().requires_grad_(True)
    wt = param((5,), torch.float64)
    assert torch.autograd.gradgradcheck(
        lambda x, w: run(x, w, None, (5,), 1e-5, False, route), (xt, wt)
    )
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: mixed_dtype_fused_layer_norm_affine(x, w, b, (2, 5), 1e-5), (x, w, b)
    )
    # A bias without a weight (torch's own double backward of that case is wrong: the plain
    # math adds the bias after the norm).
    assert torch.autograd.gradgradcheck(
        lambda x, b: fused_layer_norm_affine(x, None, b, (2, 5), 1e-5), (x, b)
    )


def gradient_penalty(norm, x):
    """WGAN-GP's penalty through ``norm``: the squared norm of d(sum out)/dx, differentiated
    again into every parameter and x."""
    (gx,) = torch.autograd.grad(norm(x).sum(), [x], create_graph=True)
    penalty = (gx.square().sum() - 1.0).square()
    return torch.autograd.grad(penalty, [x, *norm.parameters()], allow_unused=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradient_penalty_matches_torch(device):
    ours = FusedLayerNorm(64).to(device)
    theirs = torch.nn.LayerNorm(64).to(device)
    for m in (ours, theirs):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 1.5, 64))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 64))
    x = make((8, 64), torch.float32, device, requires_grad=True)
    got, want = gradient_penalty(ours, x), gradient_penalty(theirs, x)
    assert got[2] is None and want[2] is None  # d(sum out)/dx does not involve the bias
    torch.testing.assert_close(got[:2], want[:2], atol=1e-4, rtol=1e-4)


def test_double_backward_through_memory_efficient_is_refused():
    x = make((4, 16), torch.float32, requires_grad=True)
    y = FusedLayerNorm(16, memory_efficient=True)(x)
    with pytest.raises(RuntimeError, match="memory_efficient=False for double backward"):
        torch.autograd.grad(y.sum(), [x], create_graph=True)
    (gx,) = torch.autograd.grad(FusedLayerNorm(16, memory_efficient=True)(x).sum(), [x])
    assert gx.grad_fn is None  # a plain backward is as before


def test_memory_efficient_saves_the_output():
    x = make((4, 16), torch.float32, requires_grad=True)
    w, b = param((16,), torch.float32), param((16,), torch.float32)
    for mem, saved_input in ((False, True), (True, False)):
        y = FusedLayerNormAffineFunction.apply(x, w, b, torch.Size([16]), 1e-5, mem)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None]
        assert any(t.data_ptr() == x.data_ptr() for t in saved) == saved_input
        assert any(t.data_ptr() == y.data_ptr() for t in saved) == (not saved_input)


@pytest.mark.parametrize(
    "xdtype,wdtype,out",
    [
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16, torch.float16),
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float16, torch.bfloat16, torch.float16),
        (torch.float32, torch.float64, torch.float32),
    ],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_mixed_input_and_weight_dtypes(xdtype, wdtype, out, device):
    # CUDA: H=1024, the vectorised forward with run-time dtypes (16-bit input, other weights).
    H = 32 if device == "cpu" else 1024
    x = make((4, H), xdtype, device, requires_grad=True)
    w, b = param((H,), wdtype, device), param((H,), wdtype, device)
    y = fused_layer_norm_affine(x, w, b, (H,), 1e-5)
    assert y.dtype == out
    torch.testing.assert_close(
        y.double(), torch_layer_norm(x, (H,), w, b, 1e-5), **tol(out, xdtype, wdtype)
    )
    gx, gw, gb = torch.autograd.grad(y.float().sum(), [x, w, b])
    assert (gx.dtype, gw.dtype, gb.dtype) == (xdtype, wdtype, wdtype)


def test_weight_and_bias_of_different_dtypes(device="cpu"):
    x = make((4, 32), torch.float32, device, requires_grad=True)
    w, b = param((32,), torch.bfloat16, device), param((32,), torch.float32, device)
    y = fused_layer_norm_affine(x, w, b, (32,), 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.double(), torch_layer_norm(x, (32,), w, b, 1e-5), **tol(torch.bfloat16)
    )
    gx, gw, gb = torch.autograd.grad(y.float().sum(), [x, w, b])
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float32, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_mixed_forms_give_the_weight_dtype(xdtype):
    m = MixedFusedLayerNorm(32, 1e-5, sequence_parallel_enbaled=False).to(torch.float16)
    x = make((4, 32), xdtype)
    assert m(x).dtype == torch.float16
    w = param((32,), torch.float32)
    assert mixed_dtype_fused_layer_norm_affine(x, w, None, (32,)).dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW)
def test_autocast_casts_to_the_autocast_dtype(dtype):
    m = FusedLayerNorm(32)  # float32 parameters
    x = make((4, 32), torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
    assert y.dtype == dtype
    torch.testing.assert_close(
        y.double(), torch_layer_norm(x.to(dtype), (32,), None, None, 1e-5), **tol(dtype)
    )
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_reference_statistics_are_per_row_float32():
    x = make((2, 3, 8), torch.bfloat16)
    out, mean, invvar = ref.layer_norm_fwd(x, None, None, [8], 1e-5)
    assert mean.shape == invvar.shape == (6,)
    assert mean.dtype == invvar.dtype == torch.float32
    xf = x.float().reshape(6, 8)
    torch.testing.assert_close(mean, xf.mean(1))
    torch.testing.assert_close(invvar, torch.rsqrt(xf.var(1, unbiased=False) + 1e-5))


# -- CUDA: the kernels against the reference and against torch ---------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("H", CUDA_H)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cuda_matches_reference(H, dtype, affine, memory_efficient):
    rows = 37 if H <= 8192 else 5
    x = make((rows, H), dtype, "cuda", requires_grad=True, scale=2.0, shift=0.5)
    w = param((H,), dtype, "cuda") if affine in ("both", "weight") else None
    b = param((H,), dtype, "cuda") if affine in ("both", "bias") else None
    y = run(x, w, b, (H,), 1e-5, memory_efficient)
    ins = [t for t in (x, w, b) if t is not None]
    xc = x.detach().cpu().requires_grad_(True)
    wc = w.detach().cpu().requires_grad_(True) if w is not None else None
    bc = b.detach().cpu().requires_grad_(True) if b is not None else None
    expected = torch_layer_norm(xc, (H,), wc, bc, 1e-5)
    torch.testing.assert_close(y.double().cpu(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, ins, dy)
    want = torch.autograd.grad(
        expected, [t for t in (xc, wc, bc) if t is not None], dy.double().cpu()
    )
    torch.testing.assert_close(got[0].double().cpu(), want[0].double(), **tol(dtype, torch.float16))
    for g, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(g.double().cpu(), e.double(), **grad_tol(H, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("H", [1024, 4096])
def test_cuda_two_x_rule_against_torch(dtype, H):
    """Our low-precision error vs a float64 oracle is at most 2x torch's own (STYLE.md)."""
    x = make((256, H), dtype, "cuda", scale=3.0, shift=1.0)
    w, b = param((H,), dtype, "cuda"), param((H,), dtype, "cuda")
    oracle = torch_layer_norm(x, (H,), w, b, 1e-5)
    ours = (fused_layer_norm_affine(x, w, b, (H,), 1e-5).double() - oracle).abs().max()
    theirs = (F.layer_norm(x, (H,), w, b, 1e-5).double() - oracle).abs().max()
    assert ours <= 2 * theirs + 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("H,rows", [(1024, 30011), (4096, 8009), (16384, 1031), (100, 5000)])
def test_cuda_weight_and_bias_gradients_repeat_bit_for_bit(norm, H, rows):
    """The weight and bias gradients are sums over rows in a fixed order (per-group partials,
    then column sums): two backward passes of the same call give the same bits."""
    x = make((rows, H), torch.bfloat16, "cuda", requires_grad=True, scale=2.0, shift=0.5)
    w, b = param((H,), torch.bfloat16, "cuda"), param((H,), torch.bfloat16, "cuda")
    if norm == "rms":
        y, params = fused_rms_norm_affine(x, w, (H,), 1e-5), [w]
    else:
        y, params = fused_layer_norm_affine(x, w, b, (H,), 1e-5), [w, b]
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, params, dy, retain_graph=True)
    second = torch.autograd.grad(y, params, dy)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


@pytest.mark.cuda
@pytest.mark.parametrize("H,rows", MANY_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cuda_many_rows(H, rows, dtype, memory_efficient):
    x = make((rows, H), dtype, "cuda", requires_grad=True, scale=2.0, shift=0.5)
    w, b = param((H,), dtype, "cuda"), param((H,), dtype, "cuda")
    y = run(x, w, b, (H,), 1e-5, memory_efficient)
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    expected = torch_layer_norm(xd, (H,), wd, bd, 1e-5)  # float64 on the GPU
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, b], dy)
    want = torch.autograd.grad(expected, [xd, wd, bd], dy.double())
    torch.testing.assert_close(got[0].double(), want[0], **tol(dtype, torch.float16))
    if memory_efficient and dtype != torch.float32:
        # x-hat comes back from the rounded 16-bit output, so the weight and bias gradients (sums
        # over thousands of rows) carry that rounding, whoever computes them: the kernel is held
        # to the plain-torch reference given the same output, statistics and dy.
        _, mean, invvar = ref.layer_norm_fwd(x.detach(), w.detach(), b.detach(), [H], 1e-5)
        want = ref.layer_norm_bwd(
            dy, mean, invvar, y.detach(), [H], w.detach(), b.detach(), 1e-5, True, dtype
        )
        for g, e in zip(got[1:], want[1:]):
            torch.testing.assert_close(g.double(), e.double(), **tol(dtype))
        return
    for g, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(g.double(), e, **grad_tol(H, dtype))


def backward_against_torch(norm, H, rows, dtype, device, bias_only=False):
    """Fused forward+backward of one norm (LayerNorm with weight and bias, or with a bias alone;
    RMSNorm with a weight) against torch in float64: every gradient, the test_cuda_many_rows
    tolerances."""
    x = make((rows, H), dtype, device, requires_grad=True, scale=2.0, shift=0.5)
    w = None if bias_only else param((H,), dtype, device)
    b = None if norm == "rms" else param((H,), dtype, device)
    # The same tensors in float64 for torch (None stays None).
    xd, wd, bd = (t if t is None else t.detach().double().requires_grad_(True) for t in (x, w, b))
    if norm == "rms":
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        y = fused_rms_norm_affine(x, w, (H,), 1e-5)
        expected = torch_rms_norm(xd, (H,), wd, 1e-5)
    else:
        y = run(x, w, b, (H,), 1e-5, False)
        expected = torch_layer_norm(xd, (H,), wd, bd, 1e-5)
    inputs = [t for t in (x, w, b) if t is not None]
    exp_inputs = [t for t in (xd, wd, bd) if t is not None]
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(expected, exp_inputs, dy.double())
    torch.testing.assert_close(got[0].double(), want[0], **tol(dtype, torch.float16))
    for g, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(g.double(), e, **grad_tol(H, dtype))


# Backwards whose fastest kernel wants more shared memory than ~100 KB a block (bwd_fast with a
# bias at H=16384: 128 KB; the ring at H=16384), as on sm_86, sm_89 and sm_120.
BIG_SMEM = [("layer", 16384, torch.float32), ("layer", 16384, torch.bfloat16),
            ("layer", 8192, torch.float32), ("rms", 16384, torch.bfloat16)]  # fmt: skip
# The subprocess cases below add 16-bit rows of 2 vectors a thread (the backward's bwd_ring_r80,
# RMSNorm's short-row forward) and LayerNorm's H=8192 backward at 4 vectors a thread.
KNOB_CASES = BIG_SMEM + [("layer", 4096, torch.bfloat16), ("rms", 2048, torch.bfloat16),
                         ("rms", 1024, torch.float16), ("layer", 8192, torch.bfloat16)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tune",
    [
        # sm_86's 99 KB: bwd_vec where neither the ring nor bwd_fast fits; LayerNorm's forward
        # without its cache hints
        "smem_kb=99,fwd_hint=0",
        # sm_80's ~160 KB: LayerNorm 16-bit H=16384 back on bwd_fast
        "smem_kb=160",
        # the knobs' other kernels and the merged forward moments; LayerNorm's forward with its
        # streaming store alone
        "bwd_ring=0,ln_one_pass=0,fwd_hint=4",
        # the 16-bit kernels without their 80-register caps (LayerNorm's ring too: bwd_wide=0);
        # RMSNorm's forward with the streaming store alone, LayerNorm's with an uncompiled set
        # (none)
        "fwd_r80=0,bwd_r80=0,bwd_wide=0,fwd_hint=3,rms_fwd_hint=4",
        # the general ring, 2-vector rows at H=8192, the 8-vector forward at H=4096
        "bwd_lean=0,bwd_wide_pt16=0,rms_short_pt16=0,fwd_mid_pt16=0",
        # a ring of 4 stages where it fits (rows up to H=4096), fewer above; LayerNorm's 4-vector
        # ring (H=8192, 16384, bwd_wide=0) with its bias sums one float each; every forward cache
        # hint (the 80-register forward's too)
        "bwd_ring=4,bwd_bias4=0,bwd_wide=0,fwd_hint=7,rms_fwd_hint=7",
        # bwd_wide's bits one at a time (both, the default, in every other case): LayerNorm's
        # rows past 4096 through bwd_ring_wide where an SM holds 32 of its warps, then those of
        # 1025-4096
        "bwd_wide=1",
        "bwd_wide=2",
    ],
)
def test_cuda_tuning_knobs_and_smaller_gpus_take_other_kernels(tmp_path, tune):
    """With a block's shared memory capped (APEX_NORM_TUNE smem_kb, read once per process: a
    fresh one), the ring or the one-pass forward off, the 16-bit kernels without their register
    caps or their LEAN ring, the forward's vectors a thread at H=4096 back at 8, a deeper ring
    with scalar bias sums, or the forward's cache hints on or off, each case takes another
    kernel and is still right."""
    script = tmp_path / "capped.py"
    cases = [(norm, H, str(dtype).removeprefix("torch.")) for norm, H, dtype in KNOB_CASES]
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, torch
            import torch.nn.functional as F
            sys.path[:0] = [{str(HERE)!r}]
            from test_layer_norm import backward_against_torch
            from norm_testing import tol
            torch.manual_seed(0)
            for norm, H, dtype in {cases!r}:
                backward_against_torch(norm, H, 1031, getattr(torch, dtype), "cuda")
                print("ok", norm, H, dtype)
            # The 16-bit forward without weight and bias (the hinted kernels' a.w == nullptr
            # path), bfloat16 backwards and float32 forwards with weights, and the kernel names
            # their launches took.
            from apex.normalization.fused_layer_norm import (
                fused_layer_norm, fused_layer_norm_affine, fused_rms_norm, fused_rms_norm_affine)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for H in (1024, 4096, 16384):
                    x = torch.randn(257, H, device="cuda", dtype=torch.bfloat16)
                    for y, want in (
                        (fused_layer_norm(x, (H,), 1e-5), F.layer_norm(x.float(), (H,), eps=1e-5)),
                        (fused_rms_norm(x, (H,), 1e-5), F.rms_norm(x.float(), (H,), eps=1e-5)),
                    ):
                        torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
                for H in (2048, 4096, 8192, 12288):
                    for norm in ("layer", "rms"):
                        backward_against_torch(norm, H, 257, torch.bfloat16, "cuda")
                x = torch.randn(257, 4096, device="cuda")
                w, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
                xd, wd, bd = x.double(), w.double(), b.double()
                for y, want in (
                    (fused_layer_norm_affine(x, w, b, (4096,), 1e-5),
                     F.layer_norm(xd, (4096,), wd, bd, eps=1e-5)),
                    (fused_rms_norm_affine(x, w, (4096,), 1e-5), F.rms_norm(xd, (4096,), wd, eps=1e-5)),
                ):
                    torch.testing.assert_close(y.double(), want, **tol(torch.float32))
                torch.cuda.synchronize()
            for name in sorted({{e.name for e in prof.events() if "fwd_" in e.name or "bwd_" in e.name}}):
                print("kernel", name)
            # LayerNorm's 16-bit backwards one at a time (weight and bias; bias alone): whether
            # each took bwd_ring_wide, and each right.
            props = torch.cuda.get_device_properties(0)
            optin = getattr(props, "shared_memory_per_block_optin", 0)
            # An SM's shared memory (sm_80 and sm_90: 1 KB over a block's opt-in limit).
            per_sm = getattr(props, "shared_memory_per_multiprocessor", optin + 1024)
            for H in (1024, 2048, 4096, 8192, 12288, 16384):
                for dtype in (torch.bfloat16, torch.float16):
                    with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]
                    ) as one:
                        backward_against_torch("layer", H, 257, dtype, "cuda")
                        backward_against_torch("layer", H, 257, dtype, "cuda", bias_only=True)
                        torch.cuda.synchronize()
                    wide = sum("bwd_ring_wide<" in e.name for e in one.events())
                    print("layer-bwd", H, str(dtype).removeprefix("torch."), wide, optin, per_sm)
            """
        )
    )
    env = {**os.environ, "APEX_NORM_TUNE": tune, "APEX_STRICT_KERNELS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == len(KNOB_CASES)
    kernels = [line for line in done.stdout.splitlines() if line.startswith("kernel ")]
    # The 16-bit forward kernels carry the norm (third template argument: RMS) and the hint set
    # (the last); each norm's must have run with its knob's set (defaults: LayerNorm 7, RMSNorm
    # 0). (Sets other than 0, 4 and 7 are not compiled: such a value runs none.)
    knobs = dict(k.split("=") for k in tune.split(","))
    sets = {0, 4, 7}
    want = {
        norm: v if v in sets else 0
        for norm, v in (
            ("false", int(knobs.get("fwd_hint", 7))),
            ("true", int(knobs.get("rms_fwd_hint", 0))),
        )
    }
    ran = {
        (m[1], int(m[2]))
        for k in kernels
        if (
            m := re.search(
                r"fwd_fast(?:_r80)?<(?:c10::)?(?:BFloat16|Half), \d+, (true|false)[^()]*, (\d+)>", k
            )
        )
    }
    assert set(want.items()) <= ran, (want, kernels)
    # bwd_wide: each LayerNorm 16-bit backward (with weight and bias, and with a bias alone: two
    # launches) took bwd_ring_wide where its bit covers the row (bit 1 H > 4096, bit 2 H of
    # 1025-4096; default both) and the LEAN ring runs (bwd_lean, bwd_ring >= 2), every thread
    # holds two vectors of it, the ring fits a block's shared memory and an SM holds 1024 of its
    # threads (sm_90: H = 2048, 4096, 8192, 16384; not 12288: 1536 vectors on 1024 threads), and
    # never elsewhere (nor in RMSNorm's).
    bits = int(knobs.get("bwd_wide", 3))
    ring = int(knobs.get("bwd_ring", 2))
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("layer-bwd ")]
    assert len(lines) == 12, done.stdout
    for _, H, dtype, wide, optin, per_sm in lines:
        H, wide, optin, per_sm = int(H), int(wide), int(optin), int(per_sm)
        covered = (bits & 1 and H > 4096) or (bits & 2 and 1024 < H <= 4096)
        covered = covered and ring >= 2 and int(knobs.get("bwd_lean", 1)) > 0
        # pick()'s shape: a power of two of threads a row from 32 up, at most 1024, at 2 vectors
        # (8 elements each) a thread; rows of fewer than 256 threads share a block.
        nvec, tx = H // 8, 32
        while tx < 1024 and tx * 2 < nvec:
            tx *= 2
        threads = tx * max(1, 256 // tx)
        # The ring's stages (bwd_ring, fewer past 112 KB), each holding x and dy at 2 vectors a
        # thread (64 bytes) and two row statistics (8); 16 float bias sums a thread (64); 2 KB of
        # static slots; 1 KB a block more, reserved by the driver (sm_80 on). Its 64 registers a
        # thread never hold an SM under 1024 threads.
        # (max_dyn_smem: the opt-in limit, or smem_kb's cap of a block, less 4 KB, the largest
        # kernel's static slots. The cap is a block's: the SM keeps its real shared memory.)
        kb = int(knobs.get("smem_kb", 0))
        dyn_max = (min(optin, max(kb, 16) * 1024) if kb else optin) - 4096
        stages = ring
        while stages > 2 and 72 * stages * threads + 64 * threads > min(112 * 1024, dyn_max):
            stages -= 1
        dyn = 72 * stages * threads + 64 * threads
        smem, fits = dyn + 2048, dyn <= dyn_max
        full = min(per_sm // (smem + 1024), 2048 // threads) * threads >= 1024
        even = tx * 2 == nvec
        assert wide == (2 if covered and fits and full and even else 0), (H, dtype, wide, tune)


@pytest.mark.cuda
def test_cuda_tuning_knobs_warn_about_what_they_do_not_take(tmp_path):
    """APEX_NORM_TUNE: an unknown knob, a value that is not an integer, and one outside a knob's
    range (a bit mask's 4) each warn once, naming the knob, and are ignored; the norms still
    compute."""
    script = tmp_path / "warned.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, warnings, torch
            sys.path[:0] = [{str(HERE)!r}]
            from test_layer_norm import backward_against_torch
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                backward_against_torch("layer", 4096, 33, torch.bfloat16, "cuda")
                backward_against_torch("rms", 1024, 33, torch.float32, "cuda")
            for w in seen:
                print("warned", str(w.message).splitlines()[0])
            """
        )
    )
    env = {**os.environ, "APEX_NORM_TUNE": "bogus=1,bwd_lean=two,bwd_wide=4,bwd_ring=-1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    warned = [line for line in done.stdout.splitlines() if line.startswith("warned ")]
    for expected in (
        "unknown knob 'bogus' ignored",
        "bwd_lean='two' is not an integer: ignored",
        "bwd_wide=4 is outside 0..3: ignored",
        "bwd_ring=-1 is outside 0..4: ignored",
    ):
        assert sum(expected in line for line in warned) == 1, (expected, warned)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("norm,H,dtype", BIG_SMEM)
def test_cuda_big_shared_memory_backward_on_each_device(norm, H, dtype):
    """A kernel's shared-memory opt-in is per device: the second device gets its own."""
    for device in ("cuda:0", "cuda:1"):
        backward_against_torch(norm, H, 1031, dtype, device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_nan_and_inf_rows_stay_nan(dtype):
    """A row holding a NaN or an inf comes out NaN (as torch's), whatever the moments' formula;
    the other rows are untouched."""
    H = 4096
    x = make((6, H), dtype, "cuda", scale=2.0, shift=0.5)
    x[1, 7] = float("nan")
    x[3, 100] = float("inf")
    x[4, 0] = float("-inf")
    y = fused_layer_norm(x, (H,), 1e-5)
    assert torch.isnan(y[[1, 3, 4]]).all()
    good = [0, 2, 5]
    expected = torch_layer_norm(x[good].double(), (H,), None, None, 1e-5)
    torch.testing.assert_close(y[good].double(), expected, **tol(dtype))


@pytest.mark.cuda
def test_cuda_large_mean_small_variance():
    """Rows of mean 1000 and spread 0.01: the merged (count, mean, M2) keeps the variance where
    a sum and a sum of squares would cancel to noise in float32 (E[x^2] = 1e6 against a variance
    of 1e-4). What is left is the float32 mean's own rounding (half an ulp of 1000, 3e-5, over
    the spread 0.01: a few 1e-3 of y)."""
    x = torch.randn(4096, 1024, device="cuda") * 0.01 + 1000.0
    y = fused_layer_norm(x, (1024,), 0.0)
    expected = torch_layer_norm(x.double(), (1024,), None, None, 0.0)
    torch.testing.assert_close(y.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [1024, 4096, 8192])
def test_16bit_constant_and_large_mean_rows(device, dtype, H):
    """Constant 16-bit rows (means up to fp16's 60000) normalise to exactly zero, so y is the
    bias itself: a forward of x * r - mu * r would leave mu * r's rounding (r = 1/sqrt(eps) ~ 316:
    about 1 at 60000). Rows of large mean and a 1 % spread match torch, forward and grad_input."""
    means = torch.tensor([0.0, 1.0, -7.0, 1000.0, 3000.0, -30000.0, 60000.0])
    x = means[:, None].expand(len(means), H).to(device=device, dtype=dtype).contiguous()
    w = param((H,), dtype, device)
    b = param((H,), dtype, device)
    y = fused_layer_norm_affine(x, w, b, (H,), 1e-5)
    assert torch.equal(y, b.detach().expand_as(y)), (y - b).abs().amax(dim=1)
    spread = 1 + 0.01 * torch.randn(len(means) - 3, H)
    x = (means[3:, None] * spread).to(device=device, dtype=dtype).requires_grad_(True)
    y = fused_layer_norm_affine(x, w, b, (H,), 1e-5)
    xc, wc, bc = (t.detach().cpu().double().requires_grad_(True) for t in (x, w, b))
    expected = torch_layer_norm(xc, (H,), wc, bc, 1e-5)
    torch.testing.assert_close(y.double().cpu(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, [x], dy)
    (want,) = torch.autograd.grad(expected, [xc], dy.double().cpu())
    torch.testing.assert_close(got.double().cpu(), want, **tol(dtype, torch.float16))


@pytest.mark.cuda
def test_cuda_unaligned_and_non_contiguous():
    base = make((33, 4097), torch.bfloat16, "cuda")
    x = base[:, 1:].requires_grad_(True)  # non-contiguous: the op works on a (fresh) copy
    w = param((4096,), torch.bfloat16, "cuda")
    y = fused_layer_norm_affine(x, w, None, (4096,), 1e-5)
    torch.testing.assert_close(
        y.double(), torch_layer_norm(x, (4096,), w, None, 1e-5), **tol(torch.bfloat16)
    )
    # Contiguous but 2 bytes off a 16-byte boundary (no copy is made): the scalar kernels,
    # though H is a multiple of the vector width; weight misaligned the same way.
    flat = make((33 * 4096 + 1,), torch.bfloat16, "cuda")
    x = flat[1:].view(33, 4096).requires_grad_(True)
    w = make((4097,), torch.bfloat16, "cuda", shift=1.0)[1:].requires_grad_(True)
    b = param((4096,), torch.bfloat16, "cuda")
    assert x.is_contiguous() and x.data_ptr() % 16 != 0 and w.data_ptr() % 16 != 0
    y = fused_layer_norm_affine(x, w, b, (4096,), 1e-5)
    xc, wc, bc = (t.detach().cpu().requires_grad_(True) for t in (x, w, b))
    expected = torch_layer_norm(xc, (4096,), wc, bc, 1e-5)
    torch.testing.assert_close(y.double().cpu(), expected, **tol(torch.bfloat16))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, b], dy)
    want = torch.autograd.grad(expected, [xc, wc, bc], dy.double().cpu())
    torch.testing.assert_close(got[0].double().cpu(), want[0].double(), **tol(torch.bfloat16))
    for g, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(g.double().cpu(), e.double(), **grad_tol(4096, torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize(
    "xdtype,wdtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float64),  # float64 anywhere: the reference, on the GPU
    ],
)
def test_cuda_mixed_dtypes(xdtype, wdtype):
    x = make((64, 1024), xdtype, "cuda", requires_grad=True)
    w, b = param((1024,), wdtype, "cuda"), param((1024,), wdtype, "cuda")
    for fn in (fused_layer_norm_affine, mixed_dtype_fused_layer_norm_affine):
        y = fn(x, w, b, (1024,), 1e-5)
        torch.testing.assert_close(
            y.double(), torch_layer_norm(x, (1024,), w, b, 1e-5), **tol(y.dtype, xdtype)
        )
        gx, gw, gb = torch.autograd.grad(y.float().sum(), [x, w, b])
        assert (gx.dtype, gw.dtype, gb.dtype) == (xdtype, wdtype, wdtype)


@pytest.mark.cuda
def test_cuda_weight_and_bias_of_different_dtypes():
    test_weight_and_bias_of_different_dtypes("cuda")


@pytest.mark.cuda
def test_cuda_zero_rows_and_float64():
    m = FusedLayerNorm(64).cuda()
    x = torch.empty(0, 64, device="cuda", requires_grad=True)
    m(x).sum().backward()
    assert torch.equal(m.weight.grad, torch.zeros(64, device="cuda"))
    xd = make((4, 64), torch.float64, "cuda")
    md = FusedLayerNorm(64).cuda().double()
    torch.testing.assert_close(md(xd), F.layer_norm(xd, (64,), md.weight, md.bias))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_on_the_second_device():
    m = FusedLayerNorm(1024).to("cuda:1")
    x = make((64, 1024), torch.float32, "cuda:1", requires_grad=True)
    torch.cuda.set_device(0)
    y = m(x)
    assert y.device == x.device
    torch.testing.assert_close(y, F.layer_norm(x, (1024,), m.weight, m.bias))
    y.sum().backward()
    assert x.grad.device == x.device


@pytest.mark.cuda
def test_cuda_kernels_are_loaded():
    from apex.normalization import ops

    assert ops.OPS.ensure_loaded(), "apex_norm_C did not load: the CUDA tests ran the reference"


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_cuda_over_two_to_the_31_elements():
    """64-bit indexing: rows past element 2^31 are normalised, and their gradients are right."""
    H = 4096
    rows = 2**31 // H + 3
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = param((H,), torch.bfloat16, "cuda")
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine

    for fn, oracle in (
        (
            lambda t: fused_layer_norm_affine(t, w, None, (H,), 1e-5),
            lambda t: torch_layer_norm(t, (H,), w, None, 1e-5),
        ),
        (
            lambda t: fused_rms_norm_affine(t, w, (H,), 1e-5),
            lambda t: torch_rms_norm(t, (H,), w, 1e-5),
        ),
    ):
        y = fn(x)
        tail = x[-4:].detach().requires_grad_(True)
        torch.testing.assert_close(y[-4:].double(), oracle(tail), **tol(torch.bfloat16))
        dy = torch.zeros_like(y)
        dy[-4:] = torch.randn_like(dy[-4:])
        (gx,) = torch.autograd.grad(y, [x], dy)
        (ex,) = torch.autograd.grad(oracle(tail), [tail], dy[-4:].double())
        torch.testing.assert_close(gx[-4:].double(), ex.double(), **tol(torch.bfloat16))
        assert not gx[:-4].any()
        del y, dy, gx
