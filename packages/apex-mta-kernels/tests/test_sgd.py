"""multi_tensor_sgd: the op, its reference, its CUDA kernel and the legacy amp_C entry point.

Oracles: torch.optim.SGD (foreach=False) where apex's semantics are torch's (scale 1, weight
decay before the momentum, the first run initialising the buffer to the gradient), and a plain
float64 loop of apex's formula, written here, for everything else.
"""

import itertools

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, TOLERANCES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]

# (weight_decay, momentum, dampening, nesterov, wd_after_momentum, scale)
CONFIGS = {
    "plain": (0.0, 0.0, 0.0, False, False, 1.0),
    "wd": (1e-2, 0.0, 0.0, False, False, 1.0),
    "momentum": (0.0, 0.9, 0.0, False, False, 1.0),
    "momentum-dampening-wd": (1e-2, 0.9, 0.1, False, False, 1.0),
    "nesterov-wd": (1e-2, 0.9, 0.0, True, False, 1.0),
    "wd-after-momentum": (5e-2, 0.8, 0.0, False, True, 1.0),
    "nesterov-wd-after-scaled": (5e-2, 0.8, 0.0, True, True, 1.0 / 1024),
    "dampening-scaled": (1e-3, 0.5, 0.3, False, False, 0.25),
}
TORCH_CONFIGS = [k for k, c in CONFIGS.items() if not c[4] and c[5] == 1.0]


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def random_dtypes(n):
    return [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]


def apex_sgd(g, w, m, cfg, lr, first_run):
    """apex's multi_tensor_sgd on one tensor, in float64: the new (weight, momentum)."""
    wd, momentum, dampening, nesterov, wd_after, scale = cfg
    g, w, m = g.double() * scale, w.double(), m.double()
    if wd != 0 and not wd_after:
        g = g + wd * w
    if momentum != 0:
        m = g if first_run else momentum * m + (1 - dampening) * g
        g = g + momentum * m if nesterov else m
    if wd != 0 and wd_after:
        g = g + wd * w
    return w - lr * g, m


def run_op(gs, ws, ms, cs, cfg, lr, first_run, noop):
    wd, momentum, dampening, nesterov, wd_after, scale = cfg
    ops.multi_tensor_sgd(
        gs, ws, ms, cs, noop, wd, momentum, dampening, lr, nesterov, first_run, wd_after, scale
    )


def assert_close(actual, expected, dtype=None):
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---- against torch.optim.SGD and the float64 loop, many steps -----------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("config", TORCH_CONFIGS)
def test_sgd_matches_torch_optim_sgd_over_50_steps(device, config, strict_kernels):
    wd, momentum, dampening, nesterov, _, _ = CONFIGS[config]
    sizes = [1, 97, 4099, 65537]
    theirs = [torch.nn.Parameter(rand(n, torch.float32, device)) for n in sizes]
    ours = [p.detach().clone() for p in theirs]
    moms = [torch.empty_like(p) for p in ours]
    opt = torch.optim.SGD(
        theirs,
        lr=0.05,
        momentum=momentum,
        dampening=dampening,
        weight_decay=wd,
        nesterov=nesterov,
        foreach=False,
    )
    noop = flag(device)
    for step in range(50):
        grads = [rand(n, torch.float32, device) for n in sizes]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        run_op(grads, ours, moms, [], CONFIGS[config], 0.05, step == 0, noop)
    for p, w, m in zip(theirs, ours, moms):
        torch.testing.assert_close(w, p.detach(), atol=1e-5, rtol=1e-5)
        if momentum != 0:
            torch.testing.assert_close(m, opt.state[p]["momentum_buffer"], atol=1e-5, rtol=1e-5)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sgd_matches_apex_formula_over_30_steps(device, config, strict_kernels):
    cfg = CONFIGS[config]
    sizes = [3, 4099, 65537]
    ws = [rand(n, torch.float32, device) for n in sizes]
    ms = [torch.empty_like(w) for w in ws]
    want_w = [w.double() for w in ws]
    want_m = [torch.zeros_like(w) for w in want_w]
    for step in range(30):
        gs = [rand(n, torch.float32, device) for n in sizes]
        run_op(gs, ws, ms, None, cfg, 0.02, step == 0, flag(device))
        for i, g in enumerate(gs):
            want_w[i], want_m[i] = apex_sgd(g, want_w[i], want_m[i], cfg, 0.02, step == 0)
    for w, m, ww, wm in zip(ws, ms, want_w, want_m):
        torch.testing.assert_close(w, ww.float(), atol=1e-5, rtol=1e-5)
        if cfg[1] != 0:
            torch.testing.assert_close(m, wm.float(), atol=1e-5, rtol=1e-5)


