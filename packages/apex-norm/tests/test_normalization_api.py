"""apex.normalization's API as clients use it: signatures, attributes, Mixed* keywords, the
legacy fused_layer_norm_cuda module, bad input, the ops under opcheck, torch.compile and ONNX."""

from __future__ import annotations

import importlib
import inspect
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from norm_testing import make, param, rms_norm, tol

import apex.normalization as norm
from apex.multi_tensor_apply.testing import opcheck
from apex.normalization import fused_layer_norm as fln
from apex.normalization import ops, reference


def test_exports_and_class_names():
    assert {"FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"} <= set(
        norm.__all__
    )
    assert norm.FusedRMSNorm.__name__ == "FusedRMSNorm"  # ColossalAI asserts it
    assert fln.FusedLayerNorm is norm.FusedLayerNorm


@pytest.mark.parametrize(
    "fn,args",
    [
        (
            fln.FusedLayerNormAffineFunction.forward,
            ["ctx", "input", "weight", "bias", "normalized_shape", "eps", "memory_efficient"],
        ),
        (
            fln.FusedLayerNormFunction.forward,
            ["ctx", "input", "normalized_shape", "eps", "memory_efficient"],
        ),
        (
            fln.FusedRMSNormAffineFunction.forward,
            ["ctx", "input", "weight", "normalized_shape", "eps", "memory_efficient"],
        ),
        (
            fln.FusedRMSNormFunction.forward,
            ["ctx", "input", "normalized_shape", "eps", "memory_efficient"],
        ),
        (
            fln.FusedLayerNormAffineMixedDtypesFunction.forward,
            ["ctx", "input", "weight", "bias", "normalized_shape", "eps", "memory_efficient"],
        ),
        (
            fln.FusedRMSNormAffineMixedDtypesFunction.forward,
            ["ctx", "input", "weight", "normalized_shape", "eps", "memory_efficient"],
        ),
    ],
)
def test_function_forward_argument_lists(fn, args):
    # Megatron-LM and gpt-neox check 'memory_efficient' in getfullargspec(...).args.
    assert inspect.getfullargspec(fn).args == args


@pytest.mark.parametrize(
    "fn,defaults",
    [
        (fln.fused_layer_norm_affine, {"eps": 1e-6, "memory_efficient": False}),
        (fln.fused_layer_norm, {"eps": 1e-6, "memory_efficient": False}),
        (fln.fused_rms_norm_affine, {"eps": 1e-6, "memory_efficient": False}),
        (fln.fused_rms_norm, {"eps": 1e-6, "memory_efficient": False}),
        (fln.mixed_dtype_fused_layer_norm_affine, {"eps": 1e-6, "memory_efficient": False}),
        (fln.mixed_dtype_fused_rms_norm_affine, {"eps": 1e-6, "memory_efficient": False}),
        (
            norm.FusedLayerNorm.__init__,
            {"eps": 1e-5, "elementwise_affine": True, "memory_efficient": False},
        ),
        (
            norm.FusedRMSNorm.__init__,
            {"eps": 1e-5, "elementwise_affine": True, "memory_efficient": False},
        ),
        (norm.MixedFusedLayerNorm.__init__, {"eps": 1e-5, "memory_efficient": False}),
    ],
)
def test_defaults(fn, defaults):
    params = inspect.signature(fn).parameters
    assert {k: params[k].default for k in defaults} == defaults


def test_module_attributes():
    m = norm.FusedLayerNorm(8)
    assert m.normalized_shape == torch.Size([8])
    assert (m.eps, m.elementwise_affine, m.memory_efficient) == (1e-5, True, False)
    assert torch.equal(m.weight, torch.ones(8)) and torch.equal(m.bias, torch.zeros(8))
    assert repr(m) == "FusedLayerNorm(torch.Size([8]), eps=1e-05, elementwise_affine=True)"
    n = norm.FusedLayerNorm((2, 3), elementwise_affine=False)
    assert n.weight is None and n.bias is None and list(n.state_dict()) == []
    r = norm.FusedRMSNorm([4, 5], eps=1e-6, memory_efficient=True)
    assert r.normalized_shape == torch.Size([4, 5]) and list(r.state_dict()) == ["weight"]
    assert r.memory_efficient


def test_numpy_ints_as_normalized_shape():
    """apex builds torch.Size(normalized_shape), which takes numpy ints (configs read by numpy)."""
    np = pytest.importorskip("numpy")
    m = norm.FusedLayerNorm(np.int64(8))
    assert m.normalized_shape == torch.Size([8]) and type(m.normalized_shape[0]) is int
    r = norm.FusedRMSNorm([np.int32(2), 4])
    assert r.normalized_shape == torch.Size([2, 4])
    x = make((3, 2, 4), torch.float32)
    torch.testing.assert_close(r(x), rms_norm(x, (2, 4), r.weight, 1e-5))
    y = fln.fused_layer_norm(x, (np.int64(2), np.int64(4)))
    torch.testing.assert_close(y, F.layer_norm(x, (2, 4), eps=1e-6))
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints"):
        norm.FusedLayerNorm((True, 4))


