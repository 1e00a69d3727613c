"""multi_tensor_axpby: the op, its reference, its CUDA kernel and the legacy amp_C entry point."""

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def expected(x, y, a, b, dtype):
    """Float32 math, each product and the sum rounded in turn."""
    return (x.float() * a + y.float() * b).to(dtype)


def flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dx", DTYPES)
@pytest.mark.parametrize("dy", DTYPES)
@pytest.mark.parametrize("dout", DTYPES)
def test_axpby_matches_float32_math(device, dx, dy, dout, strict_kernels):
    xs = [rand(n, dx, device) for n in SIZES]
    ys = [rand(n, dy, device) for n in SIZES]
    outs = [torch.full((n,), float("nan"), device=device, dtype=dout) for n in SIZES]  # poisoned
    noop = flag(device)
    ops.multi_tensor_axpby(xs, ys, outs, noop, 0.37, -1.9, -1)
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 0.37, -1.9, dout), atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("into", ["x", "y"])
def test_axpby_in_place(device, into, strict_kernels):
    """amp accumulates master grads with out = y: [model_grads, master_grads, master_grads]."""
    xs = [rand(n, torch.float16, device) for n in (3, 65536 + 1)]
    ys = [rand(n, torch.float32, device) for n in (3, 65536 + 1)]
    outs = xs if into == "x" else ys
    want = [expected(x, y, 1 / 128, 1.0, o.dtype) for x, y, o in zip(xs, ys, outs)]
    ops.multi_tensor_axpby(xs, ys, outs, flag(device), 1 / 128, 1.0, 0)
    for o, w in zip(outs, want):
        torch.testing.assert_close(o, w, atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
def test_axpby_many_small_zero_size_and_mixed_dtypes(device, strict_kernels):
    sizes = torch.randint(0, 300, (2000,)).tolist()
    sizes[5] = 0
    dts = [(DTYPES[i % 3], DTYPES[(i // 3) % 3], DTYPES[(i // 9) % 3]) for i in range(len(sizes))]
    xs = [rand(n, d[0], device) for n, d in zip(sizes, dts)]
    ys = [rand(n, d[1], device) for n, d in zip(sizes, dts)]
    outs = [torch.empty(n, device=device, dtype=d[2]) for n, d in zip(sizes, dts)]
    noop = flag(device)
    ops.multi_tensor_axpby(xs, ys, outs, noop, 2.0, 0.5, -1)
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 2.0, 0.5, out.dtype), atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
def test_axpby_channels_last_and_misaligned(device, strict_kernels):
    shape = (3, 5, 7, 11)
    x = rand(0, torch.bfloat16, device, shape).to(memory_format=torch.channels_last)
    y = rand(0, torch.float32, device, shape).to(memory_format=torch.channels_last)
    out = torch.empty_like(x)
    base = rand(70_003, torch.float16, device)
    xs, ys, outs = [x, base[1:70_001]], [y, base[3:]], [out, torch.empty(70_000, device=device)]
    ops.multi_tensor_axpby(xs, ys, outs, flag(device), 3.0, -1.0, -1)
    for xi, yi, o in zip(xs, ys, outs):
        torch.testing.assert_close(o, expected(xi, yi, 3.0, -1.0, o.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
def test_axpby_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    ops.multi_tensor_axpby([], [], [], noop, 2.0, 1.0, -1)
    assert noop.item() == 0


# ---- the overflow flag and arg_to_check --------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize(
    ("where", "arg_to_check", "flagged"),
    [
        ("x", -1, True),
        ("y", -1, True),
        ("x", 0, True),
        ("y", 0, False),
        ("x", 1, False),
        ("y", 1, True),
    ],
)
def test_axpby_flag_follows_arg_to_check(device, bad, where, arg_to_check, flagged, strict_kernels):
    xs = [rand(n, torch.bfloat16, device) for n in (10, 70000)]
    ys = [rand(n, torch.float32, device) for n in (10, 70000)]
    (xs if where == "x" else ys)[1][69999] = bad
    outs = [torch.empty_like(x) for x in xs]
    noop = flag(device)
    ops.multi_tensor_axpby(xs, ys, outs, noop, 1.5, 0.25, arg_to_check)
    assert noop.item() == int(flagged)
    for x, y, out in zip(xs, ys, outs):  # written either way
        torch.testing.assert_close(
            out, expected(x, y, 1.5, 0.25, torch.bfloat16), atol=0, rtol=0, equal_nan=True
        )


@pytest.mark.parametrize("device", devices())
def test_axpby_never_clears_the_flag(device, strict_kernels):
    xs, ys = [rand(100, torch.float32, device)], [rand(100, torch.float32, device)]
    noop = flag(device)
    noop[0] = 1
    ops.multi_tensor_axpby(xs, ys, [torch.empty(100, device=device)], noop, 1.0, 1.0, -1)
    assert noop.item() == 1


# ---- bad input: a clear exception before any kernel runs, nothing written ----------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    return [
        (
            [x(), x()],
            [x()],
            [x(), x()],
            flag(device),
            -1,
            ValueError,
            "y has 1 tensors but x has 2; the lists must be the same length",
        ),
        (
            [x(8)],
            [x(8)],
            [x(9)],
            flag(device),
            -1,
            ValueError,
            "outputs\\[0\\] has 9 elements but x\\[0\\] has 8",
        ),
        (
            [x(8)],
            [x(8, torch.float64)],
            [x()],
            flag(device),
            -1,
            TypeError,
            "y\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            [x()],
            [x()],
            [x()],
            torch.zeros(1, device=device),
            -1,
            TypeError,
            "noop_flag must be an int32 tensor, got torch.float32",
        ),
        (
            [x()],
            [rand(0, torch.float32, device, (2, 4)).t()],
            [x()],
            flag(device),
            -1,
            ValueError,
            "y\\[0\\] is not contiguous",
        ),
        (
            [x()],
            [x()],
            [x()],
            flag(device),
            2,
            ValueError,
            "multi_tensor_axpby: arg_to_check must be -1 \\(check x and y\\), 0 \\(x\\) or 1 \\(y\\), "
            "got 2",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(6))
def test_axpby_bad_input(device, case, strict_kernels):
    xs, ys, outs, noop, arg, exc, words = _bad_cases(device)[case]
    before = [o.clone() for o in outs]
    with pytest.raises(exc, match=words):
        ops.multi_tensor_axpby(xs, ys, outs, noop, 2.0, 1.0, arg)
    for o, b in zip(outs, before):
        assert torch.equal(o, b)


@pytest.mark.cuda
def test_axpby_mixed_devices_refused(strict_kernels):
    cuda = torch.randn(8, device="cuda")
    with pytest.raises(ValueError, match="y\\[0\\] is on cpu but noop_flag is on cuda:0"):
        ops.multi_tensor_axpby([cuda], [torch.randn(8)], [cuda.clone()], flag("cuda"), 1.0, 1.0, -1)


# ---- legacy amp_C ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_axpby(device, strict_kernels):
    xs = [rand(n, torch.float16, device) for n in (3, 65537)]
    ys = [rand(n, torch.float32, device) for n in (3, 65537)]
    outs = [torch.empty(n, device=device) for n in (3, 65537)]
    noop = torch.zeros((1, 1), dtype=torch.int32, device=device)
    assert amp_C.multi_tensor_axpby(65536, noop, [xs, ys, outs], 0.5, 2.0, 0) is None
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 0.5, 2.0, torch.float32), atol=0, rtol=0)
    assert noop.item() == 0
    with pytest.raises(
        ValueError, match="multi_tensor_axpby: tensor_lists must hold 3 lists, got 2"
    ):
        amp_C.multi_tensor_axpby(65536, noop, [xs, ys], 0.5, 2.0, 0)


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


@pytest.mark.parametrize("device", devices())
def test_axpby_opcheck(device, strict_kernels):
    xs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    ys = [rand(n, d, device) for n, d in zip((5, 70000, 1), reversed(DTYPES))]
    outs = [torch.empty_like(x) for x in xs]
    opcheck(
        torch.ops.apex_mta.multi_tensor_axpby.default, (xs, ys, outs, flag(device), 0.5, 2.0, -1)
    )


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_axpby_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def step(xs, ys, outs, noop):
        ops.multi_tensor_axpby(xs, ys, outs, noop, 4.0, -1.0, -1)
        return outs[0] + 1

    xs = [rand(n, torch.bfloat16, device) for n in (17, 65539)]
    ys = [rand(n, torch.float32, device) for n in (17, 65539)]
    outs = [torch.empty_like(x) for x in xs]
    noop = flag(device)
    r = step(xs, ys, outs, noop)
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 4.0, -1.0, torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(r, outs[0] + 1)
    assert noop.item() == 0


@pytest.mark.cuda
def test_axpby_captured_in_cuda_graph(strict_kernels):
    xs = [rand(n, torch.float16, "cuda") for n in (100, 65536 * 2 + 1)]
    ys = [rand(n, torch.float16, "cuda") for n in (100, 65536 * 2 + 1)]
    outs = [torch.empty_like(x) for x in xs]
    noop = flag("cuda")
    ops.multi_tensor_axpby(xs, ys, outs, noop, 0.5, 1.0, -1)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.multi_tensor_axpby(xs, ys, outs, noop, 0.5, 1.0, -1)
    for x in xs:
        x.copy_(torch.randn_like(x))
    g.replay()
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 0.5, 1.0, torch.float16), atol=0, rtol=0)


@pytest.mark.cuda
def test_axpby_cuda_matches_reference_on_random_lists(strict_kernels):
    for _ in range(5):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        pick = lambda n=n: [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]  # noqa: E731
        xs = [rand(s, d, "cuda") for s, d in zip(sizes, pick())]
        ys = [rand(s, d, "cuda") for s, d in zip(sizes, pick())]
        douts = pick()
        a = [torch.empty(s, device="cuda", dtype=d) for s, d in zip(sizes, douts)]
        b = [torch.empty(s, device="cuda", dtype=d) for s, d in zip(sizes, douts)]
        fa, fb = flag("cuda"), flag("cuda")
        ops.multi_tensor_axpby(xs, ys, a, fa, 1.7, -0.3, -1)
        reference.multi_tensor_axpby(xs, ys, b, fb, 1.7, -0.3, -1)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, atol=0, rtol=0)
        assert fa.item() == fb.item() == 0


