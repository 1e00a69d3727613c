"""update_scale_hysteresis: the op, its reference, its CUDA kernel and the legacy amp_C entry point,
against apex's rules written out as plain Python."""

import math

import pytest
import torch

import amp_C
from apex.multi_tensor_apply import ops, reference
from apex.multi_tensor_apply.testing import opcheck
from conftest import devices

FLT_MAX = torch.finfo(torch.float32).max


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().item()


def oracle(scale, growth, hyst, found, growth_factor, backoff_factor, interval, hysteresis):
    """apex's update_scale_hysteresis, one step, on Python numbers."""
    if found:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
        return f32(scale * backoff_factor), 0, hyst
    growth += 1
    if growth == interval:
        grown = f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0, hysteresis
    return scale, growth, hysteresis


def scaler_state(device, scale=65536.0, growth=0, hyst=2):
    return (
        torch.tensor([scale], dtype=torch.float32, device=device),
        torch.tensor([growth], dtype=torch.int32, device=device),
        torch.tensor([hyst], dtype=torch.int32, device=device),
    )


def found_inf(device, value):
    return torch.tensor([value], dtype=torch.float32, device=device)


def read(scale, growth, hyst):
    return scale.item(), int(growth.item()), int(hyst.item())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "growth_factor,backoff_factor,interval,hysteresis",
    [(2.0, 0.5, 3, 2), (2.0, 0.5, 1, 1), (1.5, 0.3, 4, 3), (2.0, 0.5, 2000, 2)],
)
def test_update_scale_follows_apex_rules(
    device, growth_factor, backoff_factor, interval, hysteresis, strict_kernels
):
    """A random run of overflowing and finite steps, with runs of overflows long and short."""
    s, g, h = scaler_state(device, hyst=hysteresis)
    want = read(s, g, h)
    pattern = (torch.rand(300) < 0.3).tolist() + [True] * 6 + [False] * 9 + [True, False] * 5
    for found in pattern:
        out = ops.update_scale_hysteresis(
            s,
            g,
            h,
            found_inf(device, float(found)),
            growth_factor,
            backoff_factor,
            interval,
            hysteresis,
        )
        assert out is s
        want = oracle(*want, found, growth_factor, backoff_factor, interval, hysteresis)
        assert read(s, g, h) == want


@pytest.mark.parametrize("device", devices())
def test_update_scale_hysteresis_delays_backoff(device, strict_kernels):
    s, g, h = scaler_state(device, scale=1024.0, growth=5, hyst=3)
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 1.0), 2.0, 0.5, 100, 3)
    assert read(s, g, h) == (1024.0, 0, 2)  # first overflow: no backoff, growth reset
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 1.0), 2.0, 0.5, 100, 3)
    assert read(s, g, h) == (1024.0, 0, 1)
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 1.0), 2.0, 0.5, 100, 3)
    assert read(s, g, h) == (512.0, 0, 0)  # third in a row: back off
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 1.0), 2.0, 0.5, 100, 3)
    assert read(s, g, h) == (256.0, 0, -1)  # and every further one, the tracker going negative
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 0.0), 2.0, 0.5, 100, 3)
    assert read(s, g, h) == (256.0, 1, 3)  # a finite step resets the hysteresis


@pytest.mark.parametrize("device", devices())
def test_update_scale_never_grows_into_inf(device, strict_kernels):
    s, g, h = scaler_state(device, scale=FLT_MAX / 1.5, growth=1, hyst=2)
    ops.update_scale_hysteresis(s, g, h, found_inf(device, 0.0), 2.0, 0.5, 2, 2)
    assert read(s, g, h) == (f32(FLT_MAX / 1.5), 0, 2)  # not grown, tracker reset all the same


@pytest.mark.parametrize("device", devices())
def test_update_scale_backoff_has_no_floor(device, strict_kernels):
    s, g, h = scaler_state(device, scale=1e-44, hyst=1)  # a float32 subnormal
    for _ in range(3):
        ops.update_scale_hysteresis(s, g, h, found_inf(device, 1.0), 2.0, 0.25, 10, 1)
    assert s.item() == 0.0


@pytest.mark.parametrize("device", devices())
def test_update_scale_nan_found_inf_counts_as_overflow(device, strict_kernels):
    s, g, h = scaler_state(device, scale=8.0, growth=3, hyst=1)
    ops.update_scale_hysteresis(s, g, h, found_inf(device, float("nan")), 2.0, 0.5, 10, 1)
    assert read(s, g, h) == (4.0, 0, 0)


