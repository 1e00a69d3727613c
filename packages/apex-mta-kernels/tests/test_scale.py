"""multi_tensor_scale: the op, its reference, its CUDA kernel and the legacy amp_C entry point."""

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import needs_list_functionalization, opcheck
from conftest import DTYPES, devices

SIZES = [1, 7, 97, 4099, 65536, 65537, 3 * 65536 + 13]


def rand(n, dtype, device, shape=None):
    return torch.randn(shape or (n,), device=device).to(dtype)


def expected(x, scale, dtype):
    return (x.float() * scale).to(dtype)


def flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("din", DTYPES)
@pytest.mark.parametrize("dout", DTYPES)
def test_scale_matches_float32_math(device, din, dout, strict_kernels):
    xs = [rand(n, din, device) for n in SIZES]
    outs = [torch.full((n,), float("nan"), device=device, dtype=dout) for n in SIZES]  # poisoned
    noop = flag(device)
    ops.multi_tensor_scale(xs, outs, noop, 0.37)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 0.37, dout), atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
def test_scale_in_place_many_small_and_zero_size(device, strict_kernels):
    xs = [rand(int(n), torch.float32, device) for n in torch.randint(0, 300, (2000,))]
    xs[5] = torch.empty(0, device=device)
    want = [expected(x, -2.5, torch.float32) for x in xs]
    noop = flag(device)
    ops.multi_tensor_scale(xs, xs, noop, -2.5)
    for x, w in zip(xs, want):
        torch.testing.assert_close(x, w, atol=0, rtol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("device", devices())
def test_scale_mixed_dtype_lists_are_grouped(device, strict_kernels):
    dts = [DTYPES[i % 3] for i in range(9)]
    xs = [rand(1000 + i, d, device) for i, d in enumerate(dts)]
    outs = [torch.empty(1000 + i, device=device, dtype=DTYPES[(i + 1) % 3]) for i in range(9)]
    ops.multi_tensor_scale(xs, outs, flag(device), 3.0)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 3.0, out.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
def test_scale_channels_last(device, strict_kernels):
    x = rand(0, torch.bfloat16, device, shape=(3, 5, 7, 11)).to(memory_format=torch.channels_last)
    out = torch.empty_like(x)  # keeps channels_last
    ops.multi_tensor_scale([x], [out], flag(device), 0.5)
    torch.testing.assert_close(out, expected(x, 0.5, torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_scale_flags_nonfinite_and_never_clears(device, bad, strict_kernels):
    xs = [rand(n, torch.float16, device) for n in (10, 70000)]
    xs[1][69999] = bad
    outs = [torch.empty_like(x) for x in xs]
    noop = flag(device)
    ops.multi_tensor_scale(xs, outs, noop, 2.0)
    assert noop.item() == 1
    torch.testing.assert_close(outs[0], expected(xs[0], 2.0, torch.float16))  # still written
    xs[1][69999] = 1.0
    ops.multi_tensor_scale(xs, outs, noop, 2.0)
    assert noop.item() == 1  # the kernels never clear the flag: callers zero it


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_scale(device, strict_kernels):
    xs = [rand(n, torch.float32, device) for n in (3, 65537)]
    outs = [torch.empty(n, device=device, dtype=torch.float16) for n in (3, 65537)]
    noop = torch.zeros((1, 1), dtype=torch.int32, device=device)  # fairseq passes (1, 1)
    assert amp_C.multi_tensor_scale(2048 * 32, noop, [xs, outs], 0.125) is None
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 0.125, torch.float16), atol=0, rtol=0)
    with pytest.raises(ValueError, match="tensor_lists must hold 2 lists, got 3"):
        amp_C.multi_tensor_scale(2048 * 32, noop, [xs, outs, outs], 0.125)


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_writes_into_params_that_require_grad(device, strict_kernels):
    """apex's amp_C is C++ below autograd: code that passes Parameters outside no_grad (apex's
    own FusedSGD did: `[grads, params, momenta]`) works, and norms come back without a grad_fn."""
    ps = [torch.nn.Parameter(rand(n, torch.float32, device)) for n in (3, 65537)]
    before = [p.detach().clone() for p in ps]
    noop = flag(device)
    assert torch.is_grad_enabled()
    amp_C.multi_tensor_scale(2048 * 32, noop, [ps, ps], 0.5)
    for p, b in zip(ps, before):
        torch.testing.assert_close(p.detach(), b * 0.5, atol=0, rtol=0)
    gs = [torch.ones_like(p) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    amp_C.multi_tensor_sgd(2048 * 32, noop, [gs, ps, ms], 0.0, 0.0, 0.0, 0.1, False, True, False)
    for p, b in zip(ps, before):
        torch.testing.assert_close(p.detach(), b * 0.5 - 0.1)
    total, per = amp_C.multi_tensor_l2norm(2048 * 32, noop, [ps], True)
    assert total.grad_fn is None and per.grad_fn is None and not total.requires_grad
    assert all(p.requires_grad and p.grad is None for p in ps)


@pytest.mark.parametrize("device", devices())
def test_scale_empty_lists_are_a_no_op(device, strict_kernels):
    noop = flag(device)
    ops.multi_tensor_scale([], [], noop, 2.0)
    assert noop.item() == 0


# ---- bad input: a clear exception before any kernel runs, nothing written ----------------------


def _bad_cases(device):
    x = lambda n=8, dt=torch.float32: rand(n, dt, device)  # noqa: E731
    return [
        (
            "lengths",
            [x(), x()],
            [x()],
            flag(device),
            ValueError,
            "outputs has 1 tensors but inputs has 2; the lists must be the same length",
        ),
        (
            "sizes",
            [x(8)],
            [x(9)],
            flag(device),
            ValueError,
            "outputs\\[0\\] has 9 elements but inputs\\[0\\] has 8",
        ),
        (
            "dtype",
            [x(8, torch.float64)],
            [x()],
            flag(device),
            TypeError,
            "inputs\\[0\\] has dtype torch.float64; supported: float32, float16, bfloat16",
        ),
        (
            "noop dtype",
            [x()],
            [x()],
            torch.zeros(1, device=device),
            TypeError,
            "noop_flag must be an int32 tensor, got torch.float32",
        ),
        (
            "noop empty",
            [x()],
            [x()],
            torch.zeros(0, dtype=torch.int32, device=device),
            ValueError,
            "noop_flag must have at least one element",
        ),
        (
            "non-contiguous",
            [rand(0, torch.float32, device, (4, 6)).t()],
            [x(24).view(6, 4)],
            flag(device),
            ValueError,
            "inputs\\[0\\] is not contiguous",
        ),
        (
            "layouts",
            [rand(0, torch.float32, device, (2, 3, 4, 5))],
            [rand(0, torch.float32, device, (2, 3, 4, 5)).to(memory_format=torch.channels_last)],
            flag(device),
            ValueError,
            "tensors at one position must share a memory format",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(7))
def test_scale_bad_input(device, case, strict_kernels):
    name, ins, outs, noop, exc, words = _bad_cases(device)[case]
    before = [o.clone() for o in outs]
    with pytest.raises(exc, match=words):
        ops.multi_tensor_scale(ins, outs, noop, 2.0)
    for o, b in zip(outs, before):
        assert torch.equal(o.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


@pytest.mark.cuda
def test_scale_mixed_devices_refused(strict_kernels):
    cuda, cpu = torch.randn(8, device="cuda"), torch.randn(8)
    with pytest.raises(ValueError, match="outputs\\[0\\] is on cpu but noop_flag is on cuda:0"):
        ops.multi_tensor_scale([cuda], [cpu], flag("cuda"), 2.0)
    with pytest.raises(ValueError, match="noop_flag is on cpu"):
        ops.multi_tensor_scale([cuda], [cuda.clone()], flag("cpu"), 2.0)


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


@pytest.mark.parametrize("device", devices())
def test_scale_opcheck(device, strict_kernels):
    xs = [rand(n, d, device) for n, d in zip((5, 70000, 1), DTYPES)]
    outs = [torch.empty_like(x) for x in xs]
    opcheck(torch.ops.apex_mta.multi_tensor_scale.default, (xs, outs, flag(device), 0.5))


@needs_list_functionalization
@pytest.mark.parametrize("device", devices())
def test_scale_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def step(xs, outs, noop):
        ops.multi_tensor_scale(xs, outs, noop, 4.0)
        return outs[0] + 1

    xs = [rand(n, torch.bfloat16, device) for n in (17, 65539)]
    outs = [torch.empty_like(x) for x in xs]
    noop = flag(device)
    y = step(xs, outs, noop)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 4.0, torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(y, outs[0] + 1)


@pytest.mark.parametrize("device", devices())
def test_scale_under_torch_compile_on_every_torch(device, strict_kernels):
    # Without fullgraph, on every supported torch: on 2.3 the graph breaks around the op (it
    # mutates a Tensor[] argument) and the op runs eagerly; the results are the same.
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(backend=backend)
    def step(xs, outs, noop):
        y = xs[0] * 2
        ops.multi_tensor_scale(xs, outs, noop, 4.0)
        return y + outs[0]

    xs = [rand(n, torch.float32, device) for n in (17, 65539)]
    outs = [torch.empty_like(x) for x in xs]
    y = step(xs, outs, flag(device))
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 4.0, torch.float32), atol=0, rtol=0)
    torch.testing.assert_close(y, xs[0] * 2 + outs[0])


@pytest.mark.cuda
def test_scale_captured_in_cuda_graph(strict_kernels):
    xs = [rand(n, torch.float32, "cuda") for n in (100, 65536 * 2 + 1)]
    outs = [torch.empty_like(x) for x in xs]
    noop = flag("cuda")
    ops.multi_tensor_scale(xs, outs, noop, 0.5)  # load the library before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.multi_tensor_scale(xs, outs, noop, 0.5)
    for x in xs:
        x.copy_(torch.randn_like(x))
    g.replay()
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 0.5, torch.float32), atol=0, rtol=0)