def test_mixed_keywords():
    # NeMo passes a misspelled keyword that apex ignores.
    m = norm.MixedFusedLayerNorm(16, 1e-5, sequence_parallel_enbaled=True)
    assert m.elementwise_affine and m.bias is not None
    with pytest.warns(UserWarning, match="elementwise_affine"):
        norm.MixedFusedRMSNorm(16, elementwise_affine=True)
    with pytest.raises(RuntimeError, match="elementwise_affine=False"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            norm.MixedFusedLayerNorm(16, elementwise_affine=False)


def test_megatron_call():
    x = make((4, 2, 16), torch.float32, requires_grad=True)
    w, b = param((16,), torch.float32), param((16,), torch.float32)
    y = fln.FusedLayerNormAffineFunction.apply(x, w + 1, b, torch.Size([16]), 1e-5, True)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w + 1, b, 1e-5))
    y.sum().backward()
    assert w.grad is not None and b.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_legacy_extension_module(device):
    flc = importlib.import_module("fused_layer_norm_cuda")
    x = make((6, 16), torch.float32, device, requires_grad=True)
    w, b = param((16,), torch.float32, device), param((16,), torch.float32, device)
    out, mean, invvar = flc.forward_affine(x.detach(), (16,), w.detach(), b.detach(), 1e-5)
    expected = F.layer_norm(x, (16,), w, b, 1e-5)
    torch.testing.assert_close(out, expected.detach())
    dy = torch.randn_like(out)
    want = torch.autograd.grad(expected, [x, w, b], dy)
    # 8-argument form (pre-2023 callers) and 9-argument forms, input or output saved.
    for got in (
        flc.backward_affine(dy, mean, invvar, x.detach(), (16,), w.detach(), b.detach(), 1e-5),
        flc.backward_affine(dy, None, invvar, out, (16,), w.detach(), b.detach(), 1e-5, True),
    ):
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    out, invvar = flc.rms_forward_affine(x.detach(), (16,), w.detach(), 1e-5)
    expected = rms_norm(x, (16,), w, 1e-5)
    torch.testing.assert_close(out, expected.detach())
    want = torch.autograd.grad(expected, [x, w], dy)
    got = flc.rms_backward_affine(dy, invvar, out, (16,), w.detach(), 1e-5, True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    gi = flc.rms_backward(dy, flc.rms_forward(x.detach(), (16,), 1e-5)[1], x.detach(), (16,), 1e-5)
    torch.testing.assert_close(gi, torch.autograd.grad(rms_norm(x, (16,), None, 1e-5), [x], dy)[0])
    o16, _, _ = flc.forward_affine_mixed_dtypes(
        x.detach(), (16,), w.detach().half(), b.detach().half(), 1e-5
    )
    assert o16.dtype == torch.float16


# -- bad input -----------------------------------------------------------------------------------


def test_tuning_notes_of_the_loaded_library_become_warnings(monkeypatch):
    """Once apex_norm_C is loaded, each line it gives about APEX_NORM_TUNE (what it did not take)
    is one UserWarning; a library without that entry point gives none."""
    import ctypes
    from types import SimpleNamespace

    from apex.multi_tensor_apply.build import loader

    assert ops._warn_tune_notes in loader._post_load[ops.NORM.name]
    lines = b"APEX_NORM_TUNE: unknown knob 'bogus' ignored\nAPEX_NORM_TUNE: bwd_wide=9 is outside 0..3: ignored\n"

    class Library:
        def __init__(self, path):
            assert path == "/lib/apex_norm_C.so"
            self.apex_norm_tune_notes = lambda: lines

    monkeypatch.setattr(ctypes, "CDLL", Library)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ops._warn_tune_notes(SimpleNamespace(path="/lib/apex_norm_C.so"))
    assert [str(w.message) for w in seen] == lines.decode().splitlines()
    assert all(w.category is UserWarning for w in seen)
    lines = b""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ops._warn_tune_notes(SimpleNamespace(path="/lib/apex_norm_C.so"))
        Library.__init__ = lambda self, path: None  # an older library: no such symbol
        ops._warn_tune_notes(SimpleNamespace(path="/lib/apex_norm_C.so"))
    assert seen == []


def test_tuning_notes_of_a_built_library(tmp_path):
    """The compiled library's own reading of APEX_NORM_TUNE, through ctypes as after a load:
    where a build of this source for this torch exists, in the package or in the kernel cache
    (the CUDA matrix cells build one, on a machine without a GPU), its notes for a bad variable
    are the warnings, and none for a good one."""
    import subprocess
    import sys

    from apex.multi_tensor_apply.build import loader

    lib = ops.NORM.prebuilt_dir / f"{ops.NORM.name}{loader.LIB_SUFFIX}"
    if not lib.is_file():
        lib = loader.find_cached(ops.NORM, ())
    if torch.version.cuda is None or lib is None:
        pytest.skip("no apex_norm_C built for this torch (nox -s cuda13_torch214 builds one)")
    script = tmp_path / "notes.py"
    script.write_text(
        "import warnings, torch\n"
        "from types import SimpleNamespace\n"
        "from apex.normalization import ops\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    ops._warn_tune_notes(SimpleNamespace(path={str(lib)!r}))\n"
        "for w in seen:\n"
        "    print('warned', w.category.__name__, w.message)\n"
    )
    for tune, expected in (
        (
            "bogus=1,bwd_lean=two,bwd_wide=4,fwd_hint=3,bwd_ring=3 ",
            [
                "warned UserWarning APEX_NORM_TUNE: unknown knob 'bogus' ignored",
                "warned UserWarning APEX_NORM_TUNE: bwd_lean='two' is not an integer: ignored",
                "warned UserWarning APEX_NORM_TUNE: bwd_wide=4 is outside 0..3: ignored",
                "warned UserWarning APEX_NORM_TUNE: fwd_hint=3 is not a hint set built (0, 4, 7): none",
            ],
        ),
        ("bwd_wide=1,fwd_hint=4", []),
    ):
        done = subprocess.run(
            [sys.executable, str(script)],
            env={**os.environ, "APEX_NORM_TUNE": tune},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        warned = [line for line in done.stdout.splitlines() if line.startswith("warned ")]
        assert warned == expected, (tune, done.stdout, done.stderr)


def test_normalized_shape_not_matching_input():
    with pytest.raises(
        ValueError,
        match=r"normalized_shape \[5\] does not match the trailing dimensions of input with shape \[2, 4\]",
    ):
        norm.FusedLayerNorm(5)(torch.randn(2, 4))
    with pytest.raises(ValueError, match="normalized_shape"):
        fln.fused_rms_norm(torch.randn(3), (2, 3))


def test_weight_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"weight has shape \[3\] but normalized_shape is \[4\]"):
        fln.fused_layer_norm_affine(torch.randn(2, 4), torch.ones(3), torch.zeros(4), (4,))
    with pytest.raises(ValueError, match=r"bias has shape \[5\]"):
        fln.fused_layer_norm_affine(torch.randn(2, 4), torch.ones(4), torch.zeros(5), (4,))


def test_integer_input():
    with pytest.raises(TypeError, match=r"input has dtype torch.int64; supported"):
        norm.FusedRMSNorm(4)(torch.arange(8).reshape(2, 4))
    with pytest.raises(TypeError, match=r"weight has dtype torch.int32"):
        fln.fused_rms_norm_affine(torch.randn(2, 4), torch.ones(4, dtype=torch.int32), (4,))


def test_normalized_shape_as_integer_tensors():
    """apex built torch.Size(normalized_shape), which takes integer tensors (1-D, or 0-dim
    elements): so do the modules and the functional forms."""
    x = torch.randn(2, 3, 4)
    for shape in (torch.tensor([4]), torch.tensor(4), [torch.tensor(3), torch.tensor(4)]):
        for cls in (norm.FusedLayerNorm, norm.FusedRMSNorm, norm.MixedFusedLayerNorm):
            m = cls(shape)
            assert isinstance(m.normalized_shape, torch.Size)
            assert m(x).shape == x.shape
        assert fln.fused_layer_norm(x, shape).shape == x.shape
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        norm.FusedLayerNorm(torch.tensor([4.0]))


def test_bad_normalized_shape_values():
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints"):
        fln.fused_layer_norm(torch.randn(2, 4), "4")
    with pytest.raises(ValueError, match="non-empty"):
        fln.fused_layer_norm(torch.randn(2, 4), ())


def test_weight_on_another_device():
    w = torch.ones(4, device="meta")
    with pytest.raises(ValueError, match="weight is on meta but input is on cpu"):
        fln.fused_rms_norm_affine(torch.randn(2, 4), w, (4,))


def test_bad_arguments_are_runtime_errors_too():
    """apex's checks (TORCH_CHECK) and torch's layer_norm raise RuntimeError, and code written
    against them catches that: ours are ValueError / TypeError and RuntimeError at once."""
    with pytest.raises(RuntimeError, match="does not match the trailing dimensions"):
        norm.FusedLayerNorm(5)(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"weight has shape \[3\]"):
        fln.fused_layer_norm_affine(torch.randn(2, 4), torch.ones(3), torch.zeros(4), (4,))
    with pytest.raises(RuntimeError, match="input has dtype torch.int64"):
        norm.FusedRMSNorm(4)(torch.arange(8).reshape(2, 4))
    with pytest.raises(RuntimeError, match="normalized_shape must be an int"):
        importlib.import_module("fused_layer_norm_cuda").forward(torch.randn(2, 4), "4", 1e-5)
    flc = importlib.import_module("fused_layer_norm_cuda")
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="mean must hold one value per row"):
        flc.backward_affine(x, None, torch.ones(2), x, (4,), torch.ones(4), torch.zeros(4), 1e-5)
    assert issubclass(ops.NormValueError, ValueError) and issubclass(ops.NormTypeError, TypeError)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_raw_ops_check_their_arguments(device):
    """The raw ops and the legacy module's backward functions refuse what does not fit, on the
    CPU (the reference, checked first) as the CUDA kernels do, with a ValueError / TypeError
    naming the argument: before, the CPU normalised over the wrong dimensions, took integer
    input, and read a grad_output of another shape."""
    ops_ = torch.ops.apex_norm
    flc = importlib.import_module("fused_layer_norm_cuda")
    x = make((2, 8), torch.float32, device)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    out, mean, invvar = flc.forward_affine(x, (8,), w, b, 1e-5)
    cases = [
        (ValueError, "does not match", lambda: ops_.layer_norm_fwd(x, None, None, [2, 4], 1e-5)),
        (ValueError, "does not match", lambda: ops_.rms_norm_fwd(x, None, [9], 1e-5)),
        (TypeError, "dtype", lambda: ops_.rms_norm_fwd(x.long(), None, [8], 1e-5)),
        (ValueError, "weight has", lambda: ops_.layer_norm_fwd(x, w[:3], None, [8], 1e-5)),
        (
            ValueError,
            "grad_output has shape",
            lambda: flc.backward_affine(x.reshape(8, 2), mean, invvar, x, (8,), w, b, 1e-5),
        ),
        (
            ValueError,
            "invvar must hold one value per row",
            lambda: flc.backward_affine(x, mean, invvar[:1], x, (8,), w, b, 1e-5),
        ),
        (
            ValueError,
            "grad_output has shape",
            lambda: ops_.rms_norm_bwd(x[:1], invvar, x, [8], None, 1e-5),
        ),
    ]
    for kind, message, call in cases:
        with pytest.raises(kind, match=message):
            call()