# ---- one step: dtypes, the copy, grouping, sizes -------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg,dw,dm", list(itertools.product(DTYPES, repeat=3)))
def test_sgd_one_step_every_dtype_combination(device, dg, dw, dm, strict_kernels):
    cfg = CONFIGS["nesterov-wd-after-scaled"][:3] + (True, False, 0.5)
    gs = [rand(n, dg, device) for n in SIZES]
    ws = [rand(n, dw, device) for n in SIZES]
    ms = [rand(n, dm, device) for n in SIZES]
    want = [apex_sgd(g, w, m, cfg, 0.1, False) for g, w, m in zip(gs, ws, ms)]
    run_op(gs, ws, ms, [], cfg, 0.1, False, flag(device))
    for w, m, (ww, wm) in zip(ws, ms, want):
        assert_close(w, ww)
        assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("first_run", [False, True])
def test_sgd_one_step_every_config(device, config, first_run, strict_kernels):
    cfg = CONFIGS[config]
    for dtype in (torch.float32, torch.bfloat16):
        gs = [rand(n, dtype, device) for n in SIZES]
        ws = [rand(n, dtype, device) for n in SIZES]
        ms = [rand(n, dtype, device) for n in SIZES]
        want = [apex_sgd(g, w, m, cfg, 0.1, first_run) for g, w, m in zip(gs, ws, ms)]
        run_op(gs, ws, ms, [], cfg, 0.1, first_run, flag(device))
        for w, m, (ww, wm) in zip(ws, ms, want):
            assert_close(w, ww)
            if cfg[1] != 0:
                assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dw", DTYPES)
@pytest.mark.parametrize("dc", DTYPES)
def test_sgd_four_lists_write_the_updated_weights_into_the_copy(device, dw, dc, strict_kernels):
    cfg = CONFIGS["momentum-dampening-wd"]
    dg = torch.float16 if dw == torch.float32 else dw  # amp O2: fp16 grads, fp32 master weights
    gs = [rand(n, dg, device) for n in SIZES]
    ws = [rand(n, dw, device) for n in SIZES]
    ms = [rand(n, dw, device) for n in SIZES]
    cs = [torch.full((n,), float("nan"), dtype=dc, device=device) for n in SIZES]  # poisoned
    want = [apex_sgd(g, w, m, cfg, 0.1, False) for g, w, m in zip(gs, ws, ms)]
    run_op(gs, ws, ms, cs, cfg, 0.1, False, flag(device))
    for w, m, c, (ww, wm) in zip(ws, ms, cs, want):
        assert_close(w, ww)
        assert_close(m, wm)
        assert torch.equal(c, w.to(dc))  # the copy is the stored weight, rounded once more


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("four", [False, True])
def test_sgd_mixed_dtype_lists_are_grouped(device, four, strict_kernels):
    cfg = CONFIGS["nesterov-wd"]
    n = 12
    sizes = [1000 + 37 * i for i in range(n)]
    gs = [rand(s, d, device) for s, d in zip(sizes, random_dtypes(n))]
    ws = [rand(s, d, device) for s, d in zip(sizes, random_dtypes(n))]
    ms = [rand(s, d, device) for s, d in zip(sizes, random_dtypes(n))]
    cs = (
        [torch.empty(s, dtype=d, device=device) for s, d in zip(sizes, random_dtypes(n))]
        if four
        else []
    )
    want = [apex_sgd(g, w, m, cfg, 0.1, False) for g, w, m in zip(gs, ws, ms)]
    run_op(gs, ws, ms, cs, cfg, 0.1, False, flag(device))
    for i, (w, m, (ww, wm)) in enumerate(zip(ws, ms, want)):
        assert_close(w, ww)
        assert_close(m, wm)
        if four:
            assert torch.equal(cs[i], w.to(cs[i].dtype))


