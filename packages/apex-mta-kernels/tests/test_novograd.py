"""multi_tensor_novograd: the op, its reference, its CUDA kernel and the legacy amp_C entry point.

The oracle is a plain float64 loop of apex's NovoGrad, written here: per-tensor norms from
torch.linalg.vector_norm, blended into the running norms, then the update (mode 0 with the
weight decay inside the moment, mode 1 decoupled).
"""

import math

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, TOLERANCES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]
HYPER = {"lr": 1e-2, "beta1": 0.95, "beta2": 0.98, "eps": 1e-8, "weight_decay": 1e-3}


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def random_dtypes(n):
    return [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]


def apex_novograd(
    grads,
    params,
    moms,
    norms,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    bias_correction,
    grad_averaging,
    mode,
    norm_type,
):
    """apex's multi_tensor_novograd in float64: the new (params, moms, norms)."""
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    out_p, out_m, out_n = [], [], []
    for g, p, m, gn in zip(grads, params, moms, norms.double().tolist()):
        g, p, m = g.double(), p.double(), m.double()
        if norm_type == 2:
            n = torch.linalg.vector_norm(g).item()
            gn = math.sqrt(beta2 * gn * gn + (1 - beta2) * n * n)
        else:
            n = torch.linalg.vector_norm(g, float("inf")).item() if g.numel() else 0.0
            gn = beta2 * gn + (1 - beta2) * n
        denom = gn / bc2 + eps
        if mode == 0:
            g = g / denom + weight_decay * p
            m = beta1 * m + beta3 * g
            p = p - lr * m / bc1
        else:
            m = beta1 * m + beta3 * g
            p = p - lr * (m / bc1 / denom + weight_decay * p)
        out_p.append(p)
        out_m.append(m)
        out_n.append(gn)
    return out_p, out_m, torch.tensor(out_n, dtype=torch.float64)


def run_op(
    gs,
    ps,
    ms,
    noop,
    norms,
    step,
    *,
    bias_correction=True,
    grad_averaging=True,
    mode=0,
    norm_type=2,
    **hyper,
):
    h = {**HYPER, **hyper}
    ops.multi_tensor_novograd(
        gs,
        ps,
        ms,
        noop,
        norms,
        h["lr"],
        h["beta1"],
        h["beta2"],
        h["eps"],
        step,
        bias_correction,
        h["weight_decay"],
        grad_averaging,
        mode,
        norm_type,
    )


def assert_close(actual, expected):
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def assert_norms(norms, expected):
    torch.testing.assert_close(norms.double(), expected.to(norms.device), atol=1e-6, rtol=2e-5)


def lists(sizes, dg, dp, dm, device):
    gs = [rand(n, dg, device) for n in sizes]
    ps = [rand(n, dp, device) for n in sizes]
    ms = [rand(n, dm, device) * 0.1 for n in sizes]
    return gs, ps, ms


VARIANTS = [  # (mode, norm_type, bias_correction, grad_averaging)
    (0, 2, True, True),
    (1, 2, True, True),
    (0, 0, True, False),
    (1, 0, False, True),
    (1, 2, False, False),
]