# -- other devices, torch.func, forward-mode AD, apex's module global ---------------------------


def test_meta_tensors_give_shapes_and_dtypes():
    """As apex's modules (which hand non-CUDA input to torch) and torch's norms: meta input in,
    meta output of the right shape and dtype out, from every module and functional form."""
    x = torch.empty(2, 3, 16, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, device="meta", dtype=torch.float32)
    for m in (norm.FusedLayerNorm(16), norm.FusedRMSNorm(16)):
        y = m.to("meta")(x)
        assert (y.device.type, y.shape, y.dtype) == ("meta", x.shape, torch.bfloat16)
    for m in (norm.MixedFusedLayerNorm(16), norm.MixedFusedRMSNorm(16)):
        y = m.to("meta")(x)
        assert (y.device.type, y.shape, y.dtype) == ("meta", x.shape, torch.float32)
    for y in (
        fln.fused_layer_norm(x, (16,)),
        fln.fused_rms_norm(x, (16,)),
        fln.fused_layer_norm_affine(x, w, w, (16,)),
        fln.fused_rms_norm_affine(x, w, (16,)),
    ):
        assert (y.device.type, y.shape, y.dtype) == ("meta", x.shape, torch.bfloat16)


def _torch_norm(kind, x, w, b):
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return rms_norm(x, (x.shape[-1],), w, 1e-5)


