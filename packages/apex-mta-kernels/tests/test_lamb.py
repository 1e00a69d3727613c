"""multi_tensor_lamb, multi_tensor_lamb_mp, multi_tensor_lamb_stage1 and multi_tensor_lamb_stage2:
the ops, their references, the CUDA kernels and the legacy amp_C entry points.

The oracle is apex's LAMB written out below as a plain float64 loop over the tensors: clipped
global grad norm, moments, bias corrections, L2 or decoupled weight decay, the update stored in
the grad's dtype, and the trust ratio lr * ||p|| / ||u|| under apex's conditions.
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
EPS = 1e-6
LR = 1e-2
# fp32 op against the float64 oracle after several steps: rounding only, compounded.
STEPS_TOL = {"atol": 1e-5, "rtol": 1e-5}
# The global grad norm given to the op, and a max_grad_norm that clips it or not.
GNORM = 5.0
MAX_NORM = {"clip": 2.0, "no clip": 10.0}


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def scalar(value, device, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype, device=device)


def state(sizes, device, dg=F32, dp=F32, dm=F32, dv=F32):
    """Random grads, params and moments (v >= 0)."""
    g = [torch.randn(n, device=device).to(dg) for n in sizes]
    p = [torch.randn(n, device=device).to(dp) for n in sizes]
    m = [(0.1 * torch.randn(n, device=device)).to(dm) for n in sizes]
    v = [(0.01 * torch.rand(n, device=device)).to(dv) for n in sizes]
    return g, p, m, v


def clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


def tol(dtype):
    return dict(zip(("atol", "rtol"), TOLERANCES[dtype]))


def assert_lists_close(got, want, **kw):
    for i, (a, b) in enumerate(zip(got, want)):
        t = kw or tol(a.dtype)
        torch.testing.assert_close(a, b.to(a.dtype), msg=lambda m, i=i: f"tensor {i}: {m}", **t)


def assert_stepped_close(got, want, before, stepped=(1, 4)):
    """Lists [g, p, m, v, (model copy or update)] of one fused step from ``before``, op against
    reference. The update passes through the grad's dtype on its way to the params: where the
    op's and the reference's fp32 updates round to neighbouring 16-bit values, the params
    differ by one ulp of the grad dtype on the step, so lists ``stepped`` get p_tolerance."""
    for k, (x, y) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(x, y)):
            t = p_tolerance(before[k][i], b, before[0][i]) if k in stepped else tol(a.dtype)
            try:
                torch.testing.assert_close(a, b.to(a.dtype), **t)
            except AssertionError as e:
                raise AssertionError(f"list {k}, tensor {i}: {e}") from None


def assert_unchanged(lists, before):
    for k, (got, want) in enumerate(zip(lists, before)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"list {k}, tensor {i} was written"


# ---- the oracle: apex's formulas in float64 ------------------------------------------------------


def oracle_stage1(
    g,
    p,
    m,
    v,
    *,
    step,
    wd,
    mode,
    gnorm,
    max_norm,
    bias_correction=True,
    grad_averaging=True,
    inv_scale=1.0,
    update_dtype=None,
):
    """Stage 1 for one tensor: (update, m, v) in float64, the update rounded to ``update_dtype``
    (apex stores it in the grad, or in stage 1's update list)."""
    b1, b2 = BETAS
    clip = gnorm / max_norm if gnorm > max_norm else 1.0
    b3 = 1.0 - b1 if grad_averaging else 1.0
    bc1 = 1.0 - b1**step if bias_correction else 1.0
    bc2 = 1.0 - b2**step if bias_correction else 1.0
    gd, pd, md, vd = (t.double() for t in (g, p, m, v))
    sg = gd * inv_scale / clip
    if mode == 0 and wd != 0:
        sg = sg + wd * pd
    md = md * b1 + b3 * sg
    vd = vd * b2 + (1.0 - b2) * sg * sg
    upd = (md / bc1) / ((vd / bc2).sqrt() + EPS)
    if mode == 1 and wd != 0:
        upd = upd + wd * pd
    return upd.to(update_dtype or g.dtype).double(), md, vd


def oracle_stage2(p, upd, *, lr, wd, nvlamb, p_norm=None, u_norm=None):
    pd = p.double()
    pn = pd.norm() if p_norm is None else float(p_norm)
    un = upd.norm() if u_norm is None else float(u_norm)
    ratio = lr * pn / un if (nvlamb or wd != 0) and pn != 0 and un != 0 else lr
    return pd - ratio * upd


def oracle_lamb(g, p, m, v, *, lr=LR, nvlamb=False, wd=0.0, **kw):
    """A whole step over the lists: (new params, m, v, updates), float64."""
    out = ([], [], [], [])
    for gi, pi, mi, vi in zip(g, p, m, v):
        upd, md, vd = oracle_stage1(gi, pi, mi, vi, wd=wd, **kw)
        new_p = oracle_stage2(pi, upd, lr=lr, wd=wd, nvlamb=nvlamb)
        for lst, x in zip(out, (new_p, md, vd, upd)):
            lst.append(x)
    return out


def p_tolerance(p, want_p, g):
    """The params' tolerance: their dtype's, plus one ulp of the grad's dtype on the step (the
    update passes through the grad's dtype; the oracle rounds from float64, the op from fp32)."""
    atol, rtol = TOLERANCES[p.dtype]
    step = (want_p - p.double()).abs().max().item() if p.numel() else 0.0
    return {"atol": atol + 2 * torch.finfo(g.dtype).eps * step, "rtol": rtol}


def check_step(lists, before, want, **kw):
    """lists = the op's [g (now the update), p, m, v]; want = oracle_lamb's result."""
    g, p, m, v = lists
    new_p, new_m, new_v, upd = want
    assert_lists_close(g, upd, **kw)
    assert_lists_close(m, new_m, **kw)
    assert_lists_close(v, new_v, **kw)
    for i, (a, b, g0) in enumerate(zip(p, new_p, before[0])):
        t = kw or p_tolerance(before[1][i], b, g0)
        torch.testing.assert_close(a, b.to(a.dtype), msg=lambda msg, i=i: f"p {i}: {msg}", **t)


def lamb(
    lists,
    device,
    *,
    step,
    wd,
    mode,
    max_norm,
    nvlamb=False,
    bias_correction=True,
    grad_averaging=True,
    noop=None,
    gnorm=GNORM,
):
    ops.multi_tensor_lamb(
        *lists,
        flag(device) if noop is None else noop,
        LR,
        *BETAS,
        EPS,
        step,
        bias_correction,
        wd,
        grad_averaging,
        mode,
        scalar(gnorm, device),
        max_norm,
        nvlamb,
    )


# ---- multi_tensor_lamb against the oracle ----------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("nvlamb", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("clip", ["clip", "no clip"])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_float64_oracle_over_steps(
    device, mode, nvlamb, wd, clip, bias_correction, strict_kernels
):
    lists = list(state(SIZES, device))
    want_state = [[t.double() for t in lst] for lst in lists[1:]]  # p, m, v in float64
    for step in range(1, 6):
        lists[0] = [torch.randn_like(t) for t in lists[1]]
        grads = [t.clone() for t in lists[0]]
        lamb(
            lists,
            device,
            step=step,
            wd=wd,
            mode=mode,
            max_norm=MAX_NORM[clip],
            nvlamb=nvlamb,
            bias_correction=bias_correction,
        )
        want = oracle_lamb(
            grads,
            *want_state,
            step=step,
            wd=wd,
            mode=mode,
            gnorm=GNORM,
            max_norm=MAX_NORM[clip],
            nvlamb=nvlamb,
            bias_correction=bias_correction,
        )
        want_state = list(want[:3])
        assert_lists_close(lists[0], want[3], **STEPS_TOL)  # the update, written over the grads
    for got, w in zip(lists[1:], want_state):
        assert_lists_close(got, w, **STEPS_TOL)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg,dp", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("moments", ["fp32", "param"])