# ---- one step ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_novograd_one_step_matches_apex_loop(device, dtype, variant, strict_kernels):
    mode, norm_type, bc, ga = variant
    gs, ps, ms = lists(SIZES, dtype, dtype, dtype, device)
    norms = torch.rand(len(SIZES), device=device) * 100
    kw = dict(step=3, bias_correction=bc, grad_averaging=ga, mode=mode, norm_type=norm_type)
    want_p, want_m, want_n = apex_novograd(gs, ps, ms, norms, **HYPER, **kw)
    noop = flag(device)
    run_op(gs, ps, ms, noop, norms, **kw)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "dg,dp,dm",
    [
        (torch.float16, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float16),
        (torch.float16, torch.float16, torch.float32),
    ],
)
def test_novograd_mixed_roles(device, dg, dp, dm, strict_kernels):
    gs, ps, ms = lists(SIZES, dg, dp, dm, device)
    norms = torch.rand(len(SIZES), device=device)
    want_p, want_m, want_n = apex_novograd(
        gs,
        ps,
        ms,
        norms,
        **HYPER,
        step=1,
        bias_correction=True,
        grad_averaging=True,
        mode=1,
        norm_type=2,
    )
    run_op(gs, ps, ms, flag(device), norms, 1, mode=1)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd_mixed_dtype_lists_use_each_tensors_own_norm(device, norm_type, strict_kernels):
    # Interleaved dtypes put each dtype group's positions far apart, and grads whose magnitudes
    # differ by 10x per position make a norm read from the wrong position visible.
    n = 14
    dts = [DTYPES[(i * 7) % 3] for i in range(n)]
    sizes = [500 + 977 * i for i in range(n)]
    gs = [
        (rand(s, torch.float32, device) * 10.0 ** (i % 5 - 2)).to(d)
        for i, (s, d) in enumerate(zip(sizes, dts))
    ]
    ps = [rand(s, dts[(i + 1) % n], device) for i, s in enumerate(sizes)]
    ms = [rand(s, dts[(i + 2) % n], device) for i, s in enumerate(sizes)]
    norms = torch.rand(n, device=device)
    kw = dict(step=2, bias_correction=True, grad_averaging=True, mode=0, norm_type=norm_type)
    want_p, want_m, want_n = apex_novograd(gs, ps, ms, norms, **HYPER, **kw)
    run_op(gs, ps, ms, flag(device), norms, **kw)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd_many_small_zero_size_and_channels_last(device, norm_type, strict_kernels):
    sizes = [int(s) for s in torch.randint(1, 300, (1200,))]
    sizes[3] = sizes[700] = 0  # zero-size grads: their running norm blends with a zero norm
    gs, ps, ms = lists(sizes, torch.float32, torch.float32, torch.float32, device)
    shape = (3, 5, 7, 11)
    cl = lambda: rand(0, torch.float16, device, shape).to(memory_format=torch.channels_last)  # noqa: E731
    gs.append(cl())
    ps.append(cl())
    ms.append(cl())
    norms = torch.rand(len(gs), device=device) + 0.5
    kw = dict(step=5, bias_correction=True, grad_averaging=False, mode=1, norm_type=norm_type)
    want_p, want_m, want_n = apex_novograd(gs, ps, ms, norms, **HYPER, **kw)
    run_op(gs, ps, ms, flag(device), norms, **kw)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd_norm_of_a_tensor_over_many_chunks(device, norm_type, strict_kernels):
    sizes = [40 * 65536 + 3, 5]
    gs, ps, ms = lists(sizes, torch.bfloat16, torch.float32, torch.float32, device)
    gs[0][123_457] = 50.0  # the largest magnitude, deep inside one chunk
    norms = torch.zeros(2, device=device)
    kw = dict(step=1, bias_correction=True, grad_averaging=True, mode=0, norm_type=norm_type)
    want_p, want_m, want_n = apex_novograd(gs, ps, ms, norms, **HYPER, **kw)
    run_op(gs, ps, ms, flag(device), norms, **kw)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)


# ---- many steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("norm_type", [2, 0])
def test_novograd_matches_apex_loop_over_30_steps(device, mode, norm_type, strict_kernels):
    sizes = [3, 4099, 65537]
    ps = [rand(n, torch.float32, device) for n in sizes]
    ms = [torch.zeros_like(p) for p in ps]
    want_p = [p.double() for p in ps]
    want_m = [m.double() for m in ms]
    norms = want_n = None
    for step in range(1, 31):
        gs = [rand(n, torch.float32, device) for n in sizes]
        if norms is None:  # FusedNovoGrad starts the running norms at the first step's norms
            ord_ = 2 if norm_type == 2 else float("inf")
            norms = torch.stack([torch.linalg.vector_norm(g, ord_) for g in gs])
            want_n = norms.double().cpu()
        kw = dict(
            step=step, bias_correction=True, grad_averaging=True, mode=mode, norm_type=norm_type
        )
        want_p, want_m, want_n = apex_novograd(gs, want_p, want_m, want_n, **HYPER, **kw)
        run_op(gs, ps, ms, flag(device), norms, **kw)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        torch.testing.assert_close(p, wp.float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(m, wm.float(), atol=1e-5, rtol=1e-4)


# ---- the noop flag: set on a non-finite norm, never read ----------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_novograd_nonfinite_grad_sets_the_flag_and_still_steps(
    device, norm_type, bad, strict_kernels
):
    gs, ps, ms = lists([10, 70000], torch.float16, torch.float32, torch.float32, device)
    gs[1][69999] = bad
    norms = torch.ones(2, device=device)
    noop = flag(device)
    want_p, _, _ = apex_novograd(
        gs[:1],
        ps[:1],
        ms[:1],
        norms[:1],
        **HYPER,
        step=1,
        bias_correction=True,
        grad_averaging=True,
        mode=0,
        norm_type=norm_type,
    )
    run_op(gs, ps, ms, noop, norms, 1, norm_type=norm_type)
    assert noop.item() == 1
    assert torch.isfinite(norms[0]) and not torch.isfinite(norms[1])
    assert_close(ps[0], want_p[0])  # the finite tensor still stepped
    assert not torch.isfinite(ps[1]).all()  # and the bad one propagated, as in apex
    gs[1][69999] = 1.0
    run_op(gs, ps, ms, noop, torch.ones(2, device=device), 2, norm_type=norm_type)
    assert noop.item() == 1  # never cleared