def _ours(kind, x, w, b):
    if kind == "layer":
        return fln.fused_layer_norm_affine(x, w, b, (x.shape[-1],), 1e-5)
    return fln.fused_rms_norm_affine(x, w, (x.shape[-1],), 1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_torch_func_transforms_and_forward_ad_match_torch(device, kind):
    """vmap, grad, jacrev, jvp and forward_ad dual tensors through the functional forms and the
    modules (the autograd Functions have no rules for them; the forms run the plain-torch math
    there) give torch's own norm's results, in float64."""
    f64 = torch.float64
    x = make((3, 5, 8), f64, device)
    w, b = param((8,), f64, device).detach(), param((8,), f64, device).detach()
    t = make((3, 5, 8), f64, device)

    def close(a, e):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)

    close(torch.func.vmap(lambda r: _ours(kind, r, w, b))(x), _torch_norm(kind, x, w, b))
    mod = (norm.FusedLayerNorm(8) if kind == "layer" else norm.FusedRMSNorm(8)).to(device, f64)
    want = _torch_norm(kind, x, mod.weight, getattr(mod, "bias", None)).detach()
    close(torch.func.vmap(mod)(x), want)

    def loss(fn):
        return lambda xx, ww: (fn(kind, xx, ww, b) * t).sum()

    close(torch.func.grad(loss(_ours), argnums=(0, 1))(x, w),
          torch.func.grad(loss(_torch_norm), argnums=(0, 1))(x, w))  # fmt: skip
    close(torch.func.jacrev(lambda r: _ours(kind, r, w, b))(x[0, 0]),
          torch.func.jacrev(lambda r: _torch_norm(kind, r, w, b))(x[0, 0]))  # fmt: skip
    close(torch.func.jvp(lambda r: _ours(kind, r, w, b), (x,), (t,))[1],
          torch.func.jvp(lambda r: _torch_norm(kind, r, w, b), (x,), (t,))[1])  # fmt: skip
    fwAD = torch.autograd.forward_ad
    with fwAD.dual_level():
        got = fwAD.unpack_dual(_ours(kind, fwAD.make_dual(x, t), w, b)).tangent
        want = fwAD.unpack_dual(_torch_norm(kind, fwAD.make_dual(x, t), w, b)).tangent
    close(got, want)


def test_jit_trace_gives_no_tracer_warnings():
    """torch.jit.trace (the TorchScript ONNX exporter's path) of the modules: the argument checks
    compare traced sizes, which used to warn four times a module; the traced module still runs
    other batch shapes."""
    for m in (norm.FusedLayerNorm(8), norm.FusedRMSNorm(8)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            traced = torch.jit.trace(m, torch.randn(2, 8))
        assert not [w for w in seen if issubclass(w.category, torch.jit.TracerWarning)]
        x = torch.randn(5, 3, 8)
        torch.testing.assert_close(traced(x), m(x))


MODULES = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]