@pytest.mark.cuda
def test_scale_cuda_matches_reference_on_random_lists(strict_kernels):
    for _ in range(5):
        n = int(torch.randint(1, 40, ()))
        sizes = torch.randint(0, 200_000, (n,)).tolist()
        dts = [DTYPES[int(i)] for i in torch.randint(0, 3, (n,))]
        xs = [rand(s, d, "cuda") for s, d in zip(sizes, dts)]
        a = [torch.empty_like(x) for x in xs]
        b = [torch.empty_like(x) for x in xs]
        fa, fb = flag("cuda"), flag("cuda")
        ops.multi_tensor_scale(xs, a, fa, 1.7)
        reference.multi_tensor_scale(xs, b, fb, 1.7)
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, atol=0, rtol=0)
        assert fa.item() == fb.item() == 0


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.big_memory
def test_scale_over_2_pow_31_elements(strict_kernels):
    n = 2**31 + 17
    x = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-4, 4)
    out = torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
    noop = flag("cuda")
    ops.multi_tensor_scale([x], [out], noop, 0.5)
    assert noop.item() == 0
    for sl in (slice(0, 1 << 20), slice(2**31 - (1 << 20), n)):  # both ends of the 32-bit edge
        torch.testing.assert_close(out[sl], expected(x[sl], 0.5, torch.float16), atol=0, rtol=0)
    assert not torch.isnan(out).any()


