"""multi_tensor_adam, multi_tensor_adam_capturable and multi_tensor_adam_capturable_master: the
ops, their references, the CUDA kernels and the legacy amp_C entry points.

The oracle is torch.optim.Adam / AdamW in its plain for-loop form (foreach=False), run side by
side with the op for many steps; bias_correction off (which torch lacks) is checked against a
float64 loop written out below.
"""

import itertools
import math

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, TOLERANCES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BETAS = (0.9, 0.999)
EPS = 1e-8
# After tens of float32 steps the op and torch.optim differ by rounding only, but it compounds.
STEPS_TOL = {"atol": 2e-6, "rtol": 2e-5}


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def scalar(value, device, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype, device=device)


def state(sizes, device, dg=F32, dp=F32, dm=F32, dv=F32, zero_moments=False):
    """Random grads and params; random moments (v >= 0) unless ``zero_moments``."""
    g = [torch.randn(n, device=device).to(dg) for n in sizes]
    p = [torch.randn(n, device=device).to(dp) for n in sizes]
    if zero_moments:
        m = [torch.zeros(n, device=device, dtype=dm) for n in sizes]
        v = [torch.zeros(n, device=device, dtype=dv) for n in sizes]
    else:
        m = [(0.1 * torch.randn(n, device=device)).to(dm) for n in sizes]
        v = [(0.01 * torch.rand(n, device=device)).to(dv) for n in sizes]
    return g, p, m, v


def clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


def assert_lists_close(got, want, **tol):
    for i, (a, b) in enumerate(zip(got, want)):
        kw = tol or dict(zip(("atol", "rtol"), TOLERANCES[a.dtype]))
        torch.testing.assert_close(a, b.to(a.dtype), msg=lambda m, i=i: f"tensor {i}: {m}", **kw)


def torch_optimizer(params, mode, lr, weight_decay):
    cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    return cls(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)


def seed_torch_state(opt, params, m, v, step):
    """Start torch's optimizer from our moments, as if ``step`` steps had been taken."""
    for p, mi, vi in zip(params, m, v):
        opt.state[p] = {
            "step": torch.tensor(float(step)),
            "exp_avg": mi.float().clone(),
            "exp_avg_sq": vi.float().clone(),
        }


# ---- against torch.optim, many steps ------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_matches_torch_optim_over_many_steps(device, mode, weight_decay, strict_kernels):
    g, p, m, v = state(SIZES, device, zero_moments=True)
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch_optimizer(ref, mode, 3e-3, weight_decay)
    noop = flag(device)
    for step in range(1, 61):
        grads = [torch.randn_like(t) for t in p]
        ops.multi_tensor_adam(
            grads, p, m, v, noop, 3e-3, *BETAS, EPS, step, mode, True, weight_decay
        )
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        opt.step()
    assert_lists_close(p, [r.detach() for r in ref], **STEPS_TOL)
    assert_lists_close(m, [opt.state[r]["exp_avg"] for r in ref], **STEPS_TOL)
    assert_lists_close(v, [opt.state[r]["exp_avg_sq"] for r in ref], **STEPS_TOL)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("step_dtype", [torch.int32, torch.int64, torch.float32])
