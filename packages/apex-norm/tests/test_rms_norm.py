"""FusedRMSNorm and its functional forms against torch's rms_norm (CPU: the reference path) and,
under the ``cuda`` marker, the CUDA kernels against the reference and torch."""

from __future__ import annotations

import pytest
import torch
from norm_testing import (
    CUDA_H,
    DTYPES,
    LOW,
    MANY_ROWS,
    PlainRMSNorm,
    RMSNorm,
    grad_tol,
    make,
    param,
    rms_norm,
    tol,
    torch_rms_norm,
)

from apex.normalization import FusedRMSNorm, MixedFusedRMSNorm
from apex.normalization.fused_layer_norm import (
    FusedRMSNormAffineFunction,
    FusedRMSNormFunction,
    fused_rms_norm,
    fused_rms_norm_affine,
    manual_rms_norm,
    mixed_dtype_fused_rms_norm_affine,
)

# RMSNorm of a 1-element row outputs +-weight: x-hat recovered from a 16-bit output leaves
# grad_input (exactly 0) to cancellation, scaled by 1/|x|.
ILL_CONDITIONED = "memory_efficient, 16-bit, H=1: grad_input is a cancellation to 0"

SHAPES = [
    ((4, 32), (32,)),
    ((3, 5, 7), (7,)),
    ((2, 3, 5, 7), (5, 7)),
    ((6, 1), (1,)),
    ((5, 129), (129,)),
]


# The routes a CPU call can take: the functional forms (eager, without memory_efficient: torch's
# own F.rms_norm through the plain math) and the autograd Functions (the apex_norm ops, so the
# reference's forward and backward).
ROUTES = ["functional", "Function"]


def run(x, w, shape, eps, memory_efficient, route="functional"):
    if route == "Function":
        if w is None:
            return FusedRMSNormFunction.apply(x, shape, eps, memory_efficient)
        return FusedRMSNormAffineFunction.apply(x, w, shape, eps, memory_efficient)
    if w is None:
        return fused_rms_norm(x, shape, eps, memory_efficient)
    return fused_rms_norm_affine(x, w, shape, eps, memory_efficient)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_forward_and_grads_match_torch(dtype, xshape, shape, affine, memory_efficient, route):
    if memory_efficient and dtype in LOW and shape == (1,):
        pytest.skip(ILL_CONDITIONED)
    x = make(xshape, dtype, requires_grad=True)
    w = param(shape, dtype) if affine else None
    y = run(x, w, shape, 1e-5, memory_efficient, route)
    assert y.dtype == dtype and y.shape == x.shape
    expected = torch_rms_norm(x, shape, w, 1e-5)
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    with torch.no_grad():  # recording nothing: on the CPU the eager forms' F.rms_norm route
        y0 = run(x, w, shape, 1e-5, memory_efficient, route)
    assert y0.dtype == dtype and y0.is_contiguous()
    torch.testing.assert_close(y0.double(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    ins = [t for t in (x, w) if t is not None]
    got = torch.autograd.grad(y, ins, dy)
    want = torch.autograd.grad(expected, ins, dy.double())
    torch.testing.assert_close(got[0].double(), want[0].double(), **tol(dtype, torch.float16))
    if affine:
        assert got[1].dtype == dtype
        torch.testing.assert_close(got[1].double(), want[1].double(), **grad_tol(shape[-1], dtype))


def test_module_matches_nn_rmsnorm_and_state_dict():
    # torch.nn.RMSNorm (torch 2.3: norm_testing.PlainRMSNorm, the same state_dict and math).
    x = make((8, 4, 16), torch.float32, requires_grad=True)
    ours, theirs = FusedRMSNorm(16), RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16))
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    ours(x).square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    theirs(x).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


@pytest.mark.parametrize("route", ROUTES)
def test_gradcheck_float64(route):
    x = make((3, 2, 5), torch.float64, requires_grad=True)
    w = param((2, 5), torch.float64)
    for mem in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, w, mem=mem: run(x, w, (2, 5), 1e-5, mem, route), (x, w)
        )
    assert torch.autograd.gradcheck(lambda x: run(x, None, (5,), 1e-5, False, route), (x,))


