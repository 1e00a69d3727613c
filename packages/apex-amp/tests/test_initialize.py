"""amp.initialize: opt-level tables and overrides, the low-precision dtype, model casting, return
shapes, and bad input (exception type and the words of the fix)."""

from __future__ import annotations

import collections

import pytest
import torch
from amp_testing import batches, make_model
from torch import nn

import apex.amp as amp
from apex.amp import frontend
from apex.amp._casting import autocast_on

TABLE = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": ("low", False, True, True, "dynamic"),
    "O3": ("low", False, False, False, 1.0),
}
FIELDS = (
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opt_level", list(TABLE))
def test_property_table(opt_level, dtype):
    model = make_model()
    amp.initialize(model, opt_level=opt_level, low_precision_dtype=dtype, verbosity=0)
    props = amp._amp_state.opt_properties
    assert props.enabled and props.opt_level == opt_level
    for field, want in zip(FIELDS, TABLE[opt_level]):
        if want == "low":
            want = dtype
        if field == "loss_scale" and want == "dynamic" and dtype == torch.bfloat16:
            want = 1.0  # bf16 needs no scaling
        assert getattr(props, field) == want, field


def test_overrides_apply_and_accept_strings():
    model = make_model()
    amp.initialize(
        model,
        opt_level="O2",
        low_precision_dtype=torch.float16,
        keep_batchnorm_fp32="False",
        master_weights=False,
        loss_scale="128.0",
        verbosity=0,
    )
    props = amp._amp_state.opt_properties
    assert props.keep_batchnorm_fp32 is False and props.master_weights is False
    assert props.loss_scale == 128.0
    assert model.net[1].weight.dtype == torch.float16  # batchnorm cast too


def test_explicit_loss_scale_wins_over_bf16_default():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(
        model,
        opt,
        opt_level="O2",
        low_precision_dtype=torch.bfloat16,
        loss_scale="dynamic",
        verbosity=0,
    )
    assert amp._amp_state.loss_scalers[0].dynamic


def test_none_overrides_are_defaults_like_mmengine():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model,
        opt,
        opt_level="O1",
        loss_scale="dynamic",
        enabled=True,
        cast_model_type=None,
        patch_torch_functions=None,
        keep_batchnorm_fp32=None,
        master_weights=None,
        cast_model_outputs=None,
        num_losses=1,
        verbosity=0,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
    )
    assert hasattr(opt, "_amp_stash")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_o2_casts_model_keeps_batchnorm_and_casts_io(dtype):
    model = make_model()
    model = amp.initialize(model, opt_level="O2", low_precision_dtype=dtype, verbosity=0)
    assert model.net[0].weight.dtype == dtype
    assert model.net[1].weight.dtype == torch.float32
    assert model.net[1].running_mean.dtype == torch.float32
    seen = {}
    model.net[0].register_forward_pre_hook(lambda m, args: seen.update(dtype=args[0].dtype))
    out = model(torch.randn(4, 8))
    assert seen["dtype"] == dtype and out.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_o0_casts_floating_inputs_to_fp32(dtype):
    """apex's O0 (cast_model_type=torch.float32) patches forward like O2/O3: a half or double
    batch runs the fp32 model."""
    model = amp.initialize(make_model(), opt_level="O0", verbosity=0)
    x = torch.randn(4, 8)
    out = model(x.to(dtype))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x), rtol=0.02, atol=0.02)


def test_o3_casts_everything():
    model = amp.initialize(
        make_model(), opt_level="O3", low_precision_dtype=torch.float16, verbosity=0
    )
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.dtype == torch.float16 for t in tensors if t.is_floating_point())
    assert model.state_dict()["net.1.weight"].dtype == torch.float32


def test_cast_model_outputs_and_nested_inputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, batch):
            assert batch["x"][0].dtype == torch.float16 and batch["ids"].dtype == torch.long
            y = self.lin(batch["x"][0])
            return {"y": y, "pair": (y, batch["ids"])}

    model = amp.initialize(
        Net(),
        opt_level="O2",
        low_precision_dtype=torch.float16,
        cast_model_outputs=torch.float16,
        verbosity=0,
    )
    out = model({"x": [torch.randn(2, 8)], "ids": torch.arange(2)})
    assert out["y"].dtype == torch.float16 and out["pair"][1].dtype == torch.long