def test_jit_trace_saves_and_script_compiles():
    """torch.jit.trace of a module records torch's own operators (the plain math), so the traced
    module can be saved and loaded (the autograd Functions cannot be saved); torch.jit.script
    compiles the modules (TorchScript's own copy of the math). Both give the eager outputs and
    dtypes, the Mixed* rule included (float32 input, bfloat16 weight: bfloat16 out)."""
    import io

    for name in MODULES:
        m = getattr(norm, name)(8)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p))
        for pdtype in (torch.float32, torch.bfloat16):
            m = m.to(pdtype)
            buffer = io.BytesIO()
            torch.jit.save(torch.jit.trace(m, torch.randn(2, 8)), buffer)
            buffer.seek(0)
            loaded = torch.jit.load(buffer)
            scripted = torch.jit.script(m)
            x = torch.randn(5, 3, 8)
            want = m(x)
            for got in (loaded(x), scripted(x)):
                assert got.dtype == want.dtype, (name, pdtype)
                torch.testing.assert_close(got, want, msg=f"{name} {pdtype}")
            # torch's operators only: loadable where this package is not installed
            assert "apex_norm" not in str(loaded.graph) + str(loaded.code)
            # the scripted copy checks its arguments as the eager forms do
            with pytest.raises(torch.jit.Error, match="does not match the trailing"):
                scripted(torch.randn(2, 1))
            with pytest.raises(torch.jit.Error, match="dtype"):
                scripted(torch.ones(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", MODULES)
def test_output_can_be_modified_in_place(device, name):
    """As after torch's norms: the output is a tensor of its own (not a view made inside the
    autograd Function, which autograd forbids to modify in place), so y.mul_(2), y += 1 and
    ReLU(inplace=True) work while autograd records, and the gradients are right. Also the
    float64 path on CUDA (the reference)."""
    for dtype in (torch.float32, torch.float64):
        m = getattr(norm, name)(16).to(device=device, dtype=dtype)
        x = make((4, 3, 16), dtype, device, requires_grad=True)
        y = m(x)
        assert y._base is None
        dy = torch.randn_like(y)
        want = torch.autograd.grad(y, [x, *m.parameters()], dy * 2)
        y = m(x)
        y.mul_(2)
        torch.nn.ReLU(inplace=True)(m(x).detach())  # and on a result that needs no grad
        got = torch.autograd.grad(y, [x, *m.parameters()], dy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        with torch.no_grad():
            m(x).add_(1)


def test_op_outputs_are_not_views():
    """The ops' outputs on the CPU (the reference) are tensors of their own."""
    x, w, b = torch.randn(4, 3, 8), torch.randn(8), torch.randn(8)
    for out in (
        *torch.ops.apex_norm.layer_norm_fwd(x, w, b, [8], 1e-5),
        *torch.ops.apex_norm.rms_norm_fwd(x, w, [8], 1e-5),
        *torch.ops.apex_norm.layer_norm_fwd(x, None, None, [3, 8], 1e-5, False, torch.bfloat16),
    ):
        assert out._base is None


def test_module_global_fused_layer_norm_cuda():
    """apex's module global: importable by name (None until a module is built, as in apex), then
    the fused_layer_norm_cuda module; Megatron forks import it and load it themselves if None."""
    from apex.normalization.fused_layer_norm import fused_layer_norm_cuda  # noqa: F401

    norm.FusedRMSNorm(4)
    assert fln.fused_layer_norm_cuda is importlib.import_module("fused_layer_norm_cuda")
    out = fln.fused_layer_norm_cuda.rms_forward(torch.randn(2, 4), (4,), 1e-5)
    assert out[0].shape == (2, 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_legacy_backward_without_mean_needs_memory_efficient(device):
    """LayerNorm's x-hat needs the mean unless it is recovered from the output."""
    flc = importlib.import_module("fused_layer_norm_cuda")
    x = make((6, 16), torch.float32, device)
    w, b = param((16,), torch.float32, device).detach(), param((16,), torch.float32, device)
    out, mean, invvar = flc.forward_affine(x, (16,), w, b.detach(), 1e-5)
    with pytest.raises(ValueError, match=r"mean must hold one value per row \(6\)"):
        flc.backward_affine(torch.randn_like(out), None, invvar, x, (16,), w, b.detach(), 1e-5)
    with pytest.raises(ValueError, match="unless memory_efficient"):
        flc.backward(torch.randn_like(out), None, invvar, x, (16,), 1e-5, False)


# -- ops: opcheck, compile, export ---------------------------------------------------------------


def _op_samples(device="cpu"):
    x = make((3, 4, 16), torch.float32, device, requires_grad=True)
    w, b = param((16,), torch.float32, device), param((16,), torch.float32, device)
    xb = make((5, 8), torch.bfloat16, device)
    return [
        (torch.ops.apex_norm.layer_norm_fwd, (x, w, b, [16], 1e-5, False, None)),
        (torch.ops.apex_norm.layer_norm_fwd, (x, None, None, [4, 16], 1e-5, True, torch.bfloat16)),
        (torch.ops.apex_norm.layer_norm_fwd, (xb, None, None, [8], 1e-5, False, None)),
        (torch.ops.apex_norm.rms_norm_fwd, (x, w, [16], 1e-5, False, None)),
        (torch.ops.apex_norm.rms_norm_fwd, (xb, None, [8], 1e-6, True, torch.float32)),
    ]


def _bwd_samples(device="cpu"):
    x = make((6, 16), torch.float32, device)
    w, b = (
        param((16,), torch.float32, device).detach(),
        param((16,), torch.float32, device).detach(),
    )
    dy = torch.randn_like(x)
    out, mean, invvar = ops.layer_norm_fwd(x, w, b, [16], 1e-5)
    rout, rinv = ops.rms_norm_fwd(x, w, [16], 1e-5)
    return [
        (torch.ops.apex_norm.layer_norm_bwd, (dy, mean, invvar, x, [16], w, b, 1e-5, False, None)),
        (
            torch.ops.apex_norm.layer_norm_bwd,
            (dy, None, invvar, out, [16], w, b, 1e-5, True, torch.bfloat16),
        ),
        (
            torch.ops.apex_norm.layer_norm_bwd,
            (dy, mean, invvar, x, [16], None, None, 1e-5, False, None),
        ),
        (torch.ops.apex_norm.rms_norm_bwd, (dy, rinv, x, [16], w, 1e-5, False, None)),
        (torch.ops.apex_norm.rms_norm_bwd, (dy, rinv, rout, [16], None, 1e-5, True, None)),
    ]


def test_opcheck_cpu():
    for op, args in _op_samples() + _bwd_samples():
        opcheck(op, args)


def test_forward_ops_are_differentiable():
    x = make((3, 16), torch.float32, requires_grad=True)
    w = param((16,), torch.float32)
    out, _, _ = torch.ops.apex_norm.layer_norm_fwd(x, w, None, [16], 1e-5, False, None)
    gx, gw = torch.autograd.grad(out.square().sum(), [x, w])
    ex, ew = torch.autograd.grad(F.layer_norm(x, (16,), w, None, 1e-5).square().sum(), [x, w])
    torch.testing.assert_close((gx, gw), (ex, ew))


class _Block(torch.nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.ln = norm.FusedLayerNorm(h)
        self.lin = torch.nn.Linear(h, h)
        self.rms = norm.FusedRMSNorm(h, memory_efficient=True)
        self.mixed = norm.MixedFusedLayerNorm(h)

    def forward(self, x):
        return self.mixed(self.rms(self.lin(self.ln(x))))


# torch 2.3's dynamo traces an autograd.Function only when every argument is a tensor or a
# constant, and apex's Functions take normalized_shape as a torch.Size (Megatron passes one): 2.3
# breaks the graph at them. torch 2.4 traces such arguments (pytorch PRs 123887, 124360), and
# adds torch.library.register_autograd, which stands for it here (a version parse would not).
needs_function_size_args = pytest.mark.skipif(
    not hasattr(torch.library, "register_autograd"),
    reason="torch 2.3's torch.compile cannot trace an autograd.Function that takes a torch.Size "
    "(apex's normalized_shape) and breaks the graph there; fullgraph=True needs torch >= 2.4",
)


@pytest.mark.slow
@needs_function_size_args
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = _Block()
    x = make((4, 8, 32), torch.float32, requires_grad=True)
    eager = model(x)
    (ge,) = torch.autograd.grad(eager.sum(), [x])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (gc,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge)


@pytest.mark.slow
@needs_function_size_args
@pytest.mark.skipif(
    not hasattr(torch._dynamo.config, "compiled_autograd"),
    reason="this torch has no torch._dynamo.config.compiled_autograd",
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_autograd_matches_eager(device):
    """Compiled autograd (the backward traced into a graph as well, through the ops' registered
    autograd): the same input and parameter gradients as eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _Block().to(device)
    x = make((4, 8, 32), torch.float32, device, requires_grad=True)
    params = [x, *model.parameters()]

    def step(x):
        out = model(x)
        out.sum().backward()
        return out

    eager = step(x)
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    counters.clear()
    with torch._dynamo.config.patch(compiled_autograd=True):
        out = torch.compile(step, backend="aot_eager")(x)
    assert counters["compiled_autograd"]["captures"] == 1  # the backward was captured, once
    torch.testing.assert_close(out, eager)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)


@pytest.mark.slow
def test_compile_matches_eager():
    """Without fullgraph, on every torch: torch 2.3 breaks the graph at the autograd Functions,
    runs them eagerly and compiles their forward as a frame of its own (which failed on 2.3
    while save_for_backward was called in a helper), Megatron's direct call included."""
    torch._dynamo.reset()
    model = _Block()
    x = make((4, 8, 32), torch.float32, requires_grad=True)
    w = param((32,), torch.float32)

    def megatron(x, w):
        return model(
            fln.FusedLayerNormAffineFunction.apply(x, w, None, torch.Size([32]), 1e-5, True)
        )

    params = [x, w, *model.parameters()]
    eager = megatron(x, w)
    ge = torch.autograd.grad(eager.sum(), params)
    out = torch.compile(megatron, backend="aot_eager")(x, w)
    gc = torch.autograd.grad(out.sum(), params)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge)


def test_onnx_export(tmp_path):
    pytest.importorskip("onnxscript")
    model = _Block().eval()
    torch.onnx.export(model, (torch.randn(2, 32),), str(tmp_path / "norm.onnx"), dynamo=True)
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(str(tmp_path / "norm.onnx")).graph
    # Standard operators only: no custom apex_norm domain left for a runtime to resolve.
    assert graph.node and all(n.domain in ("", "ai.onnx") for n in graph.node), {
        (n.domain, n.op_type) for n in graph.node
    }


# -- CUDA: the ops with their kernels --------------------------------------------------------------


@pytest.mark.cuda
def test_opcheck_cuda():
    for op, args in _op_samples("cuda") + _bwd_samples("cuda"):
        opcheck(op, args)


def _both_paths(norm_kind, x, w, b, H, memory_efficient, mixed):
    """(the functional form, the autograd Function) of one norm."""
    if norm_kind == "layer":
        form = fln.mixed_dtype_fused_layer_norm_affine if mixed else fln.fused_layer_norm_affine
        fn = (
            fln.FusedLayerNormAffineMixedDtypesFunction
            if mixed
            else fln.FusedLayerNormAffineFunction
        )
        return (
            lambda: form(x, w, b, (H,), 1e-5, memory_efficient),
            lambda: fn.apply(x, w, b, (H,), 1e-5, memory_efficient),
        )
    form = fln.mixed_dtype_fused_rms_norm_affine if mixed else fln.fused_rms_norm_affine
    fn = fln.FusedRMSNormAffineMixedDtypesFunction if mixed else fln.FusedRMSNormAffineFunction
    return (
        lambda: form(x, w, (H,), 1e-5, memory_efficient),
        lambda: fn.apply(x, w, (H,), 1e-5, memory_efficient),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("norm_kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("case", ["plain", "frozen_weight", "frozen_input", "strided", "mixed"])
def test_cuda_eager_path_is_the_cpp_autograd_and_matches_the_functions(
    norm_kind, dtype, affine, memory_efficient, case
):
    """On CUDA, with the kernels loaded, the functional forms (so the modules) call the forward op
    directly, differentiated by the library's C++ autograd (csrc/autograd.cpp); its output and
    gradients are those of the autograd Functions bit for bit: with weight and/or bias or none,
    frozen parameters or a frozen input, a non-contiguous input, the Mixed forms (a float32
    weight and bias: output in float32)."""
    if norm_kind == "rms" and affine == "bias":
        pytest.skip("RMSNorm has no bias")
    if case == "frozen_input" and affine == "none":
        pytest.skip("nothing would need a gradient")
    assert ops.OPS.ensure_loaded()
    H = 256
    if case == "strided":
        x = make((H, 33), dtype, "cuda", scale=2.0, shift=0.5).t().detach().requires_grad_(True)
        assert not x.is_contiguous()
    else:
        x = make((33, H), dtype, "cuda", requires_grad=case != "frozen_input", scale=2.0)
    pdtype = torch.float32 if case == "mixed" else dtype
    w = param((H,), pdtype, "cuda") if affine in ("both", "weight") else None
    b = param((H,), pdtype, "cuda") if affine in ("both", "bias") and norm_kind == "layer" else None
    if case == "frozen_weight":
        for t in (w, b):
            if t is not None:
                t.requires_grad_(False)
    ins = [t for t in (x, w, b) if t is not None and t.requires_grad]
    fast, slow = _both_paths(norm_kind, x, w, b, H, memory_efficient, case == "mixed")
    y, y_ref = fast(), slow()
    name = "LayerNormFn" if norm_kind == "layer" else "RmsNormFn"
    assert name in y.grad_fn.name(), y.grad_fn.name()
    assert name not in y_ref.grad_fn.name()
    assert y.dtype == y_ref.dtype
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_ref, ins, dy)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    with torch.no_grad():
        y_off = fast()  # the C++ autograd's shortcut: the op below autograd, no Function
    assert y_off.grad_fn is None and not y_off.requires_grad
    assert torch.equal(y_off, y)


@pytest.mark.cuda
@pytest.mark.parametrize("norm_kind", ["layer", "rms"])
def test_cuda_op_records_nothing_without_grad_and_refuses_a_tangent(norm_kind):
    """The forward op on CUDA (the C++ autograd): where nothing needs a gradient (no input
    requires one, or grad mode is off) it records no backward and gives the same output; an
    input requiring a gradient under no_grad gives none either. A forward-mode tangent still
    reaches the C++ Function, which refuses it (torch's error) rather than dropping it."""
    assert ops.OPS.ensure_loaded()
    H = 64
    x = make((8, H), torch.float32, "cuda", scale=2.0)
    w = param((H,), torch.float32, "cuda").detach()
    b = param((H,), torch.float32, "cuda").detach()
    if norm_kind == "layer":
        call = lambda x, w: torch.ops.apex_norm.layer_norm_fwd.default(x, w, b, [H], 1e-5)  # noqa: E731
    else:
        call = lambda x, w: torch.ops.apex_norm.rms_norm_fwd.default(x, w, [H], 1e-5)  # noqa: E731
    plain = call(x, w)
    assert all(t.grad_fn is None and not t.requires_grad for t in plain)
    wg = w.clone().requires_grad_(True)
    recorded = call(x, wg)
    assert recorded[0].grad_fn is not None
    with torch.no_grad():
        off = call(x, wg)
    assert all(t.grad_fn is None and not t.requires_grad for t in off)
    for got, want in zip(off, recorded):
        assert torch.equal(got, want.detach())
    for got, want in zip(plain, recorded):
        assert torch.equal(got, want.detach())
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), torch.no_grad():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(RuntimeError, match="jvp is not implemented"):
            call(dual, w)


@pytest.mark.cuda
def test_cuda_eager_path_refuses_double_backward_through_memory_efficient():
    assert ops.OPS.ensure_loaded()
    x = make((4, 64), torch.float32, "cuda", requires_grad=True)
    for m in (
        norm.FusedLayerNorm(64, memory_efficient=True),
        norm.FusedRMSNorm(64, memory_efficient=True),
    ):
        y = m.cuda()(x)
        with pytest.raises(RuntimeError, match="memory_efficient=False for double backward"):
            torch.autograd.grad(y.sum(), [x], create_graph=True)


def _saved_bytes(f, *args):
    """(f(*args), the bytes autograd saved for its backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(*args)
    return y, sum(saved)


@pytest.mark.parametrize("no_f_rms_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_eager_path_takes_torchs_norms_where_that_keeps_no_more(
    monkeypatch, dtype, no_f_rms_norm
):
    """On the CPU the functional forms (and so the modules) run torch's own norms through the
    plain math where that saves no more for backward than the autograd Function: every call
    that records nothing, and LayerNorm recording with float32 input. Elsewhere (16-bit input,
    RMSNorm recording, memory_efficient) the Function. Either way the Function's results and
    dtypes, and no more saved bytes. ``no_f_rms_norm``: a torch without F.rms_norm (2.3)."""
    if no_f_rms_norm:
        monkeypatch.setattr(reference, "_F_RMS", None)
    H = 48
    x = make((6, H), dtype, requires_grad=True)
    w, b = param((H,), torch.float32), param((H,), torch.float32)  # mixed: out in x's dtype
    dy = torch.randn(6, H, dtype=dtype)
    cases = [
        (fln.fused_layer_norm_affine, fln.FusedLayerNormAffineFunction, (w, b), False),
        (fln.fused_rms_norm_affine, fln.FusedRMSNormAffineFunction, (w,), True),
    ]
    for form, function, params, rms in cases:
        y, form_bytes = _saved_bytes(form, x, *params, (H,), 1e-5)
        y_fn, fn_bytes = _saved_bytes(function.apply, x, *params, torch.Size([H]), 1e-5, False)
        assert "Function" in y_fn.grad_fn.name()
        plain = not rms and dtype == torch.float32
        assert ("Function" not in y.grad_fn.name()) == plain, (form, dtype, y.grad_fn.name())
        assert form_bytes <= fn_bytes, (form, dtype, form_bytes, fn_bytes)
        assert y.dtype == y_fn.dtype == dtype
        torch.testing.assert_close(y, y_fn, **tol(dtype))
        ins = [x, *params]
        for got, want in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_fn, ins, dy)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, **tol(dtype, torch.float16))
        y_me = form(x, *params, (H,), 1e-5, True)
        assert "Function" in y_me.grad_fn.name(), y_me.grad_fn.name()
        torch.testing.assert_close(y_me, y_fn, **tol(dtype))
        # Recording nothing, the plain math whatever the norm and dtype: the Function not called.
        with monkeypatch.context() as m:
            m.setattr(function, "apply", None)
            with torch.no_grad():
                y_off = form(x, *params, (H,), 1e-5)
            y_const = form(x.detach(), *(p.detach() for p in params), (H,), 1e-5)
        for got in (y_off, y_const):
            assert got.grad_fn is None and got.dtype == dtype
            torch.testing.assert_close(got, y_fn.detach(), **tol(dtype))


def test_cpu_eager_path_gives_contiguous_outputs_and_keeps_mixed_params_on_the_function():
    """The eager CPU route's outputs are contiguous for a strided input (channels_last, a
    transpose), as every other route's; recording with parameters of another dtype than the
    input keeps the Function (the plain math would keep their cast copies)."""
    x = make((2, 16, 4, 4), torch.float32).contiguous(memory_format=torch.channels_last)
    w, b = param((4, 4), torch.float32), param((4, 4), torch.float32)
    with torch.no_grad():
        for y, y_fn in (
            (
                fln.fused_rms_norm_affine(x, w, (4, 4), 1e-5),
                fln.FusedRMSNormAffineFunction.apply(x, w, torch.Size([4, 4]), 1e-5, False),
            ),
            (
                fln.fused_layer_norm_affine(x, w, b, (4, 4), 1e-5),
                fln.FusedLayerNormAffineFunction.apply(x, w, b, torch.Size([4, 4]), 1e-5, False),
            ),
        ):
            assert y.is_contiguous() and y_fn.is_contiguous()
            torch.testing.assert_close(y, y_fn, **tol(torch.float32))
    x = make((3, 8), torch.float32, requires_grad=True)
    w16, b16 = param((8,), torch.bfloat16), param((8,), torch.bfloat16)
    y = fln.fused_layer_norm_affine(x, w16, b16, (8,), 1e-5)
    assert "Function" in y.grad_fn.name(), y.grad_fn.name()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("route", ["functional", "memory_efficient", "Function"])
def test_bias_of_another_dtype_than_the_weight_keeps_its_own_precision(device, route):
    """A bias whose dtype is not the weight's is not rounded to the weight's dtype, in the forward
    or in its gradient, on every route (README: any combination, arithmetic in float32, float64
    for float64 input; gradients in the dtype of their tensor). The Functions (and so
    memory_efficient) rounded the bias and its gradient through the weight's dtype once: a
    float32 bias's gradient past 65504 became inf with a float16 weight, and a float64 bias was
    rounded to bfloat16 with a bfloat16 weight."""
    H = 8

    def run(x, w, b):
        if route == "Function":
            return fln.FusedLayerNormAffineFunction.apply(x, w, b, torch.Size([H]), 1e-5, False)
        return fln.fused_layer_norm_affine(x, w, b, (H,), 1e-5, route == "memory_efficient")

    # float32 input, float16 weight (output float16), float32 bias: its gradient sums 2 rows of
    # 40000, 80000, past float16's range but a float32 value.
    x = make((2, H), torch.float32, device, requires_grad=True)
    w, b = param((H,), torch.float16, device), param((H,), torch.float32, device)
    y = run(x, w, b)
    assert y.dtype == torch.float16
    (gb,) = torch.autograd.grad(y, [b], torch.full_like(y, 40000.0))
    assert gb.dtype == torch.float32
    torch.testing.assert_close(gb, torch.full_like(gb, 80000.0))
    # float64 input, bfloat16 weight, float64 bias: float64 arithmetic, the bias as given.
    x = make((4, H), torch.float64, device, requires_grad=True)
    w = param((H,), torch.bfloat16, device)
    b = (param((H,), torch.float64, device) / 3).detach().requires_grad_(True)
    y = run(x, w, b)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.layer_norm(x, (H,), w.double(), b, 1e-5), **tol(torch.float64))


@pytest.mark.cuda
def test_cuda_eager_path_falls_back_where_it_does_not_apply():
    """A bias of another dtype than the weight, and float64, keep the autograd Functions (grad_fn
    a Python node) and still give the right answer."""
    assert ops.OPS.ensure_loaded()
    H = 64
    x = make((5, H), torch.float32, "cuda", requires_grad=True)
    w, b = param((H,), torch.float32, "cuda"), param((H,), torch.bfloat16, "cuda")
    y = fln.fused_layer_norm_affine(x, w, b, (H,), 1e-5)
    assert "LayerNormFn" not in y.grad_fn.name()
    torch.testing.assert_close(y, F.layer_norm(x, (H,), w, b.float(), 1e-5), atol=1e-5, rtol=1e-5)
    x64 = x.detach().double().requires_grad_(True)
    y64 = fln.fused_rms_norm_affine(x64, w.double(), (H,), 1e-5)
    assert "RmsNormFn" not in y64.grad_fn.name()
    torch.testing.assert_close(y64, rms_norm(x64, (H,), w.double(), 1e-5))


@pytest.mark.cuda
@needs_function_size_args
def test_compile_fullgraph_cuda_inductor():
    torch._dynamo.reset()
    model = _Block(1024).cuda()
    x = make((64, 1024), torch.float32, "cuda", requires_grad=True)
    eager = model(x)
    (ge,) = torch.autograd.grad(eager.sum(), [x])
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    (gc,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_graph_capture():
    m = norm.FusedRMSNorm(1024).cuda()
    x = make((64, 1024), torch.float32, "cuda")
    m(x)  # load the kernels outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = m(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y, rms_norm(x, (1024,), m.weight, 1e-5))


@pytest.mark.cuda
def test_cuda_autocast_gives_the_autocast_dtype():
    m = norm.FusedLayerNorm(256).cuda()
    x = make((8, 256), torch.float32, "cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