@pytest.mark.parametrize("device", devices())
def test_sgd_many_small_zero_size_and_channels_last(device, strict_kernels):
    cfg = CONFIGS["momentum-dampening-wd"]
    sizes = [int(n) for n in torch.randint(0, 300, (1500,))] + [0, 0]
    gs = [rand(n, torch.float32, device) for n in sizes]
    ws = [rand(n, torch.float32, device) for n in sizes]
    ms = [rand(n, torch.float32, device) for n in sizes]
    shape = (3, 5, 7, 11)
    cl = lambda: rand(0, torch.bfloat16, device, shape).to(memory_format=torch.channels_last)  # noqa: E731
    gs.append(cl())
    ws.append(cl())
    ms.append(cl())
    want = [apex_sgd(g, w, m, cfg, 0.1, False) for g, w, m in zip(gs, ws, ms)]
    run_op(gs, ws, ms, [], cfg, 0.1, False, flag(device))
    for w, m, (ww, wm) in zip(ws, ms, want):
        assert_close(w, ww)
        assert_close(m, wm)
    assert ws[-1].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", devices())
def test_sgd_first_run_does_not_read_the_momenta(device, strict_kernels):
    cfg = CONFIGS["momentum-dampening-wd"]
    gs = [rand(n, torch.float32, device) for n in SIZES]
    ws = [rand(n, torch.float32, device) for n in SIZES]
    ms = [torch.full((n,), float("nan"), device=device) for n in SIZES]  # never initialised
    want = [apex_sgd(g, w, torch.zeros_like(w), cfg, 0.1, True) for g, w in zip(gs, ws)]
    run_op(gs, ws, ms, [], cfg, 0.1, True, flag(device))
    for w, m, (ww, wm) in zip(ws, ms, want):
        assert_close(w, ww)
        assert_close(m, wm)


@pytest.mark.parametrize("device", devices())
def test_sgd_without_momentum_leaves_the_momenta_alone(device, strict_kernels):
    gs = [rand(n, torch.float16, device) for n in SIZES]
    ws = [rand(n, torch.float16, device) for n in SIZES]
    ms = [torch.full((n,), float("nan"), dtype=torch.float16, device=device) for n in SIZES]
    before = [m.clone() for m in ms]
    want = [apex_sgd(g, w, m, CONFIGS["wd"], 0.1, False) for g, w, m in zip(gs, ws, ms)]
    run_op(gs, ws, ms, [], CONFIGS["wd"], 0.1, False, flag(device))
    for w, m, b, (ww, _) in zip(ws, ms, before, want):
        assert_close(w, ww)
        assert same_bits(m, b)


# ---- the noop flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("four", [False, True])
@pytest.mark.parametrize("first_run", [False, True])
def test_sgd_noop_flag_set_leaves_everything_untouched(device, four, first_run, strict_kernels):
    sizes = SIZES + [0]
    gs = [rand(n, torch.float16, device) for n in sizes]
    ws = [rand(n, torch.float32, device) for n in sizes]
    ms = [rand(n, torch.float32, device) for n in sizes]
    cs = [rand(n, torch.bfloat16, device) for n in sizes] if four else []
    before = [t.clone() for t in gs + ws + ms + cs]
    noop = torch.ones((1, 1), dtype=torch.int32, device=device)  # fairseq's (1, 1) shape
    run_op(gs, ws, ms, cs, CONFIGS["nesterov-wd-after-scaled"], 0.1, first_run, noop)
    for t, b in zip(gs + ws + ms + cs, before):
        assert same_bits(t, b)
    assert noop.item() == 1


@pytest.mark.parametrize("device", devices())
def test_sgd_reads_only_the_first_flag_element(device, strict_kernels):
    ws = [rand(n, torch.float32, device) for n in (5, 70000)]
    gs = [torch.randn_like(w) for w in ws]
    ms = [torch.randn_like(w) for w in ws]
    want = [apex_sgd(g, w, m, CONFIGS["momentum"], 0.1, False) for g, w, m in zip(gs, ws, ms)]
    noop = torch.tensor([0, 1, 1], dtype=torch.int32, device=device)
    run_op(gs, ws, ms, [], CONFIGS["momentum"], 0.1, False, noop)
    for w, (ww, _) in zip(ws, want):
        assert_close(w, ww)


@pytest.mark.parametrize("device", devices())
def test_sgd_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    run_op([], [], [], [], CONFIGS["momentum"], 0.1, False, noop)
    assert noop.item() == 0