@pytest.mark.cuda
def test_axpby_more_tensors_than_one_launch_holds(strict_kernels):
    sizes = torch.randint(1, 50, (3000,)).tolist()
    xs = [rand(n, torch.float32, "cuda") for n in sizes]
    ys = [rand(n, torch.float16, "cuda") for n in sizes]
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    ops.multi_tensor_axpby(xs, ys, outs, flag("cuda"), 0.5, 0.5, -1)
    for x, y, out in zip(xs, ys, outs):
        torch.testing.assert_close(out, expected(x, y, 0.5, 0.5, torch.bfloat16), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_axpby_over_2_pow_31_elements(strict_kernels):
    n = 2**31 + 17
    x = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-4, 4)
    y = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-4, 4)
    out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    noop = flag("cuda")
    ops.multi_tensor_axpby([x], [y], [out], noop, 0.5, -2.0, -1)
    assert noop.item() == 0
    for sl in (slice(0, 1 << 20), slice(2**31 - (1 << 20), n)):  # both ends of the 32-bit edge
        torch.testing.assert_close(
            out[sl], expected(x[sl], y[sl], 0.5, -2.0, torch.float16), atol=0, rtol=0
        )
    assert not torch.isnan(out).any()
    y[n - 1] = float("inf")
    ops.multi_tensor_axpby([x], [y], [out], noop, 0.5, -2.0, 1)
    assert noop.item() == 1