def test_defaultdict_inputs_and_outputs_keep_their_type():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, batch):
            assert type(batch) is collections.defaultdict and batch["x"].dtype == torch.bfloat16
            return collections.defaultdict(list, {"y": self.lin(batch["x"])})

    model = amp.initialize(Net(), opt_level="O2", low_precision_dtype=torch.bfloat16, verbosity=0)
    out = model(collections.defaultdict(int, {"x": torch.randn(2, 8)}))
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert out["y"].dtype == torch.float32 and out["missing"] == []


def test_mappings_whose_constructor_takes_no_pairs_keep_their_type():
    class Odd(dict):
        def __init__(self, name, **kw):
            super().__init__(**kw)
            self.name = name

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return Odd("n", y=self.lin(x))

    model = amp.initialize(Net(), opt_level="O3", low_precision_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(2, 8))
    assert type(out).__name__ == "Odd" and out.name == "n" and list(out) == ["y"]
    assert out["y"].dtype == torch.float32


def test_cast_model_outputs_alone_casts_o1_outputs():
    model = amp.initialize(
        make_model(),
        opt_level="O1",
        low_precision_dtype=torch.bfloat16,
        cast_model_outputs=torch.float32,
        verbosity=0,
    )
    assert model(torch.randn(4, 8)).dtype == torch.float32


def test_o1_leaves_weights_fp32_and_runs_forward_under_autocast():
    model = amp.initialize(
        make_model(), opt_level="O1", low_precision_dtype=torch.bfloat16, verbosity=0
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model(torch.randn(4, 8)).dtype == torch.bfloat16
    assert not autocast_on("cpu")


@pytest.mark.parametrize(
    "models, optimizers, shape",
    [
        ("m", None, "m"),
        (["m"], None, ["m"]),
        ("m", "o", ("m", "o")),
        ("m", ["o", "o2"], ("m", ["o", "o2"])),
        (["m", "m2"], "o", (["m", "m2"], "o")),
        (["m", "m2"], ["o", "o2"], (["m", "m2"], ["o", "o2"])),
    ],
)
def test_return_shape_mirrors_input(models, optimizers, shape):
    made = {"m": make_model(0), "m2": make_model(1)}
    params = list(made["m"].parameters())
    made["o"] = torch.optim.SGD(params[:2], lr=0.1)
    made["o2"] = torch.optim.Adam(params[2:], lr=0.1)

    def build(spec):
        if spec is None:
            return None
        return [made[s] for s in spec] if isinstance(spec, list) else made[spec]

    result = amp.initialize(
        build(models),
        build(optimizers),
        opt_level="O2",
        low_precision_dtype=torch.float16,
        verbosity=0,
    )

    def check(got, spec):
        if isinstance(spec, tuple):
            assert isinstance(got, tuple) and len(got) == 2
            check(got[0], spec[0])
            check(got[1], spec[1])
        elif isinstance(spec, list):
            assert isinstance(got, list) and all(g is made[s] for g, s in zip(got, spec))
        else:
            assert got is made[spec]

    check(result, shape)


def test_dtype_choice_order(monkeypatch):
    choose = frontend.choose_low_precision
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)
    assert choose(None, None, "cpu") == torch.bfloat16
    assert choose(torch.float16, None, "cpu") == torch.float16
    assert choose(None, torch.float16, "cpu") == torch.float16
    monkeypatch.setenv("APEX_AMP_DTYPE", "fp16")
    assert choose(None, None, "cpu") == torch.float16
    assert choose(None, torch.bfloat16, "cpu") == torch.bfloat16
    monkeypatch.setenv("APEX_AMP_DTYPE", "int8")
    with pytest.raises(ValueError, match="APEX_AMP_DTYPE='int8'.*fp16 or bf16"):
        choose(None, None, "cpu")
    with pytest.raises(ValueError, match="contradicts"):
        choose(torch.float16, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="low_precision_dtype must be"):
        choose(None, torch.float64, "cpu")


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["O4", "o1", "02", 1, None])
def test_unknown_opt_level(level):
    with pytest.raises(RuntimeError, match="Unexpected optimization level") as info:
        amp.initialize(make_model(), opt_level=level, verbosity=0)
    if level == "02":
        assert "the letter O, not the number zero" in str(info.value)
    assert not amp._amp_state.initialized


