"""multi_tensor_adagrad: the op, its reference, its CUDA kernel and the legacy amp_C entry point.

Oracles: torch.optim.Adagrad (foreach=False, no lr decay, a zero initial accumulator) for
adagrad_w_mode 0, whose semantics are torch's (L2 weight decay, eps added after the square
root), and a plain float64 loop of apex's formula, written here, for both modes.
"""

import itertools

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, TOLERANCES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def random_dtypes(n):
    return [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]


def apex_adagrad(g, p, h, lr, eps, w_mode, weight_decay):
    """apex's multi_tensor_adagrad on one tensor, in float64: the new (param, state sum)."""
    g, p, h = g.double(), p.double(), h.double()
    if w_mode == 0:
        g = g + weight_decay * p
        h = h + g * g
        return p - lr * g / (h.sqrt() + eps), h
    h = h + g * g
    return p - lr * (g / (h.sqrt() + eps) + weight_decay * p), h


def assert_close(actual, expected):
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---- many steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("eps", [1e-10, 1e-3])
def test_adagrad_mode_0_matches_torch_optim_adagrad_over_50_steps(
    device, weight_decay, eps, strict_kernels
):
    sizes = [1, 97, 4099, 65537]
    theirs = [torch.nn.Parameter(rand(n, torch.float32, device)) for n in sizes]
    ours = [p.detach().clone() for p in theirs]
    sums = [torch.zeros_like(p) for p in ours]
    opt = torch.optim.Adagrad(theirs, lr=0.05, eps=eps, weight_decay=weight_decay, foreach=False)
    noop = flag(device)
    for _ in range(50):
        grads = [rand(n, torch.float32, device) for n in sizes]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        ops.multi_tensor_adagrad(grads, ours, sums, noop, 0.05, eps, 0, weight_decay)
    for p, w, h in zip(theirs, ours, sums):
        torch.testing.assert_close(w, p.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, opt.state[p]["sum"], atol=1e-5, rtol=1e-5)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("w_mode", [0, 1])
def test_adagrad_matches_apex_loop_over_50_steps(device, w_mode, strict_kernels):
    sizes = [3, 4099, 65537]
    ps = [rand(n, torch.float32, device) for n in sizes]
    hs = [torch.zeros_like(p) for p in ps]
    want = [(p.double(), h.double()) for p, h in zip(ps, hs)]
    for _ in range(50):
        gs = [rand(n, torch.float32, device) for n in sizes]
        ops.multi_tensor_adagrad(gs, ps, hs, flag(device), 0.03, 1e-6, w_mode, 5e-2)
        want = [apex_adagrad(g, wp, wh, 0.03, 1e-6, w_mode, 5e-2) for g, (wp, wh) in zip(gs, want)]
    for p, h, (wp, wh) in zip(ps, hs, want):
        torch.testing.assert_close(p, wp.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, wh.float(), atol=1e-5, rtol=1e-5)


# ---- one step: dtypes, grouping, sizes -----------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg,dp,dh", list(itertools.product(DTYPES, repeat=3)))
@pytest.mark.parametrize("w_mode", [0, 1])
def test_adagrad_one_step_every_dtype_combination(device, dg, dp, dh, w_mode, strict_kernels):
    gs = [rand(n, dg, device) for n in SIZES]
    ps = [rand(n, dp, device) for n in SIZES]
    hs = [torch.rand(n, device=device).to(dh) for n in SIZES]
    want = [apex_adagrad(g, p, h, 0.1, 1e-8, w_mode, 1e-2) for g, p, h in zip(gs, ps, hs)]
    ops.multi_tensor_adagrad(gs, ps, hs, flag(device), 0.1, 1e-8, w_mode, 1e-2)
    for p, h, (wp, wh) in zip(ps, hs, want):
        assert_close(p, wp)
        assert_close(h, wh)