# ---- bad input: a clear exception before any kernel runs, nothing written -----------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    return [
        (
            "lengths",
            [x(), x()],
            [x()],
            [x(), x()],
            [],
            flag(device),
            ValueError,
            "weights has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            "copy lengths",
            [x()],
            [x()],
            [x()],
            [x(), x()],
            flag(device),
            ValueError,
            "model_weights has 2 tensors but grads has 1; the lists must be the same length",
        ),
        (
            "sizes",
            [x(8)],
            [x(8)],
            [x(9)],
            [],
            flag(device),
            ValueError,
            "momenta\\[0\\] has 9 elements but grads\\[0\\] has 8",
        ),
        (
            "copy dtype",
            [x()],
            [x()],
            [x()],
            [x(8, torch.float64)],
            flag(device),
            TypeError,
            "model_weights\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            "noop dtype",
            [x()],
            [x()],
            [x()],
            [],
            torch.zeros(1, device=device),
            TypeError,
            "noop_flag must be an int32 tensor, got torch.float32",
        ),
        (
            "non-contiguous",
            [x(24).view(4, 6).t()],
            [x(24).view(6, 4)],
            [x(24).view(6, 4)],
            [],
            flag(device),
            ValueError,
            "grads\\[0\\] is not contiguous",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(6))
def test_sgd_bad_input(device, case, strict_kernels):
    name, gs, ws, ms, cs, noop, exc, words = _bad_cases(device)[case]
    before = [t.clone() for t in ws + ms + cs]
    with pytest.raises(exc, match=words):
        run_op(gs, ws, ms, cs, CONFIGS["momentum"], 0.1, False, noop)
    for t, b in zip(ws + ms + cs, before):
        assert same_bits(t, b), name


@pytest.mark.cuda
def test_sgd_mixed_devices_refused(strict_kernels):
    cuda = [torch.randn(8, device="cuda")]
    with pytest.raises(ValueError, match="momenta\\[0\\] is on cpu but noop_flag is on cuda:0"):
        run_op(
            cuda,
            [cuda[0].clone()],
            [torch.randn(8)],
            [],
            CONFIGS["momentum"],
            0.1,
            False,
            flag("cuda"),
        )


# ---- legacy amp_C --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_sgd(device, strict_kernels):
    cfg = CONFIGS["wd-after-momentum"]
    wd, momentum, dampening, nesterov, wd_after, _ = cfg
    gs = [rand(n, torch.float16, device) for n in (3, 65537)]
    ws = [rand(n, torch.float32, device) for n in (3, 65537)]
    ms = [rand(n, torch.float32, device) for n in (3, 65537)]
    cs = [torch.empty(n, dtype=torch.float16, device=device) for n in (3, 65537)]
    want = [apex_sgd(g, w, m, cfg[:5] + (0.5,), 0.1, False) for g, w, m in zip(gs, ws, ms)]
    noop = flag(device)
    assert (
        amp_C.multi_tensor_sgd(
            2048 * 32,
            noop,
            [gs, ws, ms, cs],
            wd,
            momentum,
            dampening,
            0.1,
            nesterov,
            False,
            wd_after,
            0.5,
        )
        is None
    )
    for w, m, c, (ww, wm) in zip(ws, ms, cs, want):
        assert_close(w, ww)
        assert_close(m, wm)
        assert torch.equal(c, w.half())
    # the 3-list form, and apex releases before `scale` (it defaults to 1)
    want = [apex_sgd(g, w, m, cfg[:5] + (1.0,), 0.1, False) for g, w, m in zip(gs, ws, ms)]
    amp_C.multi_tensor_sgd(
        2048 * 32, noop, [gs, ws, ms], wd, momentum, dampening, 0.1, nesterov, False, wd_after
    )
    for w, m, (ww, wm) in zip(ws, ms, want):
        assert_close(w, ww)
        assert_close(m, wm)
    with pytest.raises(ValueError, match="tensor_lists must hold 3 or 4 lists, got 2"):
        amp_C.multi_tensor_sgd(
            2048 * 32, noop, [gs, ws], wd, momentum, dampening, 0.1, nesterov, False, wd_after, 1.0
        )


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("four", [False, True])
def test_sgd_opcheck(device, four, strict_kernels):
    gs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    ws = [rand(n, torch.float32, device) for n in (5, 70000, 1)]
    ms = [torch.randn_like(w) for w in ws]
    cs = [torch.empty_like(w, dtype=torch.bfloat16) for w in ws] if four else []
    args = (gs, ws, ms, cs, flag(device), 1e-2, 0.9, 0.0, 0.1, True, False, False, 0.5)
    opcheck(torch.ops.apex_mta.multi_tensor_sgd.default, args)


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_sgd_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"
    cfg = CONFIGS["nesterov-wd"]

    @torch.compile(fullgraph=True, backend=backend)
    def step(gs, ws, ms, noop):
        run_op(gs, ws, ms, [], cfg, 0.1, False, noop)
        return ws[0] * 2

    gs = [rand(n, torch.bfloat16, device) for n in (17, 65539)]
    ws = [rand(n, torch.float32, device) for n in (17, 65539)]
    ms = [torch.randn_like(w) for w in ws]
    want = [apex_sgd(g, w, m, cfg, 0.1, False) for g, w, m in zip(gs, ws, ms)]
    y = step(gs, ws, ms, flag(device))
    for w, m, (ww, wm) in zip(ws, ms, want):
        assert_close(w, ww)
        assert_close(m, wm)
    torch.testing.assert_close(y, ws[0] * 2)