@pytest.mark.parametrize("mode", [0, 1])
def test_lamb_dtypes_one_step_against_oracle(device, dg, dp, moments, mode, strict_kernels):
    dm = F32 if moments == "fp32" else dp
    lists = list(state(SIZES[:6], device, dg, dp, dm, dm))
    before = clone(lists)
    want = oracle_lamb(*before, step=3, wd=0.05, mode=mode, gnorm=GNORM, max_norm=2.0)
    lamb(lists, device, step=3, wd=0.05, mode=mode, max_norm=2.0)
    check_step(lists, before, want)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dm,dv", [(F32, BF16), (F16, F32), (BF16, F16)])
def test_lamb_moments_of_different_dtypes(device, dm, dv, strict_kernels):
    """m and v need not share a dtype (the kernel's generic path)."""
    lists = list(state(SIZES[:5], device, BF16, F32, dm, dv))
    before = clone(lists)
    want = oracle_lamb(*before, step=2, wd=0.05, mode=0, gnorm=GNORM, max_norm=2.0, nvlamb=True)
    lamb(lists, device, step=2, wd=0.05, mode=0, max_norm=2.0, nvlamb=True)
    check_step(lists, before, want)


@pytest.mark.parametrize("device", devices())
def test_lamb_trust_ratio_rules(device, strict_kernels):
    """ratio = lr unless (use_nvlamb or wd != 0) and both norms are nonzero: a zero param tensor
    steps by lr * update, and with wd 0 and no nvlamb every tensor does."""
    lists = list(state([33, 4099], device))
    lists[1][0].zero_()
    for wd, nvlamb in [(0.05, False), (0.0, True), (0.0, False)]:
        a = clone(lists)
        lamb(a, device, step=4, wd=wd, mode=1, max_norm=10.0, nvlamb=nvlamb)
        # tensor 0: ||p|| == 0, so ratio = lr whatever the flags
        torch.testing.assert_close(a[1][0], lists[1][0] - LR * a[0][0])
        ratio = LR
        if wd != 0 or nvlamb:
            ratio = LR * lists[1][1].norm() / a[0][1].norm()
        torch.testing.assert_close(a[1][1], lists[1][1] - ratio * a[0][1])


@pytest.mark.parametrize("device", devices())
def test_lamb_without_weight_decay_does_not_read_params(device, strict_kernels):
    """wd 0: an inf param reaches neither m, v nor the update (apex skips reading p)."""
    lists = list(state([10, 4099], device))
    lists[1][1][17] = float("inf")
    noop = flag(device)
    lamb(lists, device, step=2, wd=0.0, mode=0, max_norm=10.0, noop=noop)
    for t in (lists[0][1], lists[2][1], lists[3][1]):
        assert torch.isfinite(t).all()
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
def test_lamb_ignores_the_flag_raises_it_and_propagates_nonfinite(device, strict_kernels):
    """Apex semantics: multi_tensor_lamb does not read the flag; a non-finite chunk of the update
    (or of p) sets it, as apex's norm kernels do, and the inf reaches the params."""
    lists = list(state([10, 70000], device))
    lists[0][1][69999] = float("inf")
    for value in (1, 0):
        a = clone(lists)
        noop = flag(device, value)
        lamb(a, device, step=2, wd=0.05, mode=1, max_norm=10.0, noop=noop)
        assert noop.item() == 1
        assert not torch.isfinite(a[1][1]).all()  # ratio = lr * ||p|| / inf = 0, then nan
        assert torch.isfinite(a[1][0]).all()


@pytest.mark.parametrize("device", devices())
def test_lamb_many_small_and_zero_size_tensors(device, strict_kernels):
    sizes = torch.randint(0, 300, (1500,)).tolist()
    sizes[3] = sizes[700] = 0
    lists = list(state(sizes, device))
    before = clone(lists)
    want = oracle_lamb(*before, step=7, wd=0.05, mode=0, gnorm=GNORM, max_norm=2.0)
    lamb(lists, device, step=7, wd=0.05, mode=0, max_norm=2.0)
    check_step(lists, before, want)
    assert lists[1][3].numel() == 0


@pytest.mark.parametrize("device", devices())
def test_lamb_mixed_dtype_lists_are_grouped(device, strict_kernels):
    combos = list(itertools.product(DTYPES, DTYPES, [F32, BF16]))
    lists = [[], [], [], []]
    for i, (dg, dp, dmv) in enumerate(combos):
        for lst, t in zip(lists, state([1000 + 37 * i], device, dg, dp, dmv, dmv)):
            lst.extend(t)
    singles, before = clone(lists), clone(lists)
    lamb(lists, device, step=3, wd=0.05, mode=1, max_norm=2.0)
    for i in range(len(combos)):
        one = [[lst[i]] for lst in singles]
        reference.multi_tensor_lamb(
            *one,
            flag(device),
            LR,
            *BETAS,
            EPS,
            3,
            True,
            0.05,
            True,
            1,
            scalar(GNORM, device),
            2.0,
            False,
        )
        assert_stepped_close([[lst[i]] for lst in lists], one, [[lst[i]] for lst in before])


@pytest.mark.parametrize("device", devices())
def test_lamb_channels_last(device, strict_kernels):
    lists = [
        [torch.randn(3, 5, 7, 11, device=device).to(memory_format=torch.channels_last)]
        for _ in range(4)
    ]
    lists[3][0] = lists[3][0].abs()
    before = clone(lists)
    want = oracle_lamb(*before, step=2, wd=0.05, mode=1, gnorm=GNORM, max_norm=2.0)
    lamb(lists, device, step=2, wd=0.05, mode=1, max_norm=2.0)
    assert lists[1][0].is_contiguous(memory_format=torch.channels_last)
    check_step(lists, before, want)


@pytest.mark.parametrize("device", devices())
def test_lamb_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    lamb([[], [], [], []], device, step=1, wd=0.05, mode=1, max_norm=1.0, noop=noop)
    lamb(
        [[torch.empty(0, device=device)] for _ in range(4)],
        device,
        step=1,
        wd=0.05,
        mode=1,
        max_norm=1.0,
        noop=noop,
    )
    ops.multi_tensor_lamb_mp([], [], [], [], [], noop, *mp_scalars(device))
    ops.multi_tensor_lamb_stage1(
        [],
        [],
        [],
        [],
        [],
        noop,
        torch.zeros(0, device=device),
        0,
        *BETAS,
        EPS,
        scalar(1.0, device),
        1.0,
    )
    ops.multi_tensor_lamb_stage2(
        [], [], noop, torch.zeros(0, device=device), torch.zeros(0, device=device), LR, 0.0
    )
    assert noop.item() == 0


# ---- stage 1 and stage 2 ---------------------------------------------------------------------------