@pytest.mark.cuda
def test_scale_on_second_gpu_uses_its_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    xs = [rand(n, torch.float32, "cuda:1") for n in (10, 70000)]
    outs = [torch.empty_like(x) for x in xs]
    ops.multi_tensor_scale(xs, outs, flag("cuda:1"), 2.0)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, expected(x, 2.0, torch.float32), atol=0, rtol=0)


# Positions across a thread's vector lanes, its unrolled vectors, chunk boundaries and the tail,
# for the mixed-width vector path (a 16-bit role moves 8 bytes beside a float32 one's 16).
LANE_POSITIONS = [0, 1, 3, 4, 7, 8, 2047, 2048, 16383, 16384, 65535, 65536, 131071, 131072 + 4098]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "din,dout",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "unaligned"])
def test_scale_mixed_width_flags_and_writes_every_position(
    device, din, dout, offset, strict_kernels
):
    n = 2 * 65536 + 4099  # two whole chunks and a tail
    base = rand(n + offset, din, device)
    noop = flag(device)
    out = torch.full((n,), float("nan"), device=device, dtype=dout)
    ops.multi_tensor_scale([base[offset:]], [out], noop, 0.5)
    assert noop.item() == 0
    torch.testing.assert_close(out, expected(base[offset:], 0.5, dout), atol=0, rtol=0)
    for pos in LANE_POSITIONS:
        x = base[offset:].clone() if offset == 0 else base.clone()[offset:]
        x[pos] = float("inf") if pos % 2 else float("nan")
        out = torch.full((n,), 7.0, device=device, dtype=dout)
        noop = flag(device)
        ops.multi_tensor_scale([x], [out], noop, 0.5)
        assert noop.item() == 1, pos
        # written all the same, non-finite element included, as apex's kernel does
        torch.testing.assert_close(out, expected(x, 0.5, dout), atol=0, rtol=0, equal_nan=True)