@pytest.mark.parametrize("device", devices())
def test_novograd_does_not_skip_when_the_flag_is_set(device, strict_kernels):
    gs, ps, ms = lists([33, 65537], torch.float32, torch.float32, torch.float32, device)
    norms = torch.rand(2, device=device)
    want_p, want_m, want_n = apex_novograd(
        gs,
        ps,
        ms,
        norms,
        **HYPER,
        step=4,
        bias_correction=True,
        grad_averaging=True,
        mode=1,
        norm_type=2,
    )
    noop = flag(device, 1)
    run_op(gs, ps, ms, noop, norms, 4, mode=1)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)
    assert noop.item() == 1


@pytest.mark.parametrize("device", devices())
def test_novograd_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    run_op([], [], [], noop, torch.zeros(0, device=device), 1)
    assert noop.item() == 0


# ---- bad input ----------------------------------------------------------------------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    n2 = lambda: torch.ones(2, device=device)  # noqa: E731
    return [
        (
            "lengths",
            [x(), x()],
            [x()],
            [x(), x()],
            n2(),
            {},
            ValueError,
            "params has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            "norms dtype",
            [x(), x()],
            [x(), x()],
            [x(), x()],
            n2().double(),
            {},
            TypeError,
            "grad_norms must be a float32 tensor, got torch.float64",
        ),
        (
            "norms count",
            [x(), x()],
            [x(), x()],
            [x(), x()],
            torch.ones(3, device=device),
            {},
            ValueError,
            "grad_norms has 3 elements but grads has 2 tensors",
        ),
        (
            "norms layout",
            [x(), x()],
            [x(), x()],
            [x(), x()],
            torch.ones(4, device=device)[::2],
            {},
            ValueError,
            "grad_norms is not contiguous",
        ),
        (
            "mode",
            [x()],
            [x()],
            [x()],
            n2()[:1],
            {"mode": 2},
            ValueError,
            "moment_mode must be 0 \\(weight decay inside the moment\\) or 1 \\(decoupled\\), got 2",
        ),
        (
            "norm type",
            [x()],
            [x()],
            [x()],
            n2()[:1],
            {"norm_type": 1},
            ValueError,
            "norm_type must be 2 \\(L2\\) or 0 \\(Linf\\), got 1",
        ),
        (
            "step",
            [x()],
            [x()],
            [x()],
            n2()[:1],
            {"step": 0},
            ValueError,
            "step must be >= 1 when bias_correction is set, got 0",
        ),
        (
            "dtype",
            [x()],
            [x(8, torch.float64)],
            [x()],
            n2()[:1],
            {},
            TypeError,
            "params\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(8))
def test_novograd_bad_input(device, case, strict_kernels):
    name, gs, ps, ms, norms, kw, exc, words = _bad_cases(device)[case]
    kw = {"step": 1, **kw}
    before = [t.clone() for t in ps + ms + [norms]]
    with pytest.raises(exc, match=words):
        run_op(gs, ps, ms, flag(device), norms, **kw)
    for t, b in zip(ps + ms + [norms], before):
        assert torch.equal(t, b), name
    # without bias correction, step 0 is fine
    if name == "step":
        run_op(gs, ps, ms, flag(device), norms, 0, bias_correction=False)


@pytest.mark.cuda
def test_novograd_norms_on_another_device_refused(strict_kernels):
    g = [torch.randn(8, device="cuda")]
    with pytest.raises(ValueError, match="grad_norms is on cpu but noop_flag is on cuda:0"):
        run_op(g, [g[0].clone()], [g[0].clone()], flag("cuda"), torch.ones(1), 1)


# ---- legacy amp_C --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_novograd(device, strict_kernels):
    gs, ps, ms = lists([3, 65537], torch.float16, torch.float16, torch.float16, device)
    norms = torch.rand(2, device=device)
    h = HYPER
    want_p, want_m, want_n = apex_novograd(
        gs,
        ps,
        ms,
        norms,
        **h,
        step=2,
        bias_correction=True,
        grad_averaging=False,
        mode=1,
        norm_type=0,
    )
    noop = flag(device)
    assert (
        amp_C.multi_tensor_novograd(
            2048 * 32,
            noop,
            [gs, ps, ms],
            norms,
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["eps"],
            2,
            1,
            h["weight_decay"],
            0,
            1,
            0,
        )
        is None
    )
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)
    with pytest.raises(ValueError, match="tensor_lists must hold 3 lists, got 2"):
        amp_C.multi_tensor_novograd(
            2048 * 32, noop, [gs, ps], norms, 1e-3, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 0, 2
        )


# ---- the op contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_novograd_opcheck(device, strict_kernels):
    gs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    ps = [rand(n, torch.float32, device) for n in (5, 70000, 1)]
    ms = [torch.randn_like(p) for p in ps]
    norms = torch.rand(3, device=device)
    args = (gs, ps, ms, flag(device), norms, 1e-3, 0.9, 0.99, 1e-8, 2, True, 1e-3, True, 0, 2)
    opcheck(torch.ops.apex_mta.multi_tensor_novograd.default, args)


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_novograd_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def step(gs, ps, ms, noop, norms):
        run_op(gs, ps, ms, noop, norms, 3)
        return norms * 2

    gs, ps, ms = lists([17, 65539], torch.bfloat16, torch.float32, torch.float32, device)
    norms = torch.rand(2, device=device)
    want_p, want_m, want_n = apex_novograd(
        gs,
        ps,
        ms,
        norms,
        **HYPER,
        step=3,
        bias_correction=True,
        grad_averaging=True,
        mode=0,
        norm_type=2,
    )
    y = step(gs, ps, ms, flag(device), norms)
    assert_norms(norms, want_n)
    for p, m, wp, wm in zip(ps, ms, want_p, want_m):
        assert_close(p, wp)
        assert_close(m, wm)
    torch.testing.assert_close(y, norms * 2)


# ---- CUDA against the reference ------------------------------------------------------------------


@pytest.mark.cuda
def test_novograd_cuda_matches_reference_on_random_lists(strict_kernels):
    for trial in range(8):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 300_000, (n,)).tolist()
        gs = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        ps = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        ms = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        norms = torch.rand(n, device="cuda") * 10
        mode, norm_type, bc, ga = VARIANTS[trial % len(VARIANTS)]
        h = HYPER
        args = (
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["eps"],
            1 + trial,
            bc,
            h["weight_decay"],
            ga,
            mode,
            norm_type,
        )
        a = [[t.clone() for t in ps], [t.clone() for t in ms], norms.clone()]
        b = [[t.clone() for t in ps], [t.clone() for t in ms], norms.clone()]
        fa, fb = flag("cuda"), flag("cuda")
        ops.multi_tensor_novograd(gs, a[0], a[1], fa, a[2], *args)
        reference.multi_tensor_novograd(gs, b[0], b[1], fb, b[2], *args)
        torch.testing.assert_close(a[2], b[2], atol=1e-6, rtol=1e-5)
        for u, v in zip(a[0] + a[1], b[0] + b[1]):
            atol, rtol = TOLERANCES[u.dtype]
            torch.testing.assert_close(u, v, atol=atol, rtol=rtol)
        assert fa.item() == fb.item() == 0


@pytest.mark.cuda
def test_novograd_cuda_is_deterministic(strict_kernels):
    gs, ps, ms = lists(
        [7, 5 * 65536 + 1, 20 * 65536], torch.float32, torch.float32, torch.float32, "cuda"
    )
    results = []
    for _ in range(3):
        p2, m2, n2 = [p.clone() for p in ps], [m.clone() for m in ms], torch.ones(3, device="cuda")
        run_op(gs, p2, m2, flag("cuda"), n2, 1)
        results.append((n2, p2))
    for n2, p2 in results[1:]:
        assert torch.equal(n2, results[0][0])
        for u, v in zip(p2, results[0][1]):
            assert torch.equal(u, v)