@pytest.mark.cuda
def test_sgd_captured_in_cuda_graph_honours_the_flag_at_replay(strict_kernels):
    cfg = CONFIGS["momentum-dampening-wd"]
    gs = [rand(n, torch.float16, "cuda") for n in (100, 65536 * 2 + 1)]
    ws = [rand(n, torch.float32, "cuda") for n in (100, 65536 * 2 + 1)]
    ms = [torch.randn_like(w) for w in ws]
    cs = [torch.empty_like(w, dtype=torch.float16) for w in ws]
    noop = flag("cuda")
    run_op(gs, ws, ms, cs, cfg, 0.1, False, noop)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_op(gs, ws, ms, cs, cfg, 0.1, False, noop)
    noop.fill_(1)
    before = [t.clone() for t in ws + ms + cs]
    g.replay()
    for t, b in zip(ws + ms + cs, before):
        assert same_bits(t, b)
    noop.zero_()
    for x in gs:
        x.copy_(torch.randn_like(x))
    want = [apex_sgd(x, w, m, cfg, 0.1, False) for x, w, m in zip(gs, ws, ms)]
    g.replay()
    for w, m, c, (ww, wm) in zip(ws, ms, cs, want):
        assert_close(w, ww)
        assert_close(m, wm)
        assert torch.equal(c, w.half())


# ---- CUDA against the reference ------------------------------------------------------------------


@pytest.mark.cuda
def test_sgd_cuda_matches_reference_on_random_lists(strict_kernels):
    names = list(CONFIGS)
    for trial in range(8):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        gs = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        ws = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        ms = [rand(s, d, "cuda") for s, d in zip(sizes, random_dtypes(n))]
        cs = [torch.empty(s, dtype=d, device="cuda") for s, d in zip(sizes, random_dtypes(n))]
        cs = cs if trial % 2 else []
        wd, momentum, dampening, nesterov, wd_after, scale = CONFIGS[names[trial % len(names)]]
        first_run = trial % 3 == 0
        args = (wd, momentum, dampening, 0.05, nesterov, first_run, wd_after, scale)
        a = [[t.clone() for t in lst] for lst in (ws, ms, cs)]
        b = [[t.clone() for t in lst] for lst in (ws, ms, cs)]
        ops.multi_tensor_sgd(gs, *a, flag("cuda"), *args)
        reference.multi_tensor_sgd(gs, *b, flag("cuda"), *args)
        for role, (xa, xb) in enumerate(zip(a, b)):
            for i, (u, v) in enumerate(zip(xa, xb)):
                tol = TOLERANCES[u.dtype]
                if role == 2:  # a copy also carries the rounding of the weights it was made from
                    tol = max(tol, TOLERANCES[ws[i].dtype])
                torch.testing.assert_close(u, v, atol=tol[0], rtol=tol[1])


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_sgd_over_2_pow_31_elements(strict_kernels):
    n = 2**31 + 17
    cfg = CONFIGS["nesterov-wd-after-scaled"]
    g = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-4, 4)
    w = torch.empty(n, dtype=torch.float32, device="cuda").uniform_(-1, 1)
    m = torch.empty(n, dtype=torch.float32, device="cuda").uniform_(-1, 1)
    c = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
    ends = (slice(0, 1 << 20), slice(2**31 - (1 << 20), n))  # both sides of the 32-bit edge
    want = []
    for sl in ends:
        ww, wm, wc = w[sl].clone(), m[sl].clone(), c[sl].clone()
        reference.multi_tensor_sgd(
            [g[sl]], [ww], [wm], [wc], flag("cuda"), *cfg[:3], 0.1, cfg[3], False, cfg[4], cfg[5]
        )
        want.append((ww, wm, wc))
    run_op([g], [w], [m], [c], cfg, 0.1, False, flag("cuda"))
    for sl, (ww, wm, wc) in zip(ends, want):
        assert_close(w[sl], ww)
        assert_close(m[sl], wm)
        assert_close(c[sl], wc)
    assert not torch.isnan(c).any()
