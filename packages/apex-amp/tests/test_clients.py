"""The client patterns of reference/apex-clients.md, run unchanged (on CPU)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from amp_testing import batches, loss_fn, make_model

from apex import amp

FP16 = torch.float16


class ApexScaler:
    """timm/utils/cuda.py, verbatim but for dispatch_clip_grad."""

    state_dict_key = "amp"

    def __call__(
        self,
        loss,
        optimizer,
        clip_grad=None,
        clip_mode="norm",
        parameters=None,
        create_graph=False,
        need_update=True,
    ):
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), clip_grad)
            optimizer.step()

    def state_dict(self):
        if "state_dict" in amp.__dict__:
            return amp.state_dict()

    def load_state_dict(self, state_dict):
        if "load_state_dict" in amp.__dict__:
            amp.load_state_dict(state_dict)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_timm_apex_scaler(opt_level):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, low_precision_dtype=FP16, verbosity=0
    )
    loss_scaler = ApexScaler()
    losses = []
    for x, y in batches(30):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = loss_scaler.state_dict()
    assert set(state) == {"loss_scaler0"}
    loss_scaler.load_state_dict(state)


def test_bert_run_pretraining_pattern():
    """DeepLearningExamples BERT: O2 + FusedLAMB, the scaler poked directly, resume through
    _lazy_init_maybe_master_weights, and allreduce_post_accumulation's fused scale."""
    optimizers = pytest.importorskip("apex.optimizers", exc_type=ImportError)
    import amp_C
    import apex_C
    from apex.amp import _amp_state

    model = make_model()
    decay = [p for n, p in model.named_parameters() if "bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n]
    optimizer = optimizers.FusedLAMB(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        loss_scale="dynamic",
        cast_model_outputs=torch.float16,
        low_precision_dtype=FP16,
        verbosity=0,
    )
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**12  # DLE's --init_loss_scale
    data = batches(4)
    accum = 2
    for step, (x, y) in enumerate(data):
        out = model(x)
        assert out.dtype == torch.float16
        loss = loss_fn(out, y) / accum
        with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
            scaled_loss.backward()
        if step % accum == accum - 1:
            # allreduce_post_accumulation (world size 1: the all_reduce is a no-op)
            overflow_buf = torch.IntTensor([0])
            scaler = _amp_state.loss_scalers[0]
            master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
            flat_raw = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float32)
            allreduced_views = apex_C.unflatten(flat_raw, master_grads)
            amp_C.multi_tensor_scale(
                65536, overflow_buf, [master_grads, allreduced_views], scaler.loss_scale() / accum
            )
            amp_C.multi_tensor_scale(
                65536, overflow_buf, [allreduced_views, master_grads], 1.0 / scaler.loss_scale()
            )
            if step == 3:
                master_grads[0].view(-1)[0] = float("inf")
                amp_C.multi_tensor_scale(65536, overflow_buf, [master_grads, master_grads], 1.0)
            old_overflow_buf = scaler._overflow_buf
            scaler._overflow_buf = overflow_buf
            had_overflow = scaler.update_scale()
            scaler._overfloat_buf = old_overflow_buf  # DLE's typo, kept in every copy
            if step == 3:
                assert had_overflow and scaler.loss_scale() == 2.0**11
            else:
                assert not had_overflow
            if had_overflow == 0:
                optimizer.step()
            else:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
            for param in model.parameters():
                param.grad = None
    assert _amp_state.opt_properties.master_weights
    checkpoint = {
        "optimizer": optimizer.state_dict(),
        "master params": list(amp.master_params(optimizer)),
    }

    # resume
    amp.reset()
    model2 = make_model(seed=5)
    model2, opt2 = amp.initialize(
        model2,
        optimizers.FusedLAMB(
            [
                {
                    "params": [p for n, p in model2.named_parameters() if "bias" not in n],
                    "weight_decay": 0.01,
                },
                {
                    "params": [p for n, p in model2.named_parameters() if "bias" in n],
                    "weight_decay": 0.0,
                },
            ],
            lr=1e-3,
        ),
        opt_level="O2",
        low_precision_dtype=FP16,
        verbosity=0,
    )
    opt2._lazy_init_maybe_master_weights()
    opt2._lazy_init_maybe_master_weights()  # idempotent
    opt2._amp_stash.lazy_init_called = True
    opt2.load_state_dict(checkpoint["optimizer"])
    for param, saved in zip(amp.master_params(opt2), checkpoint["master params"]):
        param.data.copy_(saved.data)
    for a, b in zip(amp.master_params(opt2), amp.master_params(optimizer)):
        assert torch.equal(a, b)


def test_lightning_plugin_pattern():
    warnings.filterwarnings("ignore", message="apex.amp is deprecated", category=FutureWarning)
    model = make_model()
    params = list(model.parameters())
    opt1 = torch.optim.SGD(params[:3], lr=0.05)
    opt2 = torch.optim.Adam(params[3:], lr=1e-2)
    _, optimizers = amp.initialize(
        model, [opt1, opt2], opt_level="O2", low_precision_dtype=FP16, verbosity=0
    )
    assert isinstance(optimizers, list) and optimizers[0] is opt1
    for x, y in batches(5):
        with amp.scale_loss(loss_fn(model(x), y), optimizers) as tensor:
            tensor.backward()
        for opt in optimizers:
            torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), 1.0)
            opt.step()
            opt.zero_grad()
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 5


