"""multi_tensor_l2norm and its variants (_mp, _scale, unscale_): the ops, their references, their
CUDA kernels and the legacy amp_C entry points."""

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]
# Norms are float32 sums whatever the input dtype (the inputs convert exactly), so one tolerance
# serves every dtype: against a float64 oracle, and between the kernel and the reference.
NORM_TOL = {"rtol": 2e-5, "atol": 1e-6}

NORM_OPS = ["l2norm", "l2norm_mp", "l2norm_scale", "unscale_l2norm"]


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


def oracle(xs, mul=1.0):
    """(total, per-tensor) norms in float64."""
    per = torch.stack([torch.linalg.vector_norm(x.double() * mul) for x in xs])
    return per.square().sum().sqrt().view(1), per


def check_norms(got, xs, per_tensor, mul=1.0):
    total, per = got
    want_total, want_per = oracle(xs, mul)
    assert total.dtype == per.dtype == torch.float32
    assert total.shape == (1,)
    torch.testing.assert_close(total.double(), want_total, **NORM_TOL)
    if per_tensor:
        assert per.shape == (len(xs),)
        torch.testing.assert_close(per.double(), want_per, **NORM_TOL)
    else:
        assert per.shape == (0,)


def run_norm(name, xs, noop, per_tensor, inv_scale=0.5, scale=3.0):
    """Call one of the norm ops on ``xs``; returns (result, multiplier the norm applies)."""
    if name == "l2norm":
        return ops.multi_tensor_l2norm(xs, noop, per_tensor), 1.0
    if name == "l2norm_mp":
        return ops.multi_tensor_l2norm_mp(xs, noop, per_tensor), 1.0
    if name == "l2norm_scale":
        outs = [torch.empty_like(x) for x in xs]
        return ops.multi_tensor_l2norm_scale(xs, outs, noop, scale, per_tensor), 1.0
    inv = torch.tensor([inv_scale], device=noop.device)
    return ops.multi_tensor_unscale_l2norm(xs, noop, inv, per_tensor), inv_scale


# ---- every op: values, shapes, dtypes ----------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("name", NORM_OPS)
def test_norm_matches_float64_oracle(device, dtype, per_tensor, name, strict_kernels):
    xs = [rand(n, dtype, device) for n in SIZES]
    noop = flag(device)
    got, mul = run_norm(name, xs, noop, per_tensor)
    check_norms(got, xs, per_tensor, mul)
    assert got[0].device == xs[0].device
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", NORM_OPS)
def test_norm_many_small_and_zero_size(device, name, strict_kernels):
    sizes = torch.randint(0, 300, (2000,)).tolist()
    sizes[5] = sizes[1999] = 0
    xs = [rand(n, DTYPES[i % 3], device) for i, n in enumerate(sizes)]
    xs[7] = torch.empty(0, 3, device=device)
    got, mul = run_norm(name, xs, flag(device), True)
    check_norms(got, xs, True, mul)
    assert got[1][5] == got[1][7] == got[1][1999] == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", NORM_OPS)
def test_norm_of_empty_list_and_all_empty_tensors(device, name, strict_kernels):
    for xs in ([], [torch.empty(0, device=device), torch.empty(0, 5, device=device)]):
        (total, per), _ = run_norm(name, xs, flag(device), True)
        assert total.shape == (1,) and total.item() == 0
        assert per.shape == (len(xs),) and not per.any()
        (total, per), _ = run_norm(name, xs, flag(device), False)
        assert total.item() == 0 and per.shape == (0,)


@pytest.mark.parametrize("device", devices())
def test_l2norm_channels_last_and_mixed_dtypes(device, strict_kernels):
    xs = [
        rand(0, torch.bfloat16, device, (3, 5, 7, 11)).to(memory_format=torch.channels_last),
        rand(0, torch.float32, device, (2, 4, 3, 5, 6)).to(memory_format=torch.channels_last_3d),
        rand(70001, torch.float16, device),
        rand(33, torch.float32, device),
    ]
    check_norms(ops.multi_tensor_l2norm(xs, flag(device), True), xs, True)