# Positions across a thread's vector lanes, its unrolled vectors, chunk boundaries and the tail,
# for the mixed-width vector path (a 16-bit role moves 8 bytes beside a float32 one's 16).
LANE_POSITIONS = [0, 1, 3, 4, 7, 8, 2047, 2048, 16383, 16384, 65535, 65536, 131071, 131072 + 4098]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "dx,dy,dout",
    [
        (torch.float16, torch.float32, torch.float32),  # amp: model grad + stashed master grad
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.float16, torch.bfloat16),
    ],
)
def test_axpby_mixed_width_flags_and_writes_every_position(device, dx, dy, dout, strict_kernels):
    n = 2 * 65536 + 4099  # two whole chunks and a tail
    x0, y = rand(n, dx, device), rand(n, dy, device)
    out = torch.full((n,), float("nan"), device=device, dtype=dout)
    noop = flag(device)
    ops.multi_tensor_axpby([x0], [y], [out], noop, 0.25, 1.0, 0)
    assert noop.item() == 0
    torch.testing.assert_close(out, expected(x0, y, 0.25, 1.0, dout), atol=0, rtol=0)
    for pos in LANE_POSITIONS:
        x = x0.clone()
        x[pos] = float("inf") if pos % 2 else float("nan")
        out = torch.full((n,), 7.0, device=device, dtype=dout)
        noop = flag(device)
        ops.multi_tensor_axpby([x], [y], [out], noop, 0.25, 1.0, 0)
        assert noop.item() == 1, pos
        torch.testing.assert_close(
            out, expected(x, y, 0.25, 1.0, dout), atol=0, rtol=0, equal_nan=True
        )