class ApexOptimWrapper:
    """mmengine's ApexOptimWrapper, trimmed to the amp calls."""

    def __init__(
        self,
        optimizer,
        opt_level="O1",
        loss_scale="dynamic",
        enabled=True,
        cast_model_type=None,
        patch_torch_functions=None,
        keep_batchnorm_fp32=None,
        master_weights=None,
        cast_model_outputs=None,
        num_losses=1,
        verbosity=1,
        min_loss_scale=None,
        max_loss_scale=2.0**24,
    ):
        self.optimizer = optimizer
        self.opt_level, self.loss_scale, self.enabled = opt_level, loss_scale, enabled
        self.cast_model_type = cast_model_type
        self.patch_torch_functions = patch_torch_functions
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.master_weights = master_weights
        self.cast_model_outputs = cast_model_outputs
        self.num_losses, self.verbosity = num_losses, verbosity
        self.min_loss_scale, self.max_loss_scale = min_loss_scale, max_loss_scale

    def backward(self, loss, **kwargs):
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward(**kwargs)

    def state_dict(self):
        state = self.optimizer.state_dict()
        state["apex_amp"] = amp.state_dict()
        return state

    def load_state_dict(self, sd):
        if "apex_amp" in sd:
            if hasattr(self.optimizer, "_amp_stash"):
                amp.load_state_dict(sd.pop("apex_amp"))
            else:
                self._apex_amp_state_dict = sd.pop("apex_amp")
        self.optimizer.load_state_dict(sd)

    @contextmanager
    def optim_context(self, model):
        if not hasattr(self.optimizer, "_amp_stash"):
            model, self.optimizer = amp.initialize(
                model,
                self.optimizer,
                opt_level=self.opt_level,
                loss_scale=self.loss_scale,
                enabled=self.enabled,
                cast_model_type=self.cast_model_type,
                patch_torch_functions=self.patch_torch_functions,
                keep_batchnorm_fp32=self.keep_batchnorm_fp32,
                master_weights=self.master_weights,
                cast_model_outputs=self.cast_model_outputs,
                num_losses=self.num_losses,
                verbosity=self.verbosity,
                min_loss_scale=self.min_loss_scale,
                max_loss_scale=self.max_loss_scale,
            )
            if hasattr(self, "_apex_amp_state_dict"):
                amp.load_state_dict(self._apex_amp_state_dict)
        yield model


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_mmengine_wrapper(opt_level, monkeypatch):
    monkeypatch.setenv("APEX_AMP_DTYPE", "fp16")
    model = make_model()
    wrapper = ApexOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.01), opt_level=opt_level, verbosity=0
    )
    for x, y in batches(3):
        with wrapper.optim_context(model) as m:
            wrapper.backward(loss_fn(m(x), y))
            wrapper.optimizer.step()
            wrapper.optimizer.zero_grad()
    sd = wrapper.state_dict()
    assert "loss_scaler0" in sd["apex_amp"]
    wrapper.load_state_dict(dict(sd))

    # A fresh wrapper loads before initialize: deferred until optim_context.
    amp.reset()
    fresh_model = make_model()
    fresh = ApexOptimWrapper(
        torch.optim.SGD(fresh_model.parameters(), lr=0.01), opt_level=opt_level, verbosity=0
    )
    sd["apex_amp"]["loss_scaler0"]["loss_scale"] = 1024.0
    fresh.load_state_dict(dict(sd))
    with fresh.optim_context(fresh_model):
        pass
    assert amp._amp_state.loss_scalers[0].loss_scale() == 1024.0


def test_deepspeed_amp_path():
    """engine.py: delay_unscale off the accumulation boundary, clip on master_params."""
    assert amp.__path__
    model = make_model()
    basic_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp_params = {"opt_level": "O1"}
    model, optimizer = amp.initialize(
        model, basic_optimizer, low_precision_dtype=FP16, verbosity=0, **amp_params
    )
    gas = 2
    for step, (x, y) in enumerate(batches(6)):
        boundary = (step + 1) % gas == 0
        with amp.scale_loss(
            loss_fn(model(x), y), optimizer, delay_unscale=not boundary
        ) as scaled_loss:
            scaled_loss.backward()
        if boundary:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    assert amp._amp_state.loss_scalers[0]._unskipped == 3


def test_transformers_trainer_pattern():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    for x, y in batches(3):
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_swav_larc_pattern(opt_level):
    """SwAV: apex.parallel.LARC around torch SGD, then amp.initialize, reached as apex.amp;
    it follows the same LARC run in fp32."""
    larc = pytest.importorskip("apex.parallel.LARC", exc_type=ImportError)
    import apex

    def make(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)
        return larc.LARC(optimizer=sgd, trust_coefficient=0.02, clip=False)

    data = batches(20)
    ref = make_model()
    ref_opt = make(ref)
    ref_losses = []
    for x, y in data:
        loss = loss_fn(ref(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    model = make_model()
    optimizer = make(model)
    model, optimizer = apex.amp.initialize(
        model, optimizer, opt_level=opt_level, low_precision_dtype=FP16, verbosity=0
    )
    losses = []
    for x, y in data:
        for param_group in optimizer.param_groups:
            param_group["lr"] = 0.1
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.03, atol=1e-3)
    assert optimizer.optim.param_groups[0]["lr"] == 0.1
    save_dict = {"amp": apex.amp.state_dict()}
    apex.amp.load_state_dict(save_dict["amp"])
    if opt_level == "O2":
        stash = optimizer._amp_stash
        for p, m in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
            torch.testing.assert_close(p, m.half(), rtol=0, atol=0)