@pytest.mark.parametrize("device", devices())
def test_l2norm_misaligned_views(device, strict_kernels):
    """Views that start off a 16-byte boundary take the scalar path."""
    base = rand(200_003, torch.float16, device)
    xs = [base[1:], base[3:70_000], base[5:6]]
    check_norms(ops.multi_tensor_l2norm(xs, flag(device), True), xs, True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("din", DTYPES)
@pytest.mark.parametrize("dout", DTYPES)
def test_l2norm_scale_writes_scaled_inputs(device, din, dout, strict_kernels):
    xs = [rand(n, din, device) for n in SIZES]
    outs = [torch.full((n,), float("nan"), device=device, dtype=dout) for n in SIZES]  # poisoned
    noop = flag(device)
    got = ops.multi_tensor_l2norm_scale(xs, outs, noop, 0.37, True)
    check_norms(got, xs, True)  # the norm of the inputs, not of the scaled outputs
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, (x.float() * 0.37).to(dout), atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
def test_l2norm_scale_in_place(device, strict_kernels):
    xs = [rand(n, torch.bfloat16, device) for n in (5, 65536 + 7)]
    want_out = [(x.float() * -2.0).to(torch.bfloat16) for x in xs]
    want_norm = oracle(xs)
    total, per = ops.multi_tensor_l2norm_scale(xs, xs, flag(device), -2.0, True)
    torch.testing.assert_close(total.double(), want_norm[0], **NORM_TOL)
    torch.testing.assert_close(per.double(), want_norm[1], **NORM_TOL)
    for x, w in zip(xs, want_out):
        torch.testing.assert_close(x, w, atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_l2norm_leaves_tensors_alone(device, dtype, strict_kernels):
    xs = [rand(n, dtype, device) * 1024 for n in SIZES]
    before = [x.clone() for x in xs]
    inv = torch.tensor([1 / 1024], device=device)
    got = ops.multi_tensor_unscale_l2norm(xs, flag(device), inv, True)
    check_norms(got, xs, True, 1 / 1024)
    for x, b in zip(xs, before):
        assert torch.equal(x, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", NORM_OPS)
def test_total_does_not_depend_on_per_tensor(device, name, strict_kernels):
    xs = [rand(n, torch.float32, device) for n in SIZES]
    a, _ = run_norm(name, xs, flag(device), False)
    b, _ = run_norm(name, xs, flag(device), True)
    assert torch.equal(a[0], b[0])


# ---- the overflow flag -------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name", ["l2norm", "l2norm_scale", "unscale_l2norm"])
def test_norm_flags_nonfinite_and_never_clears(device, bad, name, strict_kernels):
    xs = [rand(n, torch.float16, device) for n in (10, 70000)]
    xs[1][69999] = bad
    noop = flag(device)
    (total, _), _ = run_norm(name, xs, noop, True)
    assert noop.item() == 1
    assert not torch.isfinite(total).item()
    xs[1][69999] = 1.0
    (total, per), mul = run_norm(name, xs, noop, True)
    assert noop.item() == 1  # the kernels never clear the flag: callers zero it
    check_norms((total, per), xs, True, mul)  # a set flag does not stop these ops


@pytest.mark.parametrize("device", devices())
def test_norm_flags_overflowing_squares(device, strict_kernels):
    """apex's rule: the flag follows the float32 sum of squares, so huge finite values raise it."""
    x = torch.full((100,), 1e30, device=device)
    noop = flag(device)
    total, _ = ops.multi_tensor_l2norm([x], noop)
    assert noop.item() == 1 and total.item() == float("inf")
    noop = flag(device)
    ops.multi_tensor_unscale_l2norm([x], noop, torch.tensor([1e-20], device=device))
    assert noop.item() == 0  # the square of the unscaled value is finite


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_mp_returns_zeros_when_flag_is_set(device, per_tensor, strict_kernels):
    xs = [rand(n, torch.float32, device) for n in (10, 70000)]
    noop = flag(device)
    noop[0] = 1
    total, per = ops.multi_tensor_l2norm_mp(xs, noop, per_tensor)
    assert noop.item() == 1
    assert total.shape == (1,) and total.item() == 0
    assert per.shape == ((2,) if per_tensor else (0,)) and not per.any()
    # a non-finite value found by the call itself sets the flag, and zeros every norm too
    xs[0][3] = float("nan")
    noop = flag(device)
    total, per = ops.multi_tensor_l2norm_mp(xs, noop, per_tensor)
    assert noop.item() == 1 and total.item() == 0 and not per.any()


# ---- bad input: a clear exception before any kernel runs, nothing written ----------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    inv = torch.ones(1, device=device)
    return [
        (
            "l2norm",
            ([x(8, torch.float64)], flag(device)),
            TypeError,
            "multi_tensor_l2norm: tensors\\[0\\] has dtype torch.float64; supported: float32",
        ),
        (
            "l2norm",
            ([x()], torch.zeros(1, device=device)),
            TypeError,
            "noop_flag must be an int32 tensor, got torch.float32",
        ),
        (
            "l2norm_mp",
            ([rand(0, torch.float32, device, (4, 6)).t()], flag(device)),
            ValueError,
            "multi_tensor_l2norm_mp: tensors\\[0\\] is not contiguous",
        ),
        (
            "l2norm_scale",
            ([x(), x()], [x()], flag(device), 2.0),
            ValueError,
            "outputs has 1 tensors but inputs has 2; the lists must be the same length",
        ),
        (
            "l2norm_scale",
            ([x(8)], [x(9)], flag(device), 2.0),
            ValueError,
            "outputs\\[0\\] has 9 elements but inputs\\[0\\] has 8",
        ),
        (
            "unscale_l2norm",
            ([x()], flag(device), inv.double()),
            TypeError,
            "multi_tensor_unscale_l2norm: inv_scale must be a float32 tensor, got torch.float64",
        ),
        (
            "unscale_l2norm",
            ([x()], flag(device), torch.ones(2, device=device)),
            ValueError,
            "inv_scale must have exactly one element, got 2",
        ),
        (
            "unscale_l2norm",
            ([x()], flag(device), torch.ones(0, device=device)),
            ValueError,
            "inv_scale must have exactly one element, got 0",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(8))
def test_norm_bad_input(device, case, strict_kernels):
    name, args, exc, words = _bad_cases(device)[case]
    fn = getattr(ops, f"multi_tensor_{name}")
    outs = args[1] if name == "l2norm_scale" else []
    before = [o.clone() for o in outs]
    with pytest.raises(exc, match=words):
        fn(*args)
    for o, b in zip(outs, before):
        assert torch.equal(o, b)


@pytest.mark.cuda
def test_unscale_l2norm_inv_scale_on_cpu_refused(strict_kernels):
    xs = [torch.randn(8, device="cuda")]
    with pytest.raises(ValueError, match="inv_scale is on cpu but noop_flag is on cuda:0"):
        ops.multi_tensor_unscale_l2norm(xs, flag("cuda"), torch.ones(1))


@pytest.mark.cuda
def test_norm_mixed_devices_refused(strict_kernels):
    with pytest.raises(ValueError, match="tensors\\[1\\] is on cpu but noop_flag is on cuda:0"):
        ops.multi_tensor_l2norm([torch.randn(8, device="cuda"), torch.randn(8)], flag("cuda"))


# ---- legacy amp_C ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_norms(device, strict_kernels):
    xs = [rand(n, torch.float32, device) for n in (3, 65537)]
    noop = torch.zeros((1, 1), dtype=torch.int32, device=device)  # fairseq passes (1, 1)
    total, per = amp_C.multi_tensor_l2norm(2048 * 32, noop, [xs], False)  # fairseq's call
    check_norms((total, per), xs, False)
    check_norms(amp_C.multi_tensor_l2norm(2048 * 32, noop, [xs], None), xs, False)
    check_norms(amp_C.multi_tensor_l2norm(2048 * 32, noop, [xs], True), xs, True)
    check_norms(amp_C.multi_tensor_l2norm_mp(2048 * 32, noop, [xs], True), xs, True)
    outs = [torch.empty_like(x) for x in xs]
    check_norms(amp_C.multi_tensor_l2norm_scale(65536, noop, [xs, outs], 4.0, True), xs, True)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, x * 4.0, atol=0, rtol=0)
    inv = torch.tensor([0.25], device=device)
    check_norms(amp_C.multi_tensor_unscale_l2norm(65536, noop, [xs], inv, None), xs, False, 0.25)
    assert noop.item() == 0
    with pytest.raises(
        ValueError, match="multi_tensor_l2norm: tensor_lists must hold 1 lists, got 2"
    ):
        amp_C.multi_tensor_l2norm(65536, noop, [xs, xs], False)


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


def _op_args(name, device, per_tensor):
    xs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    noop = flag(device)
    if name == "multi_tensor_l2norm_scale":
        return (xs, [torch.empty_like(x) for x in xs], noop, 0.5, per_tensor)
    if name == "multi_tensor_unscale_l2norm":
        return (xs, noop, torch.tensor([0.5], device=device), per_tensor)
    return (xs, noop, per_tensor)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("name", [f"multi_tensor_{n}" for n in NORM_OPS])
def test_norm_opcheck(device, per_tensor, name, strict_kernels):
    op = getattr(torch.ops.apex_mta, name).default
    opcheck(op, _op_args(name, device, per_tensor))


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_norm_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def step(xs, outs, noop, inv):
        total, per = ops.multi_tensor_l2norm(xs, noop, True)
        scaled, _ = ops.multi_tensor_l2norm_scale(xs, outs, noop, 2.0)
        unscaled, _ = ops.multi_tensor_unscale_l2norm(xs, noop, inv)
        mp, _ = ops.multi_tensor_l2norm_mp(xs, noop)
        return total * 2, per, scaled, unscaled, mp

    xs = [rand(n, torch.bfloat16, device) for n in (17, 65539)]
    outs = [torch.empty_like(x) for x in xs]
    noop = flag(device)
    total2, per, scaled, unscaled, mp = step(xs, outs, noop, torch.tensor([0.5], device=device))
    want_total, want_per = oracle(xs)
    torch.testing.assert_close(total2.double(), 2 * want_total, **NORM_TOL)
    torch.testing.assert_close(per.double(), want_per, **NORM_TOL)
    torch.testing.assert_close(scaled.double(), want_total, **NORM_TOL)
    torch.testing.assert_close(unscaled.double(), want_total / 2, **NORM_TOL)
    torch.testing.assert_close(mp.double(), want_total, **NORM_TOL)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, (x.float() * 2).to(torch.bfloat16), atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.cuda
def test_unscale_l2norm_captured_in_cuda_graph(strict_kernels):
    xs = [rand(n, torch.float16, "cuda") for n in (100, 65536 * 2 + 1)]
    noop = flag("cuda")
    inv = torch.tensor([0.5], device="cuda")
    ops.multi_tensor_unscale_l2norm(xs, noop, inv, True)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        total, per = ops.multi_tensor_unscale_l2norm(xs, noop, inv, True)
    for x in xs:
        x.copy_(torch.randn_like(x))
    inv.fill_(0.125)  # a new loss scale, read on the device at replay
    g.replay()
    check_norms((total, per), xs, True, 0.125)
    xs[0][0] = float("inf")
    g.replay()
    assert noop.item() == 1


# ---- CUDA against the reference ----------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", NORM_OPS)
def test_norm_cuda_matches_reference_on_random_lists(name, strict_kernels):
    for _ in range(5):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 300_000, (n,)).tolist()
        dts = [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]
        xs = [rand(s, d, "cuda") * 10 for s, d in zip(sizes, dts)]
        fa, fb = flag("cuda"), flag("cuda")
        inv = torch.tensor([0.3], device="cuda")
        if name == "l2norm_scale":
            oa = [torch.empty_like(x) for x in xs]
            ob = [torch.empty_like(x) for x in xs]
            a = ops.multi_tensor_l2norm_scale(xs, oa, fa, 0.3, True)
            b = reference.multi_tensor_l2norm_scale(xs, ob, fb, 0.3, True)
            for u, v in zip(oa, ob):
                torch.testing.assert_close(u, v, atol=0, rtol=0)
        elif name == "unscale_l2norm":
            a = ops.multi_tensor_unscale_l2norm(xs, fa, inv, True)
            b = reference.multi_tensor_unscale_l2norm(xs, fb, inv, True)
        else:
            a = getattr(ops, f"multi_tensor_{name}")(xs, fa, True)
            b = getattr(reference, f"multi_tensor_{name}")(xs, fb, True)
        torch.testing.assert_close(a[0], b[0], **NORM_TOL)
        torch.testing.assert_close(a[1], b[1], **NORM_TOL)
        assert fa.item() == fb.item() == 0


@pytest.mark.cuda
def test_l2norm_is_deterministic(strict_kernels):
    xs = [rand(n, torch.float32, "cuda") for n in (3 * 65536 + 5, 1000, 10 * 65536)]
    first = ops.multi_tensor_l2norm(xs, flag("cuda"), True)
    for _ in range(10):
        again = ops.multi_tensor_l2norm(xs, flag("cuda"), True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.cuda
def test_l2norm_more_tensors_than_one_launch_holds(strict_kernels):
    """Past the harness's tensors per launch and the finalizer's tensors per launch."""
    xs = [rand(int(n), torch.float32, "cuda") for n in torch.randint(1, 50, (9000,))]
    xs[4000] = rand(200_000, torch.float32, "cuda")
    for name in ("l2norm", "l2norm_scale"):
        got, mul = run_norm(name, xs, flag("cuda"), True)
        check_norms(got, xs, True, mul)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_l2norm_over_2_pow_31_elements(strict_kernels):
    n = 2**31 + 17
    x = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-4, 4)
    small = rand(1000, torch.float16, "cuda")
    noop = flag("cuda")
    total, per = ops.multi_tensor_l2norm([small, x], noop, True)
    assert noop.item() == 0
    sq = sum(torch.linalg.vector_norm(s, dtype=torch.float64) ** 2 for s in x.split(1 << 28))
    torch.testing.assert_close(per[1].double(), sq.sqrt(), **NORM_TOL)
    torch.testing.assert_close(
        per[0].double(), torch.linalg.vector_norm(small.double()), **NORM_TOL
    )
    x[n - 1] = float("nan")  # the last element, past the 32-bit edge
    ops.multi_tensor_l2norm([x], noop)
    assert noop.item() == 1


@pytest.mark.cuda
def test_norm_on_second_gpu_uses_its_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    xs = [rand(n, torch.float32, "cuda:1") for n in (10, 70000)]
    total, per = ops.multi_tensor_l2norm(xs, flag("cuda:1"), True)
    assert total.device == per.device == torch.device("cuda:1")
    check_norms((total, per), xs, True)