@pytest.mark.parametrize("device", devices())
def test_adagrad_mixed_dtype_lists_are_grouped(device, strict_kernels):
    n = 12
    sizes = [1000 + 37 * i for i in range(n)]
    gs = [rand(s, d, device) for s, d in zip(sizes, random_dtypes(n))]
    ps = [rand(s, d, device) for s, d in zip(sizes, random_dtypes(n))]
    hs = [torch.rand(s, device=device).to(d) for s, d in zip(sizes, random_dtypes(n))]
    want = [apex_adagrad(g, p, h, 0.1, 1e-8, 1, 1e-2) for g, p, h in zip(gs, ps, hs)]
    ops.multi_tensor_adagrad(gs, ps, hs, flag(device), 0.1, 1e-8, 1, 1e-2)
    for p, h, (wp, wh) in zip(ps, hs, want):
        assert_close(p, wp)
        assert_close(h, wh)


@pytest.mark.parametrize("device", devices())
def test_adagrad_many_small_zero_size_and_channels_last(device, strict_kernels):
    sizes = [int(n) for n in torch.randint(0, 300, (1500,))] + [0]
    gs = [rand(n, torch.float32, device) for n in sizes]
    ps = [rand(n, torch.float32, device) for n in sizes]
    hs = [torch.rand(n, device=device) for n in sizes]
    shape = (3, 5, 7, 11)
    cl = lambda t: t.to(memory_format=torch.channels_last)  # noqa: E731
    gs.append(cl(rand(0, torch.bfloat16, device, shape)))
    ps.append(cl(rand(0, torch.bfloat16, device, shape)))
    hs.append(cl(torch.rand(shape, device=device).bfloat16()))
    want = [apex_adagrad(g, p, h, 0.1, 1e-10, 0, 0.0) for g, p, h in zip(gs, ps, hs)]
    ops.multi_tensor_adagrad(gs, ps, hs, flag(device), 0.1, 1e-10, 0, 0.0)
    for p, h, (wp, wh) in zip(ps, hs, want):
        assert_close(p, wp)
        assert_close(h, wh)


# ---- the noop flag is neither read nor written ---------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_adagrad_ignores_the_flag_and_propagates_nonfinite(device, strict_kernels):
    gs = [rand(n, torch.float32, device) for n in (10, 70000)]
    ps = [rand(n, torch.float32, device) for n in (10, 70000)]
    hs = [torch.rand(n, device=device) for n in (10, 70000)]
    gs[1][4] = float("inf")
    want = [apex_adagrad(g, p, h, 0.1, 1e-8, 0, 0.0) for g, p, h in zip(gs, ps, hs)]
    noop = flag(device, 1)  # set: apex's adagrad steps anyway
    ops.multi_tensor_adagrad(gs, ps, hs, noop, 0.1, 1e-8, 0, 0.0)
    assert_close(ps[0], want[0][0])
    assert torch.isnan(ps[1][4]) and torch.isinf(hs[1][4])  # inf / inf: as apex, no guard
    assert noop.item() == 1
    noop.zero_()
    ops.multi_tensor_adagrad(gs, ps, hs, noop, 0.1, 1e-8, 0, 0.0)
    assert noop.item() == 0  # and never set it


@pytest.mark.parametrize("device", devices())
def test_adagrad_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    ops.multi_tensor_adagrad([], [], [], noop, 0.1, 1e-8, 0, 0.0)
    assert noop.item() == 0


# ---- bad input ----------------------------------------------------------------------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    return [
        (
            "lengths",
            [x(), x()],
            [x(), x()],
            [x()],
            0,
            ValueError,
            "state_sums has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            "sizes",
            [x(8)],
            [x(9)],
            [x(8)],
            0,
            ValueError,
            "params\\[0\\] has 9 elements but grads\\[0\\] has 8",
        ),
        (
            "dtype",
            [x(8, torch.float64)],
            [x()],
            [x()],
            0,
            TypeError,
            "grads\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            "mode",
            [x()],
            [x()],
            [x()],
            2,
            ValueError,
            "adagrad_w_mode must be 0 \\(L2\\) or 1 \\(decoupled weight decay\\), got 2",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(4))