def test_initialize_again_starts_over_as_apex():
    """A second initialize (a new Trainer per fold or sweep in one process) starts over with the
    new models and optimizers, as apex's did; an optimizer of the first call is still refused,
    with apex's words, and a refused call leaves the first one in place."""
    m1 = make_model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    m1, o1 = amp.initialize(m1, o1, opt_level="O1", verbosity=0)
    first = amp._amp_state.loss_scalers
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(make_model(), o1, opt_level="O2", verbosity=0)
    assert amp._amp_state.loss_scalers is first and amp._amp_state.opt_properties.opt_level == "O1"
    m2 = make_model()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    m2, o2 = amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    assert amp._amp_state.opt_properties.opt_level == "O2"
    assert amp._amp_state.optimizers == [o2] and amp._amp_state.loss_scalers is not first
    x, y = batches(1)[0]
    with amp.scale_loss(((m2(x).float() - y) ** 2).mean(), o2) as scaled:
        scaled.backward()
    o2.step()
    assert all(torch.isfinite(p).all() for p in amp.master_params(o2))


def test_optimizers_of_an_earlier_initialize_still_scale():
    """A GAN's generator and discriminator set up by two calls: the first call's optimizer still
    works with scale_loss, as in apex (which only looked for _amp_stash)."""
    g, d = make_model(0), make_model(1)
    og = torch.optim.SGD(g.parameters(), lr=0.1)
    od = torch.optim.SGD(d.parameters(), lr=0.1)
    g, og = amp.initialize(g, og, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0)
    d, od = amp.initialize(d, od, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0)
    x, y = batches(1)[0]
    for model, opt in ((g, og), (d, od)):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in amp.master_params(opt))