def stage1(lists, updates, device, decay, step, max_norm=2.0, gnorm=GNORM):
    ops.multi_tensor_lamb_stage1(
        *lists, updates, flag(device), decay, step, *BETAS, EPS, scalar(gnorm, device), max_norm
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg,dp", [(F32, F32), (F16, F16), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("du", DTYPES)
def test_stage1_matches_oracle(device, dg, dp, du, strict_kernels):
    """Per-tensor decoupled decay (zero for some), bias corrections of step + 1."""
    lists = list(state(SIZES[:6], device, dg, dp, F32, F32))
    updates = [torch.full_like(t, float("nan"), dtype=du) for t in lists[0]]  # poisoned
    decay = torch.tensor([0.0, 0.01, 0.0, 0.1, 0.02, 0.0], device=device)
    before = clone(lists)
    stage1(lists, updates, device, decay, step=4)
    for i, (g, p, m, v) in enumerate(zip(*before)):
        upd, md, vd = oracle_stage1(
            g,
            p,
            m,
            v,
            step=5,
            wd=decay[i].item(),
            mode=1,
            gnorm=GNORM,
            max_norm=2.0,
            update_dtype=du,
        )
        assert_lists_close([updates[i], lists[2][i], lists[3][i]], [upd, md, vd])
    assert_unchanged(lists[:2], before[:2])  # grads and params are read only


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("nvlamb", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_stage2_matches_oracle(device, nvlamb, wd, strict_kernels):
    _, p, _, _ = state(SIZES[:6], device, dp=BF16)
    updates = [torch.randn(t.shape, device=device) for t in p]
    pn = torch.rand(len(p), device=device) * 10
    un = torch.rand(len(p), device=device) * 10
    pn[1] = 0.0
    un[2] = 0.0
    before = [t.clone() for t in p]
    ops.multi_tensor_lamb_stage2(p, updates, flag(device), pn, un, LR, wd, nvlamb)
    for i, (a, p0, u) in enumerate(zip(p, before, updates)):
        want = oracle_stage2(
            p0, u.double(), lr=LR, wd=wd, nvlamb=nvlamb, p_norm=pn[i], u_norm=un[i]
        )
        torch.testing.assert_close(a, want.to(a.dtype), **tol(a.dtype))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("nvlamb", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_stage1_then_stage2_equals_the_fused_op(device, nvlamb, wd, strict_kernels):
    """apex's stage 1 (step + 1) + the l2norm op + stage 2 is multi_tensor_lamb with decoupled
    decay, grad averaging and bias correction."""
    lists = list(state(SIZES, device))
    fused = clone(lists)
    staged = clone(lists)
    updates = [torch.empty_like(t) for t in lists[0]]
    decay = torch.full((len(SIZES),), wd, device=device)
    stage1(staged, updates, device, decay, step=6)
    noop = flag(device)
    _, pn = ops.multi_tensor_l2norm(staged[1], noop, True)
    _, un = ops.multi_tensor_l2norm(updates, noop, True)
    ops.multi_tensor_lamb_stage2(staged[1], updates, noop, pn, un, LR, wd, nvlamb)
    lamb(fused, device, step=7, wd=wd, mode=1, max_norm=2.0, nvlamb=nvlamb)
    assert_lists_close(updates, fused[0])
    for k in (1, 2, 3):
        assert_lists_close(staged[k], fused[k])


# ---- multi_tensor_lamb_mp ---------------------------------------------------------------------------


def mp_scalars(
    device,
    lr=LR,
    step=1,
    gnorm=GNORM,
    max_norm=2.0,
    found_inf=0.0,
    inv_scale=1.0,
    bias_correction=True,
    wd=0.05,
    mode=1,
    nvlamb=False,
):
    """The scalar arguments of multi_tensor_lamb_mp after noop_flag, as device tensors."""
    return (
        scalar(lr, device),
        *BETAS,
        EPS,
        flag(device, step),
        bias_correction,
        wd,
        True,
        mode,
        scalar(gnorm, device),
        scalar(max_norm, device),
        nvlamb,
        scalar(found_inf, device),
        scalar(inv_scale, device),
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dg", DTYPES)
@pytest.mark.parametrize("model", [None, F16, BF16])
@pytest.mark.parametrize("mode", [0, 1])
def test_lamb_mp_matches_oracle_over_steps_with_skips(device, dg, model, mode, strict_kernels):
    """Scaled grads, norms of the scaled grads, skipped steps (found_inf or the flag), and the
    5-list form's model copy; state compared with the float64 oracle every step (an fp32 state
    against the oracle's own float64 state; a 16-bit one, which rounds every step, against the
    oracle's step from the op's state)."""
    sizes = SIZES[:6]
    dp = F32 if model is not None or dg == F32 else dg
    g, p, m, v = state(sizes, device, dg, dp, dp, dp)
    model_params = [t.to(model) for t in p] if model is not None else []
    want_state = [[t.double() for t in lst] for lst in (p, m, v)]
    loss_scale = 1024.0  # a power of two: scaling and unscaling are exact
    step = 0
    for k in range(6):
        skip = {2: "found_inf", 4: "noop"}.get(k)
        grads = [torch.randn(n, device=device).to(dg) for n in sizes]
        g = [(t.float() * loss_scale).to(dg) for t in grads]
        step += skip is None  # FusedMixedPrecisionLamb: step += (overflow_buf != 1)
        lists = [g, p, m, v, model_params]
        before = clone(lists)
        noop = flag(device, int(skip == "noop"))
        ops.multi_tensor_lamb_mp(
            *lists,
            noop,
            *mp_scalars(
                device,
                step=step,
                gnorm=GNORM * loss_scale,
                max_norm=2.0 * loss_scale,
                found_inf=float(skip == "found_inf"),
                inv_scale=1 / loss_scale,
                mode=mode,
                nvlamb=True,
            ),
        )
        if skip:
            assert_unchanged(lists, before)
            assert noop.item() == int(skip == "noop")  # read, never cleared or set here
            continue
        assert noop.item() == 0
        if dp != F32:
            want_state = [[t.double() for t in lst] for lst in before[1:4]]
        new_p, new_m, new_v, upd = oracle_lamb(
            grads,
            *want_state,
            step=step,
            wd=0.05,
            mode=mode,
            gnorm=GNORM,
            max_norm=2.0,
            nvlamb=True,
        )
        want_state = [new_p, new_m, new_v]
        t = tol(dp) if dp != F32 else STEPS_TOL
        assert_lists_close(g, upd, **tol(dg))
        assert_lists_close(m, new_m, **t)
        assert_lists_close(v, new_v, **t)
        if dp == F32 and dg == F32:
            assert_lists_close(p, new_p, **STEPS_TOL)
        else:
            for i, (a, b) in enumerate(zip(p, new_p)):
                torch.testing.assert_close(a, b.to(a.dtype), **p_tolerance(before[1][i], b, g[i]))
        for w, pi in zip(model_params, p):
            assert torch.equal(w, pi.to(model))


@pytest.mark.parametrize("device", devices())
def test_lamb_mp_nonfinite_update_skips_stage2_and_raises_the_flag(device, strict_kernels):
    """An inf grad gives a non-finite update norm: the flag is set and the params (and the model
    copy) keep their values, as apex's mp norm kernel and stage 2 do; m, v and the grads hold
    stage 1's values."""
    lists = list(state([10, 70000], device, BF16, F32))
    lists.append([t.to(BF16) for t in lists[1]])
    lists[0][1][123] = float("inf")
    before = clone(lists)
    noop = flag(device)
    ops.multi_tensor_lamb_mp(*lists, noop, *mp_scalars(device, step=3))
    assert noop.item() == 1
    assert_unchanged([lists[1], lists[4]], [before[1], before[4]])
    assert not torch.equal(lists[2][0], before[2][0])  # stage 1 ran


@pytest.mark.parametrize("device", devices())
def test_lamb_mp_many_small_and_zero_size_tensors(device, strict_kernels):
    sizes = torch.randint(0, 300, (1500,)).tolist()
    sizes[3] = sizes[700] = 0
    g, p, m, v = state(sizes, device, BF16, F32)
    model_params = [t.to(BF16) for t in p]
    before = clone([g, p, m, v])
    ops.multi_tensor_lamb_mp(
        g, p, m, v, model_params, flag(device), *mp_scalars(device, step=3, nvlamb=True)
    )
    want = oracle_lamb(*before, step=3, wd=0.05, mode=1, gnorm=GNORM, max_norm=2.0, nvlamb=True)
    check_step([g, p, m, v], before, want)
    for w, pi in zip(model_params, p):
        assert torch.equal(w, pi.to(BF16))


# ---- bad input: a clear exception before any kernel runs, nothing written ------------------------


def _good(device, n=2):
    return list(state([8, 9][:n], device))


def _with(device, i, j, t):
    lists = _good(device)
    lists[i][j] = t
    return lists


def _list_cases(device):
    x = lambda n=8, dt=F32: torch.randn(n, device=device).to(dt)  # noqa: E731
    return [
        (
            [*_good(device)[:3], [x()]],
            ValueError,
            "exp_avg_sqs has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            _with(device, 2, 1, x(10)),
            ValueError,
            "exp_avgs\\[1\\] has 10 elements but grads\\[1\\] has 9",
        ),
        (
            _with(device, 1, 0, x(8, torch.float64)),
            TypeError,
            "params\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            _with(device, 3, 0, torch.randn(4, 2, device=device).t()),
            ValueError,
            "exp_avg_sqs\\[0\\] is not contiguous",
        ),
    ]


def _call_lamb(lists, device, **over):
    kw = {
        "noop_flag": flag(device),
        "adam_w_mode": 1,
        "beta2": BETAS[1],
        "step": 1,
        "global_grad_norm": scalar(1.0, device),
        **over,
    }
    ops.multi_tensor_lamb(
        *lists,
        kw["noop_flag"],
        LR,
        BETAS[0],
        kw["beta2"],
        EPS,
        kw["step"],
        True,
        0.01,
        True,
        kw["adam_w_mode"],
        kw["global_grad_norm"],
        1.0,
        False,
    )


def _call_mp(lists, device, **over):
    names = [
        "lr",
        "beta1",
        "beta2",
        "eps",
        "step",
        "bias_correction",
        "weight_decay",
        "grad_averaging",
        "adam_w_mode",
        "global_grad_norm",
        "max_grad_norm",
        "use_nvlamb",
        "found_inf",
        "inv_scale",
    ]
    args = dict(zip(names, mp_scalars(device, step=1)))
    args.update({k: v for k, v in over.items() if k in args})
    model = over.get("model_params", [])
    noop = over.get("noop_flag", flag(device))
    ops.multi_tensor_lamb_mp(*lists, model, noop, *args.values())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("variant", ["lamb", "lamb_mp"])
@pytest.mark.parametrize(
    "case",
    list(range(4))
    + [
        ({"noop_flag": "float"}, TypeError, "noop_flag must be an int32 tensor, got torch.float32"),
        (
            {"adam_w_mode": 2},
            ValueError,
            "adam_w_mode must be 0 \\(L2 weight decay\\) or 1 \\(decoupled, AdamW\\), got 2",
        ),
        ({"beta2": 1.5}, ValueError, "beta2 must be in \\[0, 1\\), got 1.5"),
        (
            {"global_grad_norm": ("int32", 1)},
            TypeError,
            "global_grad_norm has dtype torch.int32; supported: float32, float64",
        ),
        (
            {"global_grad_norm": ("float32", 2)},
            ValueError,
            "global_grad_norm must have exactly one element, got 2",
        ),
    ],
)
def test_lamb_bad_input(device, variant, case, strict_kernels):
    if isinstance(case, int):
        lists, exc, words = _list_cases(device)[case]
        over = {}
    else:
        over, exc, words = case
        lists = _good(device)
        over = dict(over)
        if over.get("noop_flag") == "float":
            over["noop_flag"] = torch.zeros(1, device=device)
        if "global_grad_norm" in over:
            dt, n = over["global_grad_norm"]
            over["global_grad_norm"] = torch.ones(n, device=device, dtype=getattr(torch, dt))
    op = "multi_tensor_" + variant
    before = clone(lists)
    call = _call_lamb if variant == "lamb" else _call_mp
    with pytest.raises(exc, match=f"{op}: {words}"):
        call(lists, device, **over)
    assert_unchanged(lists, before)


@pytest.mark.parametrize("device", devices())
def test_lamb_step_zero_with_bias_correction_refused(device, strict_kernels):
    lists = _good(device)
    with pytest.raises(
        ValueError, match="multi_tensor_lamb: step must be >= 1 when bias_correction is set, got 0"
    ):
        _call_lamb(lists, device, step=0)


def _mp_scalar_cases(device):
    return [
        (
            {"lr": scalar(LR, device, torch.int32)},
            TypeError,
            "lr has dtype torch.int32; supported: float32, float64",
        ),
        (
            {"step": scalar(1, device, F16)},
            TypeError,
            "step has dtype torch.float16; supported: int32, int64, float32, float64",
        ),
        (
            {"max_grad_norm": torch.ones(2, device=device)},
            ValueError,
            "max_grad_norm must have exactly one element, got 2",
        ),
        (
            {"found_inf": torch.zeros(0, device=device)},
            ValueError,
            "found_inf must have exactly one element, got 0",
        ),
        (
            {"inv_scale": torch.ones((), device=device, dtype=BF16)},
            TypeError,
            "inv_scale has dtype torch.bfloat16; supported: float32, float64",
        ),
        (
            {"model_params": [torch.randn(8, device=device)]},
            ValueError,
            "model_params has 1 tensors but grads has 2; the lists must be the same length",
        ),
        (
            {"model_params": [torch.randn(8, device=device), torch.randn(10, device=device)]},
            ValueError,
            "model_params\\[1\\] has 10 elements but grads\\[1\\] has 9",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(7))
def test_lamb_mp_bad_scalars_and_model_params(device, case, strict_kernels):
    over, exc, words = _mp_scalar_cases(device)[case]
    lists = _good(device)
    before = clone(lists)
    with pytest.raises(exc, match=f"multi_tensor_lamb_mp: {words}"):
        _call_mp(lists, device, **over)
    assert_unchanged(lists, before)


def _stage_cases(device):
    x = lambda n=8, dt=F32: torch.randn(n, device=device).to(dt)  # noqa: E731
    two = torch.zeros(2, device=device)
    return [
        # (stage, over, exception, words)
        (
            1,
            {"decay": two.double()},
            TypeError,
            "per_tensor_decay must be a float32 tensor, got torch.float64",
        ),
        (
            1,
            {"decay": torch.zeros(3, device=device)},
            ValueError,
            "per_tensor_decay has 3 elements but grads has 2 tensors; one value per tensor is required",
        ),
        (
            1,
            {"step": -1},
            ValueError,
            "step must be >= 0 \\(the bias correction uses step \\+ 1\\), got -1",
        ),
        (
            1,
            {"updates": [x(), x(9, torch.float64)]},
            TypeError,
            "updates\\[1\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (1, {"beta1": 1.0}, ValueError, "beta1 must be in \\[0, 1\\), got 1"),
        (
            2,
            {"pn": torch.zeros(1, device=device)},
            ValueError,
            "per_tensor_param_norm has 1 elements but params has 2 tensors",
        ),
        (
            2,
            {"un": two.to(F16)},
            TypeError,
            "per_tensor_update_norm must be a float32 tensor, got torch.float16",
        ),
        (
            2,
            {"un": torch.zeros(4, device=device)[::2]},
            ValueError,
            "per_tensor_update_norm is not contiguous",
        ),
        (
            2,
            {"updates": [x(), x(10)]},
            ValueError,
            "updates\\[1\\] has 10 elements but params\\[1\\] has 9",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(9))
def test_stage_bad_input(device, case, strict_kernels):
    which, over, exc, words = _stage_cases(device)[case]
    lists = _good(device)
    updates = over.get("updates", [torch.randn(8, device=device), torch.randn(9, device=device)])
    before = clone([*lists, updates])
    with pytest.raises(exc, match=f"multi_tensor_lamb_stage{which}: {words}"):
        if which == 1:
            ops.multi_tensor_lamb_stage1(
                *lists,
                updates,
                flag(device),
                over.get("decay", torch.zeros(2, device=device)),
                over.get("step", 0),
                over.get("beta1", BETAS[0]),
                BETAS[1],
                EPS,
                scalar(1.0, device),
                1.0,
            )
        else:
            ops.multi_tensor_lamb_stage2(
                lists[1],
                updates,
                flag(device),
                over.get("pn", torch.ones(2, device=device)),
                over.get("un", torch.ones(2, device=device)),
                LR,
                0.01,
                True,
            )
    assert_unchanged([*lists, updates], before)


@pytest.mark.cuda
def test_lamb_mixed_devices_refused(strict_kernels):
    lists = _good("cuda")
    with pytest.raises(ValueError, match="global_grad_norm is on cpu but noop_flag is on cuda:0"):
        _call_lamb(lists, "cuda", global_grad_norm=scalar(1.0, "cpu"))
    with pytest.raises(ValueError, match="found_inf is on cpu but noop_flag is on cuda:0"):
        _call_mp(lists, "cuda", found_inf=scalar(0.0, "cpu"))
    with pytest.raises(ValueError, match="per_tensor_decay is on cpu but noop_flag is on cuda:0"):
        ops.multi_tensor_lamb_stage1(
            *lists, lists[0], flag("cuda"), torch.zeros(2), 0, *BETAS, EPS, scalar(1.0, "cuda"), 1.0
        )
    lists[1][0] = lists[1][0].cpu()
    with pytest.raises(ValueError, match="params\\[0\\] is on cpu but noop_flag is on cuda:0"):
        _call_lamb(lists, "cuda")


# ---- legacy amp_C ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_lamb_and_lamb_mp(device, strict_kernels):
    lists = list(state([3, 65537], device, F16, F16, F16, F16))
    a, b = clone(lists), clone(lists)
    noop = torch.zeros((1, 1), dtype=torch.int32, device=device)
    gn = scalar(3.0, device)
    # FusedLAMB's call: (lr, beta1, beta2, eps, step, bias_correction, weight_decay,
    # grad_averaging, mode, global_grad_norm, max_grad_norm, use_nvlamb)
    assert (
        amp_C.multi_tensor_lamb(65536, noop, a, LR, *BETAS, EPS, 4, 1, 0.01, 1, 1, gn, 1.0, False)
        is None
    )
    reference.multi_tensor_lamb(*b, noop, LR, *BETAS, EPS, 4, True, 0.01, True, 1, gn, 1.0, False)
    for x, y in zip(a, b):
        assert_lists_close(x, y)
    with pytest.raises(
        ValueError, match="multi_tensor_lamb: tensor_lists must hold 4 lists, got 3"
    ):
        amp_C.multi_tensor_lamb(65536, noop, a[:3], LR, *BETAS, EPS, 4, 1, 0.01, 1, 1, gn, 1.0)

    # FusedMixedPrecisionLamb's 5-list call
    g, p, m, v = state([3, 65537], device, BF16, F32)
    c = [g, p, m, v, [t.to(BF16) for t in p]]
    d = clone(c)
    lr, step = scalar(LR, device), flag(device, 2)
    mx, fi, inv = scalar(2.0, device), scalar(0.0, device), scalar(0.5, device)
    noop = flag(device)
    amp_C.multi_tensor_lamb_mp(
        65536, noop, c, lr, *BETAS, EPS, step, 1, 0.01, 1, 0, gn, mx, None, fi, inv
    )
    reference.multi_tensor_lamb_mp(
        *d, noop, lr, *BETAS, EPS, step, True, 0.01, True, 0, gn, mx, False, fi, inv
    )
    for x, y in zip(c, d):
        assert_lists_close(x, y)
    amp_C.multi_tensor_lamb_mp(
        65536, noop, c[:4], lr, *BETAS, EPS, step, 1, 0.01, 1, 0, gn, mx, True, fi, inv
    )  # the 4-list form
    with pytest.raises(ValueError, match="tensor_lists must hold 4 or 5 lists, got 3"):
        amp_C.multi_tensor_lamb_mp(
            65536, noop, c[:3], lr, *BETAS, EPS, step, 1, 0.01, 1, 0, gn, mx, True, fi, inv
        )


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_lamb_stages(device, strict_kernels):
    g, p, m, v = state([3, 65537], device)
    upd = [torch.empty_like(t) for t in g]
    a, b = clone([g, p, m, v, upd]), clone([g, p, m, v, upd])
    noop = flag(device)
    decay = torch.full((2,), 0.01, device=device)
    gn = scalar(3.0, device)
    amp_C.multi_tensor_lamb_stage1_cuda(65536, noop, a, decay, 4, *BETAS, EPS, gn, 1.0)
    reference.multi_tensor_lamb_stage1(*b, noop, decay, 4, *BETAS, EPS, gn, 1.0)
    for x, y in zip(a, b):
        assert_lists_close(x, y)
    pn, un = torch.rand(2, device=device), torch.rand(2, device=device)
    amp_C.multi_tensor_lamb_stage2_cuda(65536, noop, [a[1], a[4]], pn, un, LR, 0.01)  # no nvlamb
    reference.multi_tensor_lamb_stage2(b[1], b[4], noop, pn, un, LR, 0.01, False)
    assert_lists_close(a[1], b[1])
    with pytest.raises(ValueError, match="tensor_lists must hold 5 lists, got 4"):
        amp_C.multi_tensor_lamb_stage1_cuda(65536, noop, a[:4], decay, 4, *BETAS, EPS, gn, 1.0)


# ---- the op contract: opcheck, torch.compile, CUDA graphs -----------------------------------------


@pytest.mark.parametrize("device", devices())
def test_lamb_opcheck(device, strict_kernels):
    g, p, m, v = state([5, 70000, 1], device, BF16, BF16)
    gn = scalar(3.0, device)
    opcheck(
        torch.ops.apex_mta.multi_tensor_lamb.default,
        (g, p, m, v, flag(device), LR, *BETAS, EPS, 3, True, 0.01, True, 1, gn, 1.0, True),
    )
    w = [t.float() for t in p]
    opcheck(
        torch.ops.apex_mta.multi_tensor_lamb_mp.default,
        (g, w, m, v, p, flag(device), *mp_scalars(device, step=3, inv_scale=0.5)),
    )
    upd = [torch.empty_like(t) for t in g]
    opcheck(
        torch.ops.apex_mta.multi_tensor_lamb_stage1.default,
        (
            g,
            p,
            m,
            v,
            upd,
            flag(device),
            torch.full((3,), 0.01, device=device),
            3,
            *BETAS,
            EPS,
            gn,
            1.0,
        ),
    )
    ones = torch.ones(3, device=device)
    opcheck(
        torch.ops.apex_mta.multi_tensor_lamb_stage2.default,
        (p, upd, flag(device), ones, ones * 2, LR, 0.01, False),
    )


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_lamb_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"
    gn = scalar(3.0, device)

    @torch.compile(fullgraph=True, backend=backend)
    def train_step(g, p, m, v, g2, w, m2, v2, model, noop, lr, step, found_inf, inv):
        ops.multi_tensor_lamb(g, p, m, v, noop, LR, *BETAS, EPS, 2, True, 0.01, True, 1, gn, 1.0)
        step.add_(1)
        ops.multi_tensor_lamb_mp(
            g2,
            w,
            m2,
            v2,
            model,
            noop,
            lr,
            *BETAS,
            EPS,
            step,
            True,
            0.01,
            True,
            0,
            gn,
            gn,
            True,
            found_inf,
            inv,
        )
        return p[0].float().sum() + model[0].float().sum()

    lists = list(state([17, 65539], device, BF16, BF16))
    g2, w, m2, v2 = state([17, 65539], device, BF16, F32)
    model = [t.to(BF16) for t in w]
    lr, step = scalar(LR, device), flag(device, 1)
    fi, inv = scalar(0.0, device), scalar(0.5, device)
    want = clone(lists)
    want_mp = clone([g2, w, m2, v2, model])
    reference.multi_tensor_lamb(
        *want, flag(device), LR, *BETAS, EPS, 2, True, 0.01, True, 1, gn, 1.0, False
    )
    reference.multi_tensor_lamb_mp(
        *want_mp,
        flag(device),
        lr,
        *BETAS,
        EPS,
        flag(device, 2),
        True,
        0.01,
        True,
        0,
        gn,
        gn,
        True,
        fi,
        inv,
    )
    total = train_step(*lists, g2, w, m2, v2, model, flag(device), lr, step, fi, inv)
    for got, w_ in zip([*lists, g2, w, m2, v2, model], [*want, *want_mp]):
        assert_lists_close(got, w_)
    assert step.item() == 2
    torch.testing.assert_close(total, lists[1][0].float().sum() + model[0].float().sum())


@pytest.mark.cuda
def test_lamb_mp_in_cuda_graph_with_new_scalars(strict_kernels):
    """Captured once, replayed with a new lr, step, grad norm, loss scale and overflow state."""
    sizes = [100, 65536 * 2 + 1, 4099]
    g, p, m, v = state(sizes, "cuda", BF16, F32)
    lists = [g, p, m, v, [t.to(BF16) for t in p]]
    lr, step, gn, mx = (
        scalar(LR, "cuda"),
        flag("cuda", 1),
        scalar(GNORM, "cuda"),
        scalar(2.0, "cuda"),
    )
    fi, inv, noop = scalar(0.0, "cuda"), scalar(0.25, "cuda"), flag("cuda")

    def run(ls, op):
        op(*ls, noop, lr, *BETAS, EPS, step, True, 0.01, True, 1, gn, mx, True, fi, inv)

    run(clone(lists), ops.multi_tensor_lamb_mp)  # load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(lists, ops.multi_tensor_lamb_mp)
    replays = [
        (1e-2, 1, 5.0, 0.0, 0),
        (5e-3, 2, 1.0, 0.0, 0),
        (5e-3, 3, 9.0, 1.0, 0),
        (2e-3, 3, 4.0, 0.0, 1),
        (2e-3, 3, 4.0, 0.0, 0),
    ]
    for new_lr, new_step, new_gn, overflow, flagged in replays:
        for t in lists[0]:
            t.copy_(torch.randn_like(t, dtype=torch.float32) * 4)
        lr.fill_(new_lr)
        step.fill_(new_step)
        gn.fill_(new_gn)
        fi.fill_(overflow)
        noop.fill_(flagged)
        want = clone(lists)
        run(want, reference.multi_tensor_lamb_mp)
        before = clone(lists)
        graph.replay()
        assert_stepped_close(lists, want, before)
        if overflow or flagged:
            assert_unchanged(lists, before)


# ---- CUDA against the reference --------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["lamb", "lamb_mp", "stage1"])
@pytest.mark.parametrize("dg,dp", list(itertools.product(DTYPES, DTYPES)))
def test_lamb_cuda_matches_reference_for_every_dtype_mix(variant, dg, dp, strict_kernels):
    """Every (m, v) dtype pair (and update / model dtype) under every (g, p): the fast paths'
    instantiations and the generic paths alike."""
    sizes = [1, 7, 4099, 65536, 65537, 3 * 65536 + 13]
    extra = DTYPES if variant != "lamb" else [None]
    for (dm, dv), dx in itertools.product(itertools.product(DTYPES, DTYPES), extra):
        lists = list(state(sizes, "cuda", dg, dp, dm, dv))
        if dx is not None:
            lists.append([torch.randn(n, device="cuda").to(dx) for n in sizes])
        a, b = clone(lists), clone(lists)
        gn = scalar(GNORM, "cuda")
        for out, impl in ((a, ops), (b, reference)):
            if variant == "lamb":
                impl.multi_tensor_lamb(
                    *out, flag("cuda"), LR, *BETAS, EPS, 3, True, 0.05, True, 0, gn, 2.0, False
                )
            elif variant == "lamb_mp":
                impl.multi_tensor_lamb_mp(
                    *out, flag("cuda"), *mp_scalars("cuda", step=3, inv_scale=0.5, nvlamb=True)
                )
            else:
                decay = torch.tensor([0.0, 0.01, 0.02, 0.0, 0.1, 0.05], device="cuda")
                impl.multi_tensor_lamb_stage1(*out, flag("cuda"), decay, 3, *BETAS, EPS, gn, 2.0)
        try:
            assert_stepped_close(a, b, lists, stepped=() if variant == "stage1" else (1, 4))
        except AssertionError as e:
            raise AssertionError(f"m {dm}, v {dv}, extra {dx}: {e}") from None


@pytest.mark.cuda
@pytest.mark.parametrize("du,dp", list(itertools.product(DTYPES, DTYPES)))
def test_stage2_cuda_matches_reference(du, dp, strict_kernels):
    sizes = [1, 7, 4099, 65537, 3 * 65536 + 13]
    p = [torch.randn(n, device="cuda").to(dp) for n in sizes]
    u = [torch.randn(n, device="cuda").to(du) for n in sizes]
    pn, un = torch.rand(5, device="cuda"), torch.rand(5, device="cuda")
    un[1] = 0
    a, b = [t.clone() for t in p], [t.clone() for t in p]
    ops.multi_tensor_lamb_stage2(a, u, flag("cuda"), pn, un, LR, 0.01, False)
    reference.multi_tensor_lamb_stage2(b, u, flag("cuda"), pn, un, LR, 0.01, False)
    assert_lists_close(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("mp", [False, True])
def test_lamb_cuda_matches_reference_on_random_lists(mp, strict_kernels):
    for _ in range(5):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        dts = [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]
        lists = [[], [], [], []]
        for s, d in zip(sizes, dts):
            for lst, t in zip(lists, state([s], "cuda", d, F32 if mp else d, F32, F32)):
                lst.extend(t)
        if mp:
            lists.append([t.to(BF16) for t in lists[1]])
        a, b = clone(lists), clone(lists)
        for out, impl in ((a, ops), (b, reference)):
            if mp:
                impl.multi_tensor_lamb_mp(
                    *out, flag("cuda"), *mp_scalars("cuda", step=9, inv_scale=0.125, mode=0)
                )
            else:
                impl.multi_tensor_lamb(
                    *out,
                    flag("cuda"),
                    LR,
                    *BETAS,
                    EPS,
                    9,
                    True,
                    0.05,
                    True,
                    1,
                    scalar(GNORM, "cuda"),
                    2.0,
                    True,
                )
        assert_stepped_close(a, b, lists)


@pytest.mark.cuda
def test_lamb_cuda_is_deterministic(strict_kernels):
    """The per-tensor norms are added in a fixed order: two runs agree bit for bit."""
    lists = list(state([3 * 65536 + 13, 40 * 65536, 5], "cuda"))
    a, b = clone(lists), clone(lists)
    for out in (a, b):
        lamb(out, "cuda", step=3, wd=0.05, mode=1, max_norm=2.0)
    for x, y in zip(a, b):
        assert all(torch.equal(s, t) for s, t in zip(x, y))


def unaligned(t):
    """A copy of ``t`` starting one element into its storage: not 16-byte aligned."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return out.copy_(t)


@pytest.mark.cuda
@pytest.mark.parametrize("dp", [F32, BF16])
def test_lamb_cuda_unaligned_tensors_take_the_scalar_path(dp, strict_kernels):
    lists = list(state([5, 4099, 65537], "cuda", dp, dp))
    a = [[unaligned(t) for t in lst] for lst in lists]
    assert all(t.data_ptr() % 16 for t in a[0])
    lamb(a, "cuda", step=5, wd=0.05, mode=1, max_norm=2.0)
    reference.multi_tensor_lamb(
        *lists,
        flag("cuda"),
        LR,
        *BETAS,
        EPS,
        5,
        True,
        0.05,
        True,
        1,
        scalar(GNORM, "cuda"),
        2.0,
        False,
    )
    for x, y in zip(a, lists):
        assert_lists_close(x, y)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_lamb_over_2_pow_31_elements(strict_kernels):
    """bf16 grads and params, fp32 moments, one tensor of 2^31 + 17 elements (about 26 GB).
    m, v and the update do not depend on the norms: both ends are checked against the reference
    on slices. The trust ratio is checked with norms of the whole tensors taken by torch."""
    n = 2**31 + 17
    g = torch.empty(n, dtype=BF16, device="cuda").uniform_(-1, 1)
    p = torch.empty(n, dtype=BF16, device="cuda").uniform_(-1, 1)
    m = torch.empty(n, dtype=F32, device="cuda").uniform_(-0.1, 0.1)
    v = torch.empty(n, dtype=F32, device="cuda").uniform_(0, 0.01)
    ends = (slice(0, 1 << 20), slice(2**31 - (1 << 20), n))  # both sides of the 32-bit edge
    want = [[t[sl].clone() for sl in ends] for t in (g, p, m, v)]
    p_ends = [t.clone() for t in want[1]]
    p_norm = torch.linalg.vector_norm(p, dtype=F32)
    gn = scalar(1.0, "cuda")
    ops.multi_tensor_lamb(
        [g], [p], [m], [v], flag("cuda"), LR, *BETAS, EPS, 4, True, 0.0, True, 1, gn, 10.0, True
    )
    reference.multi_tensor_lamb(
        *want, flag("cuda"), LR, *BETAS, EPS, 4, True, 0.0, True, 1, gn, 10.0, False
    )
    for t, w in zip((g, m, v), (want[0], want[2], want[3])):
        assert_lists_close([t[sl] for sl in ends], w)
    ratio = LR * p_norm / torch.linalg.vector_norm(g, dtype=F32)
    want_p = [(p0.float() - ratio * g[sl].float()) for p0, sl in zip(p_ends, ends)]
    assert_lists_close([p[sl] for sl in ends], want_p)
    assert not math.isnan(float(p[-1]))


# ---- the cached plan (ops.lamb_plan): global norm + both stages from lists it holds ------------------

PLAN_CASES = {
    "fp32": dict(dtype=F32, master=False),
    "fp16": dict(dtype=F16, master=False),
    "bf16-masters": dict(dtype=BF16, master=True),
}
PLAN_SIZES = [7, 65537, 1, 4099, 0, 97]
PLAN_HYPER = [  # (adam_w_mode, weight_decay, use_nvlamb, max_grad_norm)
    (1, 0.05, False, 2.0),
    (0, 0.05, False, 1e3),
    (1, 0.0, True, 2.0),
    (1, 0.0, False, 2.0),
]


def plan_bucket(sizes, device, dtype=F32, master=False):
    """A FusedLAMB-like bucket: params (with grads), work (the params or fp32 masters), moments
    of work's dtype, copies (the params when there are masters)."""
    ps = [torch.randn(n, device=device).to(dtype) for n in sizes]
    work = [p.float() for p in ps] if master else ps
    m = [0.1 * torch.randn_like(w) for w in work]
    v = [0.01 * torch.rand_like(w) for w in work]
    return ps, work, m, v, (ps if master else [])


def clone_bucket(bucket):
    ps, work, m, v, copies = bucket
    ps2 = [p.clone() for p in ps]
    work2 = [w.clone() for w in work] if copies else ps2
    return ps2, work2, [t.clone() for t in m], [t.clone() for t in v], (ps2 if copies else [])


def give_grads(ps, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def plan_args(step, mode, wd, nvlamb, max_norm, gnorm=None):
    """plan.step's arguments after noop_flag (multi_tensor_lamb's, in the same order)."""
    return (LR, *BETAS, EPS, step, True, wd, True, mode, gnorm, max_norm, nvlamb)


def list_step(buckets, device, step, mode, wd, nvlamb, max_norm, noop):
    """The list path FusedLAMB took before its plans: one norm over every grad, then each bucket."""
    grads = [[p.grad for p in b[0]] for b in buckets]
    gn = ops.multi_tensor_l2norm([g for gs in grads for g in gs], noop, False)[0]
    for (_, work, m, v, copies), gs in zip(buckets, grads):
        ops.multi_tensor_lamb(
            gs, work, m, v, noop, *plan_args(step, mode, wd, nvlamb, max_norm, gn)
        )
        if copies:
            ops.multi_tensor_scale(work, copies, noop, 1.0)
    return gn


def assert_buckets_equal(a, b, grads=True):
    """Lists bitwise equal; with ``grads``, the first list's grads (now the updates) too."""
    for k, (x, y) in enumerate(zip(a, b)):
        for i, (s, t) in enumerate(zip(x, y)):
            assert torch.equal(s, t), f"list {k}, tensor {i} differs"
            if k == 0 and grads:
                assert torch.equal(s.grad, t.grad), f"grad (update) {i} differs"


def test_lamb_plan_is_the_reference_plan_on_the_cpu():
    ps, work, m, v, _ = plan_bucket([3, 5], "cpu")
    plan = ops.lamb_plan(ps, work, m, v)
    assert isinstance(plan, reference.LambPlan) and len(plan) == 2
    assert ops.lamb_plan([], [], [], []) is None


@pytest.mark.cuda
def test_lamb_plan_is_the_compiled_plan_on_the_gpu(strict_kernels):
    ps, work, m, v, _ = plan_bucket([3, 5], "cuda")
    plan = ops.lamb_plan(ps, work, m, v)
    assert isinstance(plan, torch.ScriptObject) and len(plan) == 2


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
@pytest.mark.parametrize("hyper", PLAN_HYPER, ids=str)
def test_lamb_plan_matches_the_list_ops_bitwise_and_the_oracle(device, case, hyper, strict_kernels):
    """One bucket: the plan takes the global norm of its own grads, then both stages (and the
    master copy): the same bits as l2norm + multi_tensor_lamb (+ scale) on lists, over steps,
    and the float64 oracle on the first."""
    mode, wd, nvlamb, max_norm = hyper
    mine = plan_bucket(PLAN_SIZES, device, **PLAN_CASES[case])
    theirs = clone_bucket(mine)
    plan = ops.lamb_plan(*mine)
    noop_a, noop_b = flag(device), flag(device)
    for step in range(1, 4):
        give_grads(mine[0], step)
        give_grads(theirs[0], step)
        before = [[t.clone() for t in lst] for lst in ([p.grad for p in mine[0]], *mine[1:4])]
        assert plan.step(noop_a, *plan_args(step, mode, wd, nvlamb, max_norm))
        gn = list_step([theirs], device, step, mode, wd, nvlamb, max_norm, noop_b)
        assert_buckets_equal(mine[:4], theirs[:4])
        assert torch.equal(noop_a, noop_b)
        if step == 1:
            want = oracle_lamb(*before, step=1, wd=wd, mode=mode, gnorm=float(gn), max_norm=max_norm,
                               nvlamb=nvlamb)  # fmt: skip
            check_step([[p.grad for p in mine[0]], mine[1], mine[2], mine[3]], before, want)
    if mine[4]:
        for p, w in zip(mine[0], mine[1]):
            assert torch.equal(p, w.to(p.dtype))


@pytest.mark.parametrize("device", devices())
def test_lamb_plan_of_several_buckets_takes_the_norm_of_every_grad(device, strict_kernels):
    """Two buckets (two dtypes): a plan of every param takes the global norm, each bucket's plan
    steps with it; the same bits as the list path."""
    mine = [plan_bucket([97, 65537, 5], device), plan_bucket([13, 7], device, BF16, master=True)]
    theirs = [clone_bucket(b) for b in mine]
    plans = [ops.lamb_plan(*b) for b in mine]
    norm = ops.lamb_plan([p for b in mine for p in b[0]], [], [], [])
    noop_a, noop_b = flag(device), flag(device)
    for step in range(1, 4):
        for k, b in enumerate(mine + theirs):
            give_grads(b[0], 10 * step + k % 2)
        gn_list = ops.multi_tensor_l2norm([p.grad for b in theirs for p in b[0]], noop_b, False)[0]
        gn = norm.grad_norm(noop_a)
        assert torch.equal(gn, gn_list)
        for plan in plans:
            assert plan.step(noop_a, *plan_args(step, 1, 0.05, False, 2.0, gn))
        list_step(theirs, device, step, 1, 0.05, False, 2.0, noop_b)
        for a, b in zip(mine, theirs):
            assert_buckets_equal(a[:4], b[:4])
    with pytest.raises(ValueError, match="holds params only"):
        norm.step(noop_a, *plan_args(4, 1, 0.05, False, 2.0, gn))


@pytest.mark.parametrize("device", devices())
def test_lamb_plan_missing_grad_runs_nothing_and_keeps_no_grad(device, strict_kernels):
    import gc
    import weakref

    bucket = plan_bucket([5, 7, 9], device)
    before = clone_bucket(bucket)
    plan = ops.lamb_plan(*bucket)
    give_grads(bucket[0], 0)
    bucket[0][1].grad = None
    assert not plan.fetch()
    assert not plan.step(flag(device), *plan_args(1, 1, 0.05, False, 2.0))
    assert plan.grad_norm(flag(device)) is None
    assert_buckets_equal(bucket[1:4], before[1:4], grads=False)
    give_grads(bucket[0], 1)
    assert plan.fetch()  # held until the step ends, then released
    assert plan.step(flag(device), *plan_args(1, 1, 0.05, False, 2.0))
    refs = [weakref.ref(p.grad) for p in bucket[0]]
    for p in bucket[0]:
        p.grad = None
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("device", devices())
def test_lamb_plan_bad_input_raises_before_anything_runs(device, strict_kernels):
    bucket = plan_bucket([13, 5], device)
    plan = ops.lamb_plan(*bucket)
    give_grads(bucket[0], 0)
    assert plan.step(flag(device), *plan_args(1, 1, 0.05, False, 2.0))  # validated once
    give_grads(bucket[0], 1)
    bucket[0][0].grad = torch.randn(13, 2, device=device)[:, 0]
    before = clone_bucket(bucket)
    noop = flag(device)
    # A grad laid out otherwise than the plan validated: False, nothing run, nothing held (the
    # caller's general path checks and names it before any launch).
    assert plan.step(noop, *plan_args(2, 1, 0.05, False, 2.0)) is False
    assert_buckets_equal(bucket[1:4], before[1:4], grads=False)
    with pytest.raises(ValueError, match=r"multi_tensor_lamb: grads\[0\] is not contiguous"):
        gn = torch.ones(1, device=device)
        ops.multi_tensor_lamb(
            [p.grad for p in bucket[0]], *bucket[1:4], noop, *plan_args(2, 1, 0.05, False, 2.0, gn)
        )
    give_grads(bucket[0], 2)
    with pytest.raises(ValueError, match=r"multi_tensor_lamb: beta1 must be in \[0, 1\), got 1"):
        plan.step(noop, LR, 1.0, 0.999, EPS, 2, True, 0.05, True, 1, None, 2.0, False)
    with pytest.raises(ValueError, match="step must be >= 1 when bias_correction is set, got 0"):
        plan.step(noop, *plan_args(0, 1, 0.05, False, 2.0))
    with pytest.raises(ValueError, match="global_grad_norm must have exactly one element"):
        plan.step(noop, *plan_args(2, 1, 0.05, False, 2.0, torch.ones(2, device=device)))
    assert_buckets_equal(bucket[1:4], before[1:4], grads=False)
    with pytest.raises(ValueError, match="LambPlan: params has 2 tensors but work, exp_avgs and"):
        ops.lamb_plan(bucket[0], bucket[1], bucket[2][:1], bucket[3])


@pytest.mark.parametrize("device", devices())
def test_lamb_plan_fetch_tests_each_grad_against_its_param(device):
    """fetch refuses (False, nothing held) a grad the ops would refuse beside its param, on
    every step, validated or not: strided, expanded (stride 0), of another memory format; it
    takes one whose strides differ only in size-1 dims (autograd's layout contract: a (1, 4)
    param's grad may have strides (7, 1))."""
    p = torch.randn(1, 4, device=device)
    q = torch.randn(2, 3, 2, 2, device=device)
    bucket = ([p, q], [p, q], [torch.zeros_like(p), torch.zeros_like(q)],
              [torch.zeros_like(p), torch.zeros_like(q)], [])  # fmt: skip
    plan = ops.lamb_plan(*bucket)
    q.grad = torch.randn_like(q)
    for step in (1, 2):
        p.grad = torch.randn(2, 7, device=device)[:1, :4]  # strides (7, 1)
        assert p.grad.stride() == (7, 1) and p.stride() == (4, 1)
        assert plan.fetch()
        plan.release()
        assert plan.step(flag(device), *plan_args(step, 1, 0.0, False, 0.0, scalar(1.0, device)))
        for bad in (
            torch.randn(1, 8, device=device)[:, ::2],  # strides (8, 2)
            torch.randn(1, 1, device=device).expand(1, 4),  # strides (1, 0)
        ):
            p.grad = bad
            assert plan.fetch() is False
            plan.release()
        p.grad = torch.randn(1, 4, device=device)
        q.grad = torch.randn_like(q).contiguous(memory_format=torch.channels_last)
        assert plan.fetch() is False  # q is contiguous, its grad channels_last only
        q.grad = torch.randn_like(q)