@pytest.mark.parametrize("device", devices())
def test_legacy_amp_C_update_scale_hysteresis(device, strict_kernels):
    s, g, h = scaler_state(device, scale=4.0, growth=1, hyst=2)
    out = amp_C.update_scale_hysteresis(s, g, h, found_inf(device, 0.0), 2.0, 0.5, 2, 2)
    assert out is s  # apex returns current_scale, updated in place
    assert read(s, g, h) == (8.0, 0, 2)


# ---- bad input ------------------------------------------------------------------------------------


def _bad_cases(device):
    s, g, h = scaler_state(device)
    inf = found_inf(device, 0.0)
    return [
        (
            (s.double(), g, h, inf),
            TypeError,
            "current_scale must be a torch.float32 tensor, got torch.float64",
        ),
        (
            (s, g.long(), h, inf),
            TypeError,
            "growth_tracker must be a torch.int32 tensor, got torch.int64",
        ),
        (
            (s, g, h.float(), inf),
            TypeError,
            "hysteresis_tracker must be a torch.int32 tensor, got torch.float32",
        ),
        (
            (s, g, h, inf.int()),
            TypeError,
            "found_inf must be a torch.float32 tensor, got torch.int32",
        ),
        (
            (s, g, h, found_inf(device, 0.0).repeat(2)),
            ValueError,
            "found_inf must have exactly one element, got 2",
        ),
        (
            (s.new_empty(0), g, h, inf),
            ValueError,
            "current_scale must have exactly one element, got 0",
        ),
    ]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", range(6))
def test_update_scale_bad_input(device, case, strict_kernels):
    args, exc, words = _bad_cases(device)[case]
    before = [a.clone() for a in args]
    with pytest.raises(exc, match=f"update_scale_hysteresis: {words}"):
        ops.update_scale_hysteresis(*args, 2.0, 0.5, 10, 2)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_update_scale_mixed_devices_refused(strict_kernels):
    s, g, h = scaler_state("cuda")
    with pytest.raises(ValueError, match="found_inf is on cpu but current_scale is on cuda:0"):
        ops.update_scale_hysteresis(s, g, h, found_inf("cpu", 0.0), 2.0, 0.5, 10, 2)
    with pytest.raises(ValueError, match="growth_tracker is on cpu but current_scale is on cuda"):
        ops.update_scale_hysteresis(s, g.cpu(), h, found_inf("cuda", 0.0), 2.0, 0.5, 10, 2)


# ---- the op contract: opcheck, torch.compile, CUDA graphs ---------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_update_scale_opcheck(device, found, strict_kernels):
    opcheck(
        torch.ops.apex_mta.update_scale_hysteresis.default,
        (*scaler_state(device, growth=1), found_inf(device, found), 2.0, 0.5, 2, 2),
    )


@pytest.mark.parametrize("device", devices())
def test_update_scale_under_torch_compile_fullgraph(device, strict_kernels):
    backend = "inductor" if device == "cuda" else "aot_eager"

    @torch.compile(fullgraph=True, backend=backend)
    def update(s, g, h, inf):
        ops.update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 2, 2)
        return s * 3

    s, g, h = scaler_state(device, scale=4.0, growth=1)
    y = update(s, g, h, found_inf(device, 0.0))
    assert read(s, g, h) == (8.0, 0, 2)
    assert y.item() == 24.0


@pytest.mark.cuda
def test_update_scale_captured_in_cuda_graph(strict_kernels):
    s, g, h = scaler_state("cuda", scale=1024.0, hyst=2)
    inf = found_inf("cuda", 0.0)
    ops.update_scale_hysteresis(*scaler_state("cuda"), inf, 2.0, 0.5, 2, 2)  # load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 2, 2)
    want = read(s, g, h)
    for found in [0, 0, 1, 1, 1, 0, 1, 0, 0]:
        inf.fill_(found)
        graph.replay()
        want = oracle(*want, found, 2.0, 0.5, 2, 2)
        assert read(s, g, h) == want


@pytest.mark.cuda
def test_update_scale_cuda_matches_reference(strict_kernels):
    for _ in range(50):
        scale = float(2 ** torch.randint(-10, 30, ()).item())
        growth, hyst = torch.randint(0, 5, (2,)).tolist()
        found = float(torch.rand(()) < 0.5)
        a = scaler_state("cuda", scale, growth, hyst)
        b = [t.clone() for t in a]
        ops.update_scale_hysteresis(*a, found_inf("cuda", found), 2.0, 0.5, 4, 3)
        reference.update_scale_hysteresis(*b, found_inf("cuda", found), 2.0, 0.5, 4, 3)
        assert read(*a) == read(*b)