def test_a_second_initialize_failing_late_leaves_the_first(monkeypatch):
    """A second call that fails while processing its optimizer leaves the first call working."""
    m1 = make_model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    m1, o1 = amp.initialize(m1, o1, opt_level="O1", verbosity=0)
    props, scalers = amp._amp_state.opt_properties, amp._amp_state.loss_scalers

    def broken(opt, props):
        raise RuntimeError("processing failed")

    monkeypatch.setattr(frontend, "process_optimizer", broken)
    m2 = make_model()
    with pytest.raises(RuntimeError, match="processing failed"):
        amp.initialize(m2, torch.optim.SGD(m2.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    assert amp._amp_state.initialized and amp._amp_state.opt_properties is props
    assert amp._amp_state.loss_scalers is scalers
    x, y = batches(1)[0]
    with amp.scale_loss(((m1(x).float() - y) ** 2).mean(), o1) as scaled:
        scaled.backward()
    o1.step()


def test_opt_properties_absent_until_initialize():
    """As in apex: atorch tests `hasattr(_amp_state, "opt_properties") and ...enabled`."""
    from apex.amp import _amp_state

    assert not hasattr(_amp_state, "opt_properties")
    assert not (hasattr(_amp_state, "opt_properties") and _amp_state.opt_properties.enabled)
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    assert _amp_state.opt_properties.enabled
    amp.reset()
    assert not hasattr(_amp_state, "opt_properties")


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_scale_loss_without_scaling_takes_any_optimizer(opt_level):
    """No master weights and a static scale of 1: apex's scale_loss touches no optimizer, so a
    wrapper amp.initialize never saw (ESPnet's Noam) or None is accepted there."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x, y = batches(1)[0]
    for other in (None, torch.optim.SGD(model.parameters(), lr=0.1)):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), other) as scaled:
            scaled.backward()
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad()


def test_optimizer_passed_twice():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(model, [opt, opt], opt_level="O1", verbosity=0)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    amp.reset()
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(make_model(), opt, opt_level="O1", verbosity=0)


def test_fp16_unsupported_on_this_device(monkeypatch):
    monkeypatch.setattr(frontend, "_low_precision_supported", lambda dtype, dev: False)
    with pytest.raises(RuntimeError, match=r"not supported for models on cpu.*Choose bf16"):
        amp.initialize(make_model(), opt_level="O2", low_precision_dtype=torch.float16, verbosity=0)


def test_scale_loss_with_a_stranger_optimizer():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="not passed to amp.initialize"):
        with amp.scale_loss(model(x).sum(), other):
            pass


def test_scale_loss_before_initialize():
    with pytest.raises(RuntimeError, match="must be called before `with amp.scale_loss`"):
        with amp.scale_loss(
            torch.tensor(1.0), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
        ):
            pass


def test_tuple_and_wrong_types():
    model = make_model()
    with pytest.raises(TypeError, match="not a tuple"):
        amp.initialize((model,), opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp.initialize("model", opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        amp.initialize(model, object(), opt_level="O1", verbosity=0)


def test_parallel_wrapped_model_is_refused():
    with pytest.raises(RuntimeError, match="AFTER the model"):
        amp.initialize(nn.DataParallel(make_model()), opt_level="O1", verbosity=0)


def test_incoming_half_model_is_refused_unless_allowed():
    with pytest.raises(RuntimeError, match="do not need to call .half"):
        amp.initialize(make_model().half(), opt_level="O2", verbosity=0)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    amp.initialize(
        make_model().half(), opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
    )


def test_incoming_bf16_buffer_is_refused():
    model = make_model()
    model.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="buffer scale with type torch.bfloat16"):
        amp.initialize(model, opt_level="O1", verbosity=0)


class Diffusion(nn.Module):
    """A float64 noise schedule beside fp32 weights (diffusers' schedulers)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.register_buffer("betas", torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64))

    def forward(self, x, t):
        return self.net(x) * self.betas[t].to(x.dtype).unsqueeze(-1)


@pytest.mark.parametrize(
    "opt_level, betas",
    [("O0", torch.float32), ("O1", torch.float64), ("O2", torch.bfloat16), ("O3", torch.bfloat16)],
)
def test_float64_buffers_are_accepted_and_cast_as_apex_did(opt_level, betas):
    # apex refused only half params/buffers; its model.to()/convert_network cast float64 too.
    model = Diffusion()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, low_precision_dtype=torch.bfloat16, verbosity=0
    )
    assert model.betas.dtype == betas
    out = model(torch.randn(2, 4), torch.tensor([1, 2]))
    with amp.scale_loss(out.float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_o1_with_model_cast_overrides_is_refused():
    with pytest.raises(RuntimeError, match="O1 inserts casts"):
        amp.initialize(make_model(), opt_level="O1", master_weights=True, verbosity=0)
    with pytest.raises(RuntimeError, match="only O1 patches"):
        amp.initialize(make_model(), opt_level="O2", patch_torch_functions=True, verbosity=0)


def test_bad_property_values():
    with pytest.raises(ValueError, match="loss_scale must be"):
        amp.initialize(make_model(), opt_level="O1", loss_scale="big", verbosity=0)
    with pytest.raises(ValueError, match="keep_batchnorm_fp32 must be"):
        amp.initialize(make_model(), opt_level="O2", keep_batchnorm_fp32="yes", verbosity=0)
    with pytest.raises(ValueError, match="num_losses must be"):
        amp.initialize(make_model(), opt_level="O1", num_losses=0, verbosity=0)


def test_property_table_is_logged(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="apex.amp"):
        amp.initialize(make_model(), opt_level="O2", low_precision_dtype=torch.bfloat16)
    assert "Selected optimization level O2" in caplog.text
    assert "master_weights" in caplog.text and "torch.bfloat16" in caplog.text


def test_package_exports():
    for name in (
        "initialize",
        "scale_loss",
        "state_dict",
        "load_state_dict",
        "master_params",
        "register_half_function",
        "register_float_function",
        "register_promote_function",
        "half_function",
        "float_function",
        "promote_function",
        "disable_casts",
        "init",
        "_amp_state",
    ):
        assert name in amp.__dict__, name  # timm probes amp.__dict__
    assert hasattr(amp, "__path__")  # DeepSpeed logs amp.__path__