def test_adam_capturable_matches_torch_optim_over_many_steps(
    device, mode, step_dtype, strict_kernels
):
    """Scaled grads, an lr schedule and skipped (overflowing) steps, all as device tensors."""
    sizes = SIZES[:6]
    _, p, m, v = state(sizes, device, zero_moments=True)
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch_optimizer(ref, mode, 1e-2, 0.02)
    lr, step = scalar(1e-2, device), torch.zeros(1, dtype=step_dtype, device=device)
    loss_scale = 1024.0  # a power of two: scaling and unscaling are exact
    inv_scale = scalar(1 / loss_scale, device)
    for k in range(50):
        if k == 25:
            lr.fill_(4e-3)
            opt.param_groups[0]["lr"] = 4e-3
        overflow = k in (3, 17)
        grads = [torch.randn_like(t) for t in p]
        scaled = [gr * loss_scale for gr in grads]
        if overflow:
            scaled[1][0] = float("inf")
        before = clone([scaled, p, m, v])
        noop = flag(device, int(overflow))
        step += int(not overflow)  # FusedAdam: step += (noop != 1)
        ops.multi_tensor_adam_capturable(
            scaled, p, m, v, noop, lr, *BETAS, EPS, step, mode, True, 0.02, inv_scale
        )
        if overflow:  # nothing written, grads left scaled
            for got, want in zip([scaled, p, m, v], before):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert noop.item() == 1
            continue
        for s, gr in zip(scaled, grads):  # unscaled in place
            assert torch.equal(s, gr)
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        opt.step()
    assert_lists_close(p, [r.detach() for r in ref], **STEPS_TOL)
    assert_lists_close(m, [opt.state[r]["exp_avg"] for r in ref], **STEPS_TOL)
    assert_lists_close(v, [opt.state[r]["exp_avg_sq"] for r in ref], **STEPS_TOL)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dp", [F16, BF16])
def test_adam_capturable_master_matches_torch_optim_over_many_steps(device, dp, strict_kernels):
    """Low-precision params, float32 masters and moments: the masters follow torch.optim.AdamW
    in float32 and the params are the masters rounded, every step."""
    sizes = SIZES[:6]
    _, p, m, v = state(sizes, device, dp=dp, zero_moments=True)
    master = [t.float() for t in p]
    ref = [t.clone().requires_grad_() for t in master]
    opt = torch_optimizer(ref, 1, 1e-3, 0.01)
    lr, step, inv_scale = scalar(1e-3, device), flag(device), scalar(0.25, device)
    for _ in range(40):
        grads = [torch.randn(n, device=device).to(dp) for n in sizes]
        scaled = [(gr.float() * 4).to(dp) for gr in grads]
        step += 1
        ops.multi_tensor_adam_capturable_master(
            scaled, p, m, v, master, flag(device), lr, *BETAS, EPS, step, 1, True, 0.01, inv_scale
        )
        for s, gr in zip(scaled, grads):
            assert torch.equal(s, gr)
        for w, pi in zip(master, p):
            assert torch.equal(pi, w.to(dp))
        for r, gr in zip(ref, grads):
            r.grad = gr.float()
        opt.step()
    assert_lists_close(master, [r.detach() for r in ref], **STEPS_TOL)
    assert_lists_close(m, [opt.state[r]["exp_avg"] for r in ref], **STEPS_TOL)
    assert_lists_close(v, [opt.state[r]["exp_avg_sq"] for r in ref], **STEPS_TOL)