def test_adagrad_bad_input(device, case, strict_kernels):
    name, gs, ps, hs, w_mode, exc, words = _bad_cases(device)[case]
    before = [t.clone() for t in ps + hs]
    with pytest.raises(exc, match=words):
        ops.multi_tensor_adagrad(gs, ps, hs, flag(device), 0.1, 1e-8, w_mode, 0.0)
    for t, b in zip(ps + hs, before):
        assert same_bits(t, b), name


# ---- legacy amp_C --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_adagrad(device, strict_kernels):
    gs = [rand(n, torch.float16, device) for n in (3, 65537)]
    ps = [rand(n, torch.float16, device) for n in (3, 65537)]
    hs = [torch.rand(n, device=device).half() for n in (3, 65537)]
    want = [apex_adagrad(g, p, h, 0.1, 1e-10, 1, 1e-2) for g, p, h in zip(gs, ps, hs)]
    noop = flag(device)
    assert amp_C.multi_tensor_adagrad(2048 * 32, noop, [gs, ps, hs], 0.1, 1e-10, 1, 1e-2) is None
    for p, h, (wp, wh) in zip(ps, hs, want):
        assert_close(p, wp)
        assert_close(h, wh)
    with pytest.raises(ValueError, match="tensor_lists must hold 3 lists, got 4"):
        amp_C.multi_tensor_adagrad(2048 * 32, noop, [gs, ps, hs, hs], 0.1, 1e-10, 1, 1e-2)


# ---- the op contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_adagrad_opcheck(device, strict_kernels):
    gs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    ps = [rand(n, torch.float32, device) for n in (5, 70000, 1)]
    hs = [torch.rand_like(p) for p in ps]
    args = (gs, ps, hs, flag(device), 0.1, 1e-10, 0, 1e-2)
    opcheck(torch.ops.apex_mta.multi_tensor_adagrad.default, args)


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_adagrad_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def step(gs, ps, hs, noop):
        ops.multi_tensor_adagrad(gs, ps, hs, noop, 0.1, 1e-10, 1, 1e-2)
        return ps[0] * 2

    gs = [rand(n, torch.bfloat16, device) for n in (17, 65539)]
    ps = [rand(n, torch.float32, device) for n in (17, 65539)]
    hs = [torch.rand_like(p) for p in ps]
    want = [apex_adagrad(g, p, h, 0.1, 1e-10, 1, 1e-2) for g, p, h in zip(gs, ps, hs)]
    y = step(gs, ps, hs, flag(device))
    for p, h, (wp, wh) in zip(ps, hs, want):
        assert_close(p, wp)
        assert_close(h, wh)
    torch.testing.assert_close(y, ps[0] * 2)


# ---- CUDA against the reference ------------------------------------------------------------------


@pytest.mark.cuda
def test_adagrad_cuda_matches_reference_on_random_lists(strict_kernels):
    for trial in range(6):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        gs = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        ps = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        hs = [torch.rand(s, device="cuda").to(d) for s, d in zip(sizes, random_dtypes(n))]
        args = (0.05, 1e-10 if trial % 2 else 1e-3, trial % 2, 1e-2 * (trial % 3))
        a = [[t.clone() for t in ps], [t.clone() for t in hs]]
        b = [[t.clone() for t in ps], [t.clone() for t in hs]]
        ops.multi_tensor_adagrad(gs, *a, flag("cuda"), *args)
        reference.multi_tensor_adagrad(gs, *b, flag("cuda"), *args)
        for u, v in zip(a[0] + a[1], b[0] + b[1]):
            atol, rtol = TOLERANCES[u.dtype]
            torch.testing.assert_close(u, v, atol=atol, rtol=rtol)