@pytest.mark.parametrize("route", ROUTES)
def test_gradgradcheck_float64(route):
    """Double backward (create_graph=True), as torch.nn.RMSNorm has it."""
    x = make((3, 2, 5), torch.float64, requires_grad=True)
    w = param((2, 5), torch.float64)
    assert torch.autograd.gradgradcheck(lambda x, w: run(x, w, (2, 5), 1e-5, False, route), (x, w))
    assert torch.autograd.gradgradcheck(lambda x: run(x, None, (5,), 1e-5, False, route), (x,))
    xt = make((5, 4), torch.float64).t().requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda x: run(x, None, (5,), 1e-5, False, route), (xt,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradient_penalty_matches_plain_rms_norm(device):
    ours = FusedRMSNorm(64, eps=1e-5).to(device)
    theirs = PlainRMSNorm(64, 1e-5).to(device)
    for m in (ours, theirs):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = make((8, 64), torch.float32, device, requires_grad=True)

    def penalty(norm):
        (gx,) = torch.autograd.grad(norm(x).sum(), [x], create_graph=True)
        return torch.autograd.grad((gx.square().sum() - 1.0).square(), [x, norm.weight])

    for got, want in zip(penalty(ours), penalty(theirs)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_zero_rows_and_non_contiguous():
    m = FusedRMSNorm(16)
    x = make((0, 16), torch.float32, requires_grad=True)
    m(x).sum().backward()
    assert torch.equal(m.weight.grad, torch.zeros(16))
    xt = make((16, 8), torch.float32).t()
    torch.testing.assert_close(m(xt), rms_norm(xt, (16,), m.weight, 1e-5))


def test_memory_efficient_saves_the_output():
    x = make((4, 16), torch.float32, requires_grad=True)
    w = param((16,), torch.float32)
    y = FusedRMSNormAffineFunction.apply(x, w, torch.Size([16]), 1e-5, True)
    assert any(t.data_ptr() == y.data_ptr() for t in y.grad_fn.saved_tensors if t is not None)
    assert not any(t.data_ptr() == x.data_ptr() for t in y.grad_fn.saved_tensors if t is not None)


def test_t5_rule_float32_input_half_weight():
    """fp32 residual with a bf16 weight (HF T5 in bf16): bf16 out, as T5LayerNorm gives."""
    m = FusedRMSNorm(32, eps=1e-6).to(torch.bfloat16)
    x = make((4, 32), torch.float32)
    y = m(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, manual_rms_norm(x, (32,), m.weight, 1e-6), **tol(torch.bfloat16))


def test_mixed_forms_give_the_weight_dtype():
    m = MixedFusedRMSNorm(32, eps=1e-5).to(torch.float16)
    assert m(make((4, 32), torch.float32)).dtype == torch.float16
    w = param((32,), torch.float32)
    assert (
        mixed_dtype_fused_rms_norm_affine(make((4, 32), torch.bfloat16), w, (32,)).dtype
        == torch.float32
    )


@pytest.mark.parametrize("dtype", LOW)
def test_autocast_casts_to_the_autocast_dtype(dtype):
    m = FusedRMSNorm(32)
    x = make((4, 32), torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_manual_rms_norm_matches_torch():
    x = make((4, 3, 8), torch.float32)
    w = param((3, 8), torch.float32)
    torch.testing.assert_close(manual_rms_norm(x, (3, 8), w, 1e-5), rms_norm(x, (3, 8), w, 1e-5))


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("H", CUDA_H)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cuda_matches_reference(H, dtype, affine, memory_efficient):
    if memory_efficient and dtype in LOW and H == 1:
        pytest.skip(ILL_CONDITIONED)
    rows = 37 if H <= 8192 else 5
    x = make((rows, H), dtype, "cuda", requires_grad=True, scale=2.0, shift=0.5)
    w = param((H,), dtype, "cuda") if affine else None
    y = run(x, w, (H,), 1e-5, memory_efficient)
    xc = x.detach().cpu().requires_grad_(True)
    wc = w.detach().cpu().requires_grad_(True) if affine else None
    expected = torch_rms_norm(xc, (H,), wc, 1e-5)
    torch.testing.assert_close(y.double().cpu(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in (x, w) if t is not None], dy)
    want = torch.autograd.grad(expected, [t for t in (xc, wc) if t is not None], dy.double().cpu())
    torch.testing.assert_close(got[0].double().cpu(), want[0].double(), **tol(dtype, torch.float16))
    if affine:
        torch.testing.assert_close(got[1].double().cpu(), want[1].double(), **grad_tol(H, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("H,rows", MANY_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_cuda_many_rows(H, rows, dtype, memory_efficient):
    x = make((rows, H), dtype, "cuda", requires_grad=True, scale=2.0, shift=0.5)
    w = param((H,), dtype, "cuda")
    y = run(x, w, (H,), 1e-5, memory_efficient)
    xd, wd = (t.detach().double().requires_grad_(True) for t in (x, w))
    expected = torch_rms_norm(xd, (H,), wd, 1e-5)  # float64 on the GPU
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w], dy)
    want = torch.autograd.grad(expected, [xd, wd], dy.double())
    torch.testing.assert_close(got[0].double(), want[0], **tol(dtype, torch.float16))
    torch.testing.assert_close(got[1].double(), want[1], **grad_tol(H, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("H", [1024, 4096])
def test_cuda_two_x_rule_against_torch(dtype, H):
    x = make((256, H), dtype, "cuda", scale=3.0, shift=1.0)
    w = param((H,), dtype, "cuda")
    oracle = torch_rms_norm(x, (H,), w, 1e-5)
    ours = (fused_rms_norm_affine(x, w, (H,), 1e-5).double() - oracle).abs().max()
    theirs = (rms_norm(x, (H,), w, 1e-5).double() - oracle).abs().max()
    assert ours <= 2 * theirs + 1e-6


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_on_the_second_device():
    m = FusedRMSNorm(1024).to("cuda:1")
    x = make((64, 1024), torch.bfloat16, "cuda:1", requires_grad=True)
    torch.cuda.set_device(0)
    y = m.to(torch.bfloat16)(x)
    torch.testing.assert_close(
        y.double(), torch_rms_norm(x, (1024,), m.weight, 1e-5), **tol(torch.bfloat16)
    )
    y.float().sum().backward()
    assert x.grad.device == x.device