def float64_adam(g, p, m, v, lr, wd, mode, bc1=1.0, bc2=1.0):
    """The textbook step in float64 (apex's formula), for the cases torch.optim lacks."""
    g, p, m, v = (t.double() for t in (g, p, m, v))
    if mode == 0:
        g = g + wd * p
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    update = (m / bc1) / ((v / bc2).sqrt() + EPS)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("capturable", [False, True])
def test_adam_without_bias_correction(device, mode, capturable, strict_kernels):
    _, p, m, v = state(SIZES, device)
    want = [(pi.double(), mi.double(), vi.double()) for pi, mi, vi in zip(p, m, v)]
    for step in range(1, 21):
        grads = [torch.randn_like(t) for t in p]
        if capturable:
            ops.multi_tensor_adam_capturable(
                grads,
                p,
                m,
                v,
                flag(device),
                scalar(2e-3, device),
                *BETAS,
                EPS,
                scalar(step, device, torch.int32),
                mode,
                False,
                0.1,
                scalar(1.0, device),
            )
        else:
            ops.multi_tensor_adam(
                grads, p, m, v, flag(device), 2e-3, *BETAS, EPS, step, mode, False, 0.1
            )
        want = [float64_adam(gr, *w, 2e-3, 0.1, mode) for gr, w in zip(grads, want)]
    for got, w in zip(zip(p, m, v), want):
        assert_lists_close(got, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", devices())
def test_adam_bias_correction_matches_float64_formula_at_late_step(device, strict_kernels):
    """Step 1000 with random moments: the host bias corrections and the device ones agree with
    1 - beta**step in float64."""
    g, p, m, v = state([4099, 65537], device)
    a, b = clone([g, p, m, v]), clone([g, p, m, v])
    bc1, bc2 = 1 - BETAS[0] ** 1000, 1 - BETAS[1] ** 1000
    want = [float64_adam(*t, 1e-3, 0.01, 1, bc1, bc2) for t in zip(g, p, m, v)]
    ops.multi_tensor_adam(*a, flag(device), 1e-3, *BETAS, EPS, 1000, 1, True, 0.01)
    ops.multi_tensor_adam_capturable(
        *b,
        flag(device),
        scalar(1e-3, device),
        *BETAS,
        EPS,
        scalar(1000, device, torch.int64),
        1,
        True,
        0.01,
        scalar(1.0, device),
    )
    for lists in (a, b):
        for got, w in zip(zip(*lists[1:]), want):
            assert_lists_close(got, w, atol=1e-6, rtol=1e-5)


# ---- dtypes, sizes, layouts (reference and kernel against float32 math) -------------------------


def one_step_oracle(g, p, m, v, mode, step=7, lr=1e-2, wd=0.1):
    """torch.optim's float32 for-loop step from our state, results rounded to our dtypes."""
    ref = [t.float().clone().requires_grad_() for t in p]
    opt = torch_optimizer(ref, mode, lr, wd)
    seed_torch_state(opt, ref, m, v, step - 1)
    for r, gr in zip(ref, g):
        r.grad = gr.float()
    opt.step()
    return (
        [r.detach() for r in ref],
        [opt.state[r]["exp_avg"] for r in ref],
        [opt.state[r]["exp_avg_sq"] for r in ref],
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg,dp", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("moments", ["fp32", "param"])
def test_adam_dtypes_one_step_against_torch_optim(device, dg, dp, moments, strict_kernels):
    dm = F32 if moments == "fp32" else dp
    g, p, m, v = state(SIZES, device, dg, dp, dm, dm)
    want = one_step_oracle(g, p, m, v, mode=1)
    ops.multi_tensor_adam(g, p, m, v, flag(device), 1e-2, *BETAS, EPS, 7, 1, True, 0.1)
    for got, w in zip((p, m, v), want):
        assert_lists_close(got, w)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dm,dv", [(F32, BF16), (F16, F32), (BF16, F16)])
def test_adam_moments_of_different_dtypes(device, dm, dv, strict_kernels):
    """m and v need not share a dtype (the kernel's generic path)."""
    g, p, m, v = state(SIZES[:5], device, BF16, BF16, dm, dv)
    want = one_step_oracle(g, p, m, v, mode=0)
    ops.multi_tensor_adam(g, p, m, v, flag(device), 1e-2, *BETAS, EPS, 7, 0, True, 0.1)
    for got, w in zip((p, m, v), want):
        assert_lists_close(got, w)


@pytest.mark.parametrize("device", devices())
def test_adam_mixed_dtype_lists_are_grouped(device, strict_kernels):
    combos = list(itertools.product(DTYPES, DTYPES, [F32, BF16]))
    lists = [[], [], [], []]
    for i, (dg, dp, dmv) in enumerate(combos):
        for lst, t in zip(lists, state([1000 + 37 * i], device, dg, dp, dmv, dmv)):
            lst.extend(t)
    singles = clone(lists)
    ops.multi_tensor_adam(*lists, flag(device), 1e-2, *BETAS, EPS, 3, 1, True, 0.1)
    for i in range(len(combos)):
        one = [[lst[i]] for lst in singles]
        reference.multi_tensor_adam(*one, flag(device), 1e-2, *BETAS, EPS, 3, 1, True, 0.1)
        for k in (1, 2, 3):
            tol = dict(zip(("atol", "rtol"), TOLERANCES[lists[k][i].dtype]))
            torch.testing.assert_close(lists[k][i], one[k][0], **tol)


@pytest.mark.parametrize("device", devices())
def test_adam_many_small_and_zero_size_tensors(device, strict_kernels):
    sizes = torch.randint(0, 300, (1500,)).tolist()
    sizes[3] = sizes[700] = 0
    g, p, m, v = state(sizes, device)
    want = one_step_oracle(g, p, m, v, mode=0)
    ops.multi_tensor_adam(g, p, m, v, flag(device), 1e-2, *BETAS, EPS, 7, 0, True, 0.1)
    for got, w in zip((p, m, v), want):
        assert_lists_close(got, w)
    assert p[3].numel() == 0


@pytest.mark.parametrize("device", devices())
def test_adam_channels_last(device, strict_kernels):
    g, p, m, v = (
        [torch.randn(3, 5, 7, 11, device=device).to(memory_format=torch.channels_last)]
        for _ in range(4)
    )
    v[0] = v[0].abs()
    want = one_step_oracle(g, p, m, v, mode=1)
    ops.multi_tensor_adam(g, p, m, v, flag(device), 1e-2, *BETAS, EPS, 7, 1, True, 0.1)
    assert p[0].is_contiguous(memory_format=torch.channels_last)
    for got, w in zip((p, m, v), want):
        assert_lists_close(got, w)


@pytest.mark.parametrize("device", devices())
def test_adam_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    ops.multi_tensor_adam([], [], [], [], noop, 1e-3, *BETAS, EPS, 1, 1, True, 0.0)
    ops.multi_tensor_adam_capturable(
        [],
        [],
        [],
        [],
        noop,
        scalar(1e-3, device),
        *BETAS,
        EPS,
        flag(device, 1),
        1,
        True,
        0.0,
        scalar(1.0, device),
    )
    assert noop.item() == 0


# ---- the noop flag --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_adam_ignores_the_flag_and_propagates_nonfinite_grads(device, strict_kernels):
    """Apex semantics: multi_tensor_adam neither reads nor sets the flag."""
    g, p, m, v = state([10, 70000], device)
    g[1][69999] = float("inf")
    for value in (0, 1):
        noop = flag(device, value)
        ops.multi_tensor_adam(g, p, m, v, noop, 1e-3, *BETAS, EPS, 2, 1, True, 0.0)
        assert noop.item() == value
    assert torch.isnan(p[1][69999]) and torch.isinf(v[1][69999])
    assert torch.isfinite(p[1][:69999]).all() and torch.isfinite(p[0]).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable_skips_everything_when_flag_set(device, master, strict_kernels):
    lists = list(state([10, 70000], device, dp=BF16 if master else F32))
    if master:
        lists.append([t.float() + 0.5 for t in lists[1]])
    before = clone(lists)
    noop = flag(device, 1)
    op = ops.multi_tensor_adam_capturable_master if master else ops.multi_tensor_adam_capturable
    op(
        *lists,
        noop,
        scalar(1e-3, device),
        *BETAS,
        EPS,
        flag(device, 5),
        1,
        True,
        0.01,
        scalar(0.5, device),
    )
    for got, want in zip(lists, before):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert noop.item() == 1  # read, never cleared


# ---- bad input: a clear exception before any kernel runs, nothing written ----------------------


def _bad_cases(device):
    def good():
        return list(state([8, 9], device))

    def with_(i, j, t):
        lists = good()
        lists[i][j] = t
        return lists

    x = lambda n=8, dt=F32: torch.randn(n, device=device).to(dt)  # noqa: E731
    return [
        # (lists, scalar overrides, exception, words)
        (
            [*good()[:3], [x()]],
            {},
            ValueError,
            "exp_avg_sqs has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            with_(2, 1, x(10)),
            {},
            ValueError,
            "exp_avgs\\[1\\] has 10 elements but grads\\[1\\] has 9",
        ),
        (
            with_(1, 0, x(8, torch.float64)),
            {},
            TypeError,
            "params\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            with_(3, 0, torch.randn(4, 2, device=device).t()),
            {},
            ValueError,
            "exp_avg_sqs\\[0\\] is not contiguous",
        ),
        (
            good(),
            {"noop_flag": torch.zeros(1, device=device)},
            TypeError,
            "noop_flag must be an int32 tensor, got torch.float32",
        ),
        (
            good(),
            {"mode": 2},
            ValueError,
            "adam_w_mode must be 0 \\(L2 weight decay\\) or 1 \\(decoupled, AdamW\\), got 2",
        ),
        (good(), {"beta2": 1.5}, ValueError, "beta2 must be in \\[0, 1\\), got 1.5"),
        (good(), {"beta1": -0.1}, ValueError, "beta1 must be in \\[0, 1\\), got -0.1"),
    ]


def _call(variant, lists, device, **over):
    kw = {"noop_flag": flag(device), "beta1": BETAS[0], "beta2": BETAS[1], "mode": 1, **over}
    common = (kw["beta1"], kw["beta2"], EPS)
    if variant == "adam":
        return ops.multi_tensor_adam(
            *lists, kw["noop_flag"], 1e-3, *common, kw.get("step", 1), kw["mode"], True, 0.0
        )
    lr = kw.get("lr", scalar(1e-3, device))
    step = kw.get("step", flag(device, 1))
    inv = kw.get("inv_scale", scalar(1.0, device))
    if variant == "capturable":
        return ops.multi_tensor_adam_capturable(
            *lists, kw["noop_flag"], lr, *common, step, kw["mode"], True, 0.0, inv
        )
    masters = kw.get("masters", [p.float() for p in lists[1]])
    return ops.multi_tensor_adam_capturable_master(
        *lists, masters, kw["noop_flag"], lr, *common, step, kw["mode"], True, 0.0, inv
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("variant", ["adam", "capturable", "master"])
@pytest.mark.parametrize("case", range(8))
def test_adam_bad_input(device, variant, case, strict_kernels):
    lists, over, exc, words = _bad_cases(device)[case]
    op = {
        "adam": "multi_tensor_adam",
        "capturable": "multi_tensor_adam_capturable",
        "master": "multi_tensor_adam_capturable_master",
    }[variant]
    before = clone(lists)
    with pytest.raises(exc, match=f"{op}: {words}"):
        _call(variant, lists, device, **over)
    for got, want in zip(lists, before):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def _bad_scalar_cases(device):
    return [
        (
            {"lr": scalar(1e-3, device, torch.int32)},
            TypeError,
            "lr has dtype torch.int32; supported: float32, float64",
        ),
        (
            {"lr": torch.full((2,), 1e-3, device=device)},
            ValueError,
            "lr must have exactly one element, got 2",
        ),
        (
            {"step": scalar(1, device, torch.float16)},
            TypeError,
            "step has dtype torch.float16; supported: int32, int64, float32, float64",
        ),
        (
            {"inv_scale": torch.ones((), device=device, dtype=torch.bfloat16)},
            TypeError,
            "inv_scale has dtype torch.bfloat16; supported: float32, float64",
        ),
        (
            {"inv_scale": torch.ones(0, device=device)},
            ValueError,
            "inv_scale must have exactly one element, got 0",
        ),
        (
            {"masters": [torch.randn(8, device=device), torch.randn(10, device=device)]},
            ValueError,
            "master_params\\[1\\] has 10 elements but grads\\[1\\] has 9",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(6))
def test_adam_capturable_bad_scalars(device, case, strict_kernels):
    over, exc, words = _bad_scalar_cases(device)[case]
    lists = list(state([8, 9], device))
    before = clone(lists)
    variants = ["master"] if "masters" in over else ["capturable", "master"]
    for variant in variants:
        with pytest.raises(exc, match=words):
            _call(variant, lists, device, **over)
    for got, want in zip(lists, before):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices())
def test_adam_step_zero_with_bias_correction_refused(device, strict_kernels):
    lists = list(state([8], device))
    with pytest.raises(
        ValueError, match="multi_tensor_adam: step must be >= 1 when bias_correction is set, got 0"
    ):
        _call("adam", lists, device, step=0)
    ops.multi_tensor_adam(*lists, flag(device), 1e-3, *BETAS, EPS, 0, 1, False, 0.0)  # fine


@pytest.mark.cuda
def test_adam_mixed_devices_refused(strict_kernels):
    lists = list(state([8], "cuda"))
    with pytest.raises(ValueError, match="lr is on cpu but noop_flag is on cuda:0"):
        _call("capturable", lists, "cuda", lr=scalar(1e-3, "cpu"))
    with pytest.raises(ValueError, match="step is on cpu but noop_flag is on cuda:0"):
        _call("master", lists, "cuda", step=flag("cpu", 1))
    lists[1][0] = lists[1][0].cpu()
    with pytest.raises(ValueError, match="params\\[0\\] is on cpu but noop_flag is on cuda:0"):
        _call("adam", lists, "cuda")


# ---- legacy amp_C --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_adam(device, strict_kernels):
    g, p, m, v = state([3, 65537], device, BF16, BF16)
    a, b = clone([g, p, m, v]), clone([g, p, m, v])
    noop = torch.zeros((1, 1), dtype=torch.int32, device=device)
    assert amp_C.multi_tensor_adam(65536, noop, a, 1e-3, 0.9, 0.999, 1e-8, 4, 1, 1, 0.01) is None
    reference.multi_tensor_adam(*b, noop, 1e-3, 0.9, 0.999, 1e-8, 4, 1, True, 0.01)
    for x, y in zip(a, b):
        assert_lists_close(x, y)
    with pytest.raises(
        ValueError, match="multi_tensor_adam: tensor_lists must hold 4 lists, got 3"
    ):
        amp_C.multi_tensor_adam(65536, noop, a[:3], 1e-3, 0.9, 0.999, 1e-8, 4, 1, 1, 0.01)


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_adam_capturable_and_master(device, strict_kernels):
    g, p, m, v = state([3, 65537], device, BF16, BF16)
    w = [t.float() for t in p]
    lr, step, inv = scalar(1e-3, device), flag(device, 2), scalar(0.5, device)
    a, b = clone([g, p, m, v, w]), clone([g, p, m, v, w])
    noop = flag(device)
    amp_C.multi_tensor_adam_capturable(
        65536, noop, a[:4], lr, 0.9, 0.999, 1e-8, step, 0, 1, 0.01, inv
    )
    reference.multi_tensor_adam_capturable(
        *b[:4], noop, lr, 0.9, 0.999, 1e-8, step, 0, True, 0.01, inv
    )
    a2, b2 = clone([g, p, m, v, w]), clone([g, p, m, v, w])
    amp_C.multi_tensor_adam_capturable_master(
        65536, noop, a2, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, inv
    )
    reference.multi_tensor_adam_capturable_master(
        *b2[:4], b2[4], noop, lr, 0.9, 0.999, 1e-8, step, 1, True, 0.01, inv
    )
    for x, y in zip(a + a2, b + b2):
        assert_lists_close(x, y)
    with pytest.raises(ValueError, match="tensor_lists must hold 5 lists, got 4"):
        amp_C.multi_tensor_adam_capturable_master(
            65536, noop, a2[:4], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, inv
        )


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


@pytest.mark.parametrize("device", devices())
def test_adam_opcheck(device, strict_kernels):
    g, p, m, v = state([5, 70000, 1], device, BF16, BF16)
    opcheck(
        torch.ops.apex_mta.multi_tensor_adam.default,
        (g, p, m, v, flag(device), 1e-3, *BETAS, EPS, 3, 1, True, 0.01),
    )
    lr, step, inv = scalar(1e-3, device), flag(device, 3), scalar(0.5, device)
    opcheck(
        torch.ops.apex_mta.multi_tensor_adam_capturable.default,
        (g, p, m, v, flag(device), lr, *BETAS, EPS, step, 0, True, 0.01, inv),
    )
    w = [t.float() for t in p]
    opcheck(
        torch.ops.apex_mta.multi_tensor_adam_capturable_master.default,
        (g, p, m, v, w, flag(device), lr, *BETAS, EPS, step, 1, True, 0.01, inv),
    )


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_adam_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def train_step(g, p, m, v, w, noop, lr, step, inv):
        ops.multi_tensor_adam(g, p, m, v, noop, 1e-3, *BETAS, EPS, 2, 1, True, 0.01)
        step.add_(1)
        ops.multi_tensor_adam_capturable_master(
            g, p, m, v, w, noop, lr, *BETAS, EPS, step, 1, True, 0.01, inv
        )
        return p[0].float().sum()

    g, p, m, v = state([17, 65539], device, BF16, BF16)
    w = [t.float() for t in p]
    lr, step, inv = scalar(1e-3, device), flag(device, 1), scalar(1.0, device)
    want = clone([g, p, m, v, w])
    reference.multi_tensor_adam(*want[:4], flag(device), 1e-3, *BETAS, EPS, 2, 1, True, 0.01)
    reference.multi_tensor_adam_capturable_master(
        *want, flag(device), lr, *BETAS, EPS, flag(device, 2), 1, True, 0.01, inv
    )
    total = train_step(g, p, m, v, w, flag(device), lr, step, inv)
    for got, w_ in zip([g, p, m, v, w], want):
        assert_lists_close(got, w_)
    assert step.item() == 2
    torch.testing.assert_close(total, p[0].float().sum())


@pytest.mark.cuda
@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable_in_cuda_graph_with_new_lr_and_step(master, strict_kernels):
    sizes = [100, 65536 * 2 + 1, 4099]
    lists = list(state(sizes, "cuda", BF16 if master else F32, BF16 if master else F32))
    if master:
        lists.append([t.float() for t in lists[1]])
    lr, step, inv = scalar(1e-3, "cuda"), flag("cuda", 1), scalar(0.25, "cuda")
    noop = flag("cuda")
    op = ops.multi_tensor_adam_capturable_master if master else ops.multi_tensor_adam_capturable
    ref_op = (
        reference.multi_tensor_adam_capturable_master
        if master
        else reference.multi_tensor_adam_capturable
    )
    op(*clone(lists), noop, lr, *BETAS, EPS, step, 1, True, 0.01, inv)  # load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*lists, noop, lr, *BETAS, EPS, step, 1, True, 0.01, inv)
    for k, (new_lr, overflow) in enumerate([(1e-3, 0), (5e-4, 0), (5e-4, 1), (2e-4, 0)]):
        for gr in lists[0]:
            gr.copy_(torch.randn_like(gr, dtype=torch.float32) * 4)
        lr.fill_(new_lr)
        step.fill_(k + 1)
        noop.fill_(overflow)
        want = clone(lists)
        ref_op(*want, noop, lr, *BETAS, EPS, step, 1, True, 0.01, inv)
        graph.replay()
        for got, w in zip(lists, want):
            assert_lists_close(got, w)
        if overflow:
            assert all(torch.equal(a, b) for a, b in zip(lists[1], want[1]))


# ---- CUDA against the reference ------------------------------------------------------------------

MOMENT_DTYPES = list(itertools.product(DTYPES, DTYPES))


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["adam", "capturable", "master"])
@pytest.mark.parametrize("dg,dp", list(itertools.product(DTYPES, DTYPES)))
def test_adam_cuda_matches_reference_for_every_dtype_mix(variant, dg, dp, strict_kernels):
    """Every (m, v) dtype pair (and master dtype) under every (g, p): the fast path's
    instantiations and the generic path alike."""
    sizes = [1, 7, 4099, 65536, 65537, 3 * 65536 + 13]
    masters = DTYPES if variant == "master" else [None]
    for (dm, dv), dw in itertools.product(MOMENT_DTYPES, masters):
        lists = list(state(sizes, "cuda", dg, dp, dm, dv))
        if dw is not None:
            lists.append([torch.randn(n, device="cuda").to(dw) for n in sizes])
        a, b = clone(lists), clone(lists)
        lr, step, inv = scalar(1e-2, "cuda"), flag("cuda", 3), scalar(0.5, "cuda")
        if variant == "adam":
            ops.multi_tensor_adam(*a, flag("cuda"), 1e-2, *BETAS, EPS, 3, 0, True, 0.1)
            reference.multi_tensor_adam(*b, flag("cuda"), 1e-2, *BETAS, EPS, 3, 0, True, 0.1)
        else:
            op = "multi_tensor_adam_capturable" + ("_master" if dw is not None else "")
            getattr(ops, op)(*a, flag("cuda"), lr, *BETAS, EPS, step, 1, True, 0.1, inv)
            getattr(reference, op)(*b, flag("cuda"), lr, *BETAS, EPS, step, 1, True, 0.1, inv)
        for k, (x, y) in enumerate(zip(a, b)):
            try:
                assert_lists_close(x, y)
            except AssertionError as e:
                raise AssertionError(f"m {dm}, v {dv}, master {dw}, list {k}: {e}") from None


@pytest.mark.cuda
@pytest.mark.parametrize("capturable", [False, True])
def test_adam_cuda_matches_reference_on_random_lists(capturable, strict_kernels):
    for _ in range(5):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        dts = [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]
        lists = [[], [], [], []]
        for s, d in zip(sizes, dts):
            for lst, t in zip(lists, state([s], "cuda", d, d, F32, F32)):
                lst.extend(t)
        a, b = clone(lists), clone(lists)
        if capturable:
            args = (
                scalar(3e-3, "cuda"),
                *BETAS,
                EPS,
                scalar(9.0, "cuda"),
                0,
                True,
                0.05,
                scalar(0.125, "cuda"),
            )
            ops.multi_tensor_adam_capturable(*a, flag("cuda"), *args)
            reference.multi_tensor_adam_capturable(*b, flag("cuda"), *args)
        else:
            ops.multi_tensor_adam(*a, flag("cuda"), 3e-3, *BETAS, EPS, 9, 1, True, 0.05)
            reference.multi_tensor_adam(*b, flag("cuda"), 3e-3, *BETAS, EPS, 9, 1, True, 0.05)
        for x, y in zip(a, b):
            assert_lists_close(x, y)


def unaligned(t):
    """A copy of ``t`` starting one element into its storage: not 16-byte aligned."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return out.copy_(t)


@pytest.mark.cuda
@pytest.mark.parametrize("dp", [F32, BF16])
def test_adam_cuda_unaligned_tensors_take_the_scalar_path(dp, strict_kernels):
    lists = list(state([5, 4099, 65537], "cuda", dp, dp))
    a = [[unaligned(t) for t in lst] for lst in lists]
    assert all(t.data_ptr() % 16 for t in a[0])
    ops.multi_tensor_adam(*a, flag("cuda"), 1e-2, *BETAS, EPS, 5, 1, True, 0.1)
    reference.multi_tensor_adam(*lists, flag("cuda"), 1e-2, *BETAS, EPS, 5, 1, True, 0.1)
    for x, y in zip(a, lists):
        assert_lists_close(x, y)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_adam_over_2_pow_31_elements(strict_kernels):
    """bf16 grads and params, fp32 moments, one tensor of 2^31 + 17 elements (about 26 GB)."""
    n = 2**31 + 17
    g = torch.empty(n, dtype=BF16, device="cuda").uniform_(-1, 1)
    p = torch.empty(n, dtype=BF16, device="cuda").uniform_(-1, 1)
    m = torch.empty(n, dtype=F32, device="cuda").uniform_(-0.1, 0.1)
    v = torch.empty(n, dtype=F32, device="cuda").uniform_(0, 0.01)
    ends = (slice(0, 1 << 20), slice(2**31 - (1 << 20), n))  # both sides of the 32-bit edge
    want = [[t[sl].clone() for sl in ends] for t in (g, p, m, v)]
    ops.multi_tensor_adam([g], [p], [m], [v], flag("cuda"), 1e-2, *BETAS, EPS, 4, 1, True, 0.1)
    reference.multi_tensor_adam(*want, flag("cuda"), 1e-2, *BETAS, EPS, 4, 1, True, 0.1)
    for t, w in zip((p, m, v), want[1:]):
        assert_lists_close([t[sl] for sl in ends], w)
    assert not math.isnan(float(p[-1]))
