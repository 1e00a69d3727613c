"""What happens around the steps: state reset or reloaded, weights loaded, layouts changed,
hooks, bad input in a later group, GradScaler's unscale_, torch.compile."""

from __future__ import annotations

import pytest
import torch
from optim_testing import NAMES, assert_close, make, params, roundtrip, run_synthetic

from apex.optimizers import (
    FusedAdam,
    FusedMixedPrecisionLamb,
    FusedSGD,
)

STATE_KEY = {
    "FusedAdam": "exp_avg",
    "FusedSGD": "momentum_buffer",
    "FusedNovoGrad": "exp_avg",
    "FusedAdagrad": "sum",
    "FusedLAMB": "exp_avg",
    "FusedMixedPrecisionLamb": "exp_avg",
}


def conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)
    )


# ---- one param's state reset ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["assign", "delete"])
@pytest.mark.parametrize("name", NAMES)
def test_resetting_one_params_state_reinitialises_it(name, how):
    """opt.state[p] = {} (or del, then a read through the defaultdict) re-creates p's state on
    the next step, as torch does; the cached lists must not keep stepping the old tensors."""
    ps = params()
    opt = make(name, ps)
    run_synthetic(opt, ps, steps=3)
    old = opt.state[ps[0]][STATE_KEY[name]]
    if how == "assign":
        opt.state[ps[0]] = {}
    else:
        del opt.state[ps[0]]
        assert opt.state[ps[0]].get(STATE_KEY[name]) is None
    run_synthetic(opt, ps, steps=1, seed=7)
    new = opt.state[ps[0]][STATE_KEY[name]]
    assert new is not old
    assert STATE_KEY[name] in opt.state_dict()["state"][0]


def test_reset_state_starts_from_zero_moments():
    """FusedAdam: after a reset, p's moments are those of one step from zeros; FusedSGD follows
    torch.optim.SGD through the same reset."""
    ps = params()
    opt = FusedAdam(ps, lr=1e-2, betas=(0.9, 0.999))
    run_synthetic(opt, ps, steps=3)
    opt.state[ps[0]] = {}
    g = torch.randn(ps[0].shape)
    for p in ps:
        p.grad = g.clone() if p is ps[0] else torch.randn(p.shape)
    opt.step()
    torch.testing.assert_close(opt.state[ps[0]]["exp_avg"], 0.1 * g)
    torch.testing.assert_close(opt.state[ps[0]]["exp_avg_sq"], 0.001 * g * g)

    ps, ref = params(), params()
    sgd = FusedSGD(ps, lr=0.1, momentum=0.9)
    torch_sgd = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for o, qs in ((sgd, ps), (torch_sgd, ref)):
        run_synthetic(o, qs, steps=3)
        o.state[qs[1]] = {}
        run_synthetic(o, qs, steps=3, seed=11)
    assert_close(ps, ref)


# ---- masters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB"])
def test_master_from_a_phase_with_masters_is_not_carried_through_one_without(name):
    """bf16 with masters, then resumed without (train), then with again: the last phase starts
    from the params, not from the first phase's master."""
    ps = params(torch.bfloat16)
    opt = make(name, ps, lr=0.1, master_weights=True)
    run_synthetic(opt, ps, steps=3)
    plain = make(name, ps, lr=0.1, master_weights=False)
    plain.load_state_dict(roundtrip(opt.state_dict()))
    assert "master_param" not in plain.state_dict()["state"][0]
    run_synthetic(plain, ps, steps=5)
    assert "master_param" not in plain.state_dict()["state"][0]
    again = make(name, ps, lr=0.1, master_weights=True)
    again.load_state_dict(roundtrip(plain.state_dict()))
    for group in again.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in ps]
    run_synthetic(again, ps, steps=1)
    for p, b in zip(ps, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("name", NAMES)
def test_weights_loaded_after_masters_were_read_are_kept(name):
    """param_groups_master read early (a logging or clipping helper), then the weights loaded:
    the first step starts from the loaded weights, through the same master tensors."""
    net = torch.nn.Linear(4, 2).bfloat16()
    kw = {"reduced_precision_dtype": torch.bfloat16} if name == "FusedMixedPrecisionLamb" else {}
    opt = make(name, list(net.parameters()), lr=1e-3, master_weights=True, **kw)
    attr = (
        "param_groups_full_precision"
        if name == "FusedMixedPrecisionLamb"
        else "param_groups_master"
    )
    early = getattr(opt, attr)[0]["params"]
    net.load_state_dict({k: torch.full_like(v, 5.0) for k, v in net.state_dict().items()})
    net(torch.randn(3, 4).bfloat16()).float().sum().backward()
    opt.step()
    assert all(
        torch.allclose(p.float(), torch.full_like(p.float(), 5.0), atol=0.1)
        for p in net.parameters()
    )
    assert all(opt.state[p]["master_param"] is m for p, m in zip(net.parameters(), early))


# ---- memory formats ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_model_made_channels_last_after_a_step(name):
    net, ref = conv_model(), conv_model()
    opt, ref_opt = make(name, list(net.parameters())), make(name, list(ref.parameters()))
    x = torch.randn(2, 3, 8, 8)
    for step in range(4):
        if step == 2:
            net.to(memory_format=torch.channels_last)
        for m, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    w = net[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last)
    assert opt.state[w][STATE_KEY[name]].stride() == w.stride()
    assert_close(net.parameters(), ref.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_channels_last_checkpoint_into_contiguous_model(name):
    net = conv_model().to(memory_format=torch.channels_last)
    opt = make(name, list(net.parameters()))
    x = torch.randn(2, 3, 8, 8)
    net(x).square().sum().backward()
    opt.step()
    net2 = conv_model()
    net2.load_state_dict(net.state_dict())
    opt2 = make(name, list(net2.parameters()))
    opt2.load_state_dict(roundtrip(opt.state_dict()))
    w = net2[0].weight
    assert opt2.state[w][STATE_KEY[name]].stride() == w.stride()
    net2(x).square().sum().backward()
    opt2.step()


# ---- bad input in a later group ------------------------------------------------------------------


def _two_groups(name):
    a = torch.nn.Parameter(torch.randn(3))
    b = torch.nn.Parameter(torch.randn(3, 3))
    opt = make(name, [{"params": [a]}, {"params": [b]}])
    return a, b, opt


def _unchanged(opt, a, a0):
    assert torch.equal(a, a0)
    assert len(opt.state) == 0
    for g in opt.param_groups:
        step = g.get("step")
        assert step is None or (isinstance(step, torch.Tensor) and step.tolist() == [0])


@pytest.mark.parametrize("name", NAMES)
def test_bad_grad_layout_in_a_later_group_changes_nothing(name):
    a, b, opt = _two_groups(name)
    a.grad, b.grad = torch.randn(3), torch.randn(3, 3).t()
    a0 = a.detach().clone()
    with pytest.raises(
        ValueError, match=rf"{name}: param group 1: the grad of parameter 0 is not contiguous"
    ):
        opt.step()
    _unchanged(opt, a, a0)


@pytest.mark.parametrize("name", NAMES)
def test_sparse_grad_in_a_later_group_changes_nothing(name):
    a = torch.nn.Parameter(torch.randn(3))
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = make(name, [{"params": [a]}, {"params": list(emb.parameters())}])
    (emb(torch.tensor([1, 2])).sum() + a.sum()).backward()
    a0 = a.detach().clone()
    with pytest.raises(RuntimeError, match="param group 1: parameter 0 has a sparse gradient") as e:
        opt.step()
    assert ("SparseAdam" in str(e.value)) == (name == "FusedAdam")
    if name in ("FusedSGD", "FusedAdagrad"):
        assert f"torch.optim.{name.removeprefix('Fused')} does" in str(e.value)
    _unchanged(opt, a, a0)


@pytest.mark.parametrize("name", NAMES)
def test_bad_grad_after_cached_steps_changes_nothing(name):
    """The cached plans check the grads' layout every step, before any kernel or step count."""
    ps = params()
    assert ps[2].dim() == 2
    opt = make(name, [{"params": ps[:2]}, {"params": ps[2:]}])
    run_synthetic(opt, ps, steps=2)
    before = [p.detach().clone() for p in ps]
    steps = [str(g.get("step")) for g in opt.param_groups]
    for p in ps:
        p.grad = torch.randn(p.shape)
    ps[2].grad = torch.randn(tuple(reversed(ps[2].shape))).t()
    with pytest.raises(ValueError, match="param group 1: the grad of parameter 0"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert [str(g.get("step")) for g in opt.param_groups] == steps


@pytest.mark.parametrize("name", NAMES)
def test_param_cast_after_steps_is_refused_or_taken_before_any_group_steps(name):
    """A param cast after it was added (p.data =, module.double()): to a dtype the optimizer
    does not take, the step refuses it naming the group, before any group's kernel or step
    count (every cached plan noticed the cast); to one it takes, the step goes on in it
    (NovoGrad, whose per-param norms are kept by dtype bucket, refuses that by name)."""
    ps = params()
    opt = make(name, [{"params": ps[:2]}, {"params": ps[2:]}])
    run_synthetic(opt, ps, steps=2)
    before = [p.detach().clone() for p in ps]
    state = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in ps]
    steps = [str(g.get("step")) for g in opt.param_groups]
    for keep_grad in (True, False):  # the old float32 grad kept (p.data =), or a new one
        for p in ps:
            p.grad = torch.randn_like(p)
        ps[2].data = ps[2].data.double()
        if not keep_grad:
            ps[2].grad = torch.randn_like(ps[2])
        with pytest.raises(
            TypeError, match=r"param group 1: the parameter 0 has dtype torch.float64"
        ):
            opt.step()
        assert all(torch.equal(p.double(), b.double()) for p, b in zip(ps, before))
        for p, saved in zip(ps, state):
            assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items())
        assert [str(g.get("step")) for g in opt.param_groups] == steps
        ps[2].data = ps[2].data.float()
    ps[2].data = ps[2].data.bfloat16()
    ps[2].grad = torch.randn_like(ps[2])
    cast = ps[2].detach().clone()
    if name == "FusedNovoGrad":
        with pytest.raises(RuntimeError, match="param group 1: .* grad norms"):
            opt.step()
        return
    opt.step()
    assert ps[2].dtype == torch.bfloat16 and torch.isfinite(ps[2].float()).all()
    assert not torch.equal(ps[2], cast)


# ---- hooks, GradScaler, lr -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb"])
def test_load_state_dict_post_hooks_run_last(name):
    p = torch.nn.Parameter(torch.randn(3))
    opt = make(name, [p])

    def hook(o):
        for q in o.param_groups[0]["params"]:
            o.state[q]["exp_avg"] = torch.full_like(q, 7.0)

    opt.register_load_state_dict_post_hook(hook)
    p.grad = torch.ones(3)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.state[p]["exp_avg"].tolist() == [7.0, 7.0, 7.0]


@pytest.mark.parametrize("master_weights", [False, True])
def test_apex_grad_scaler_keyword_after_unscale(master_weights):
    """scaler.unscale_(opt) for clipping, then apex's opt.step(grad_scaler=scaler): the grads
    are not unscaled a second time."""
    dtype = torch.bfloat16 if master_weights else torch.float32
    p = torch.nn.Parameter(torch.randn(4).to(dtype))
    opt = FusedAdam([p], lr=0.1, master_weights=master_weights)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    p.grad = scaler.scale(torch.ones(4, dtype=dtype))
    scaler.unscale_(opt)
    opt.step(grad_scaler=scaler)
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.1] * 4)


def test_mixed_precision_lamb_grad_scaler_keyword_after_unscale():
    ps, ref = params(), params()
    opt, ref_opt = FusedMixedPrecisionLamb(ps, lr=0.1), FusedMixedPrecisionLamb(ref, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        gs = [torch.randn(p.shape) * 0.01 for p in ps]
        for p, q, g in zip(ps, ref, gs):
            p.grad, q.grad = scaler.scale(g.clone()), g.clone()
        scaler.unscale_(opt)
        opt.step(grad_scaler=scaler)
        scaler.update()
        ref_opt.step()
    assert_close(ps, ref)


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD"])
def test_lr_must_be_a_number(name):
    with pytest.raises(TypeError, match=rf"{name}: param group 0: lr must be a number"):
        make(name, params(), lr="0.1")


# ---- torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB"])
def test_compiled_training_step_compiles_a_bounded_number_of_graphs(name):
    """The step is not traced (torch.compiler.disable): compile breaks the graph around it
    instead of guarding on the cached plans and recompiling every step."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        opt = make(name, list(net.parameters()))

        def train_step(x, net=net, opt=opt):
            loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = torch.compile(train_step, backend="eager") if compiled else train_step
        g = torch.Generator().manual_seed(1)
        for i in range(10):
            fn(torch.randn(5, 4, generator=g))
            if compiled and i == 2:
                graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        results.append([p.detach().clone() for p in net.parameters()])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert graphs <= 4
    for a, b in zip(*results):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", NAMES)
def test_a_master_written_after_it_was_read_is_kept(name):
    """A master restored by hand (an fp32 checkpoint copied into param_groups_master, then the
    param synced from it) is what the first step starts from: the refresh of masters whose
    params were loaded after they were read leaves alone a master that was written itself."""
    net = torch.nn.Linear(4, 2).bfloat16()
    kw = {"reduced_precision_dtype": torch.bfloat16} if name == "FusedMixedPrecisionLamb" else {}
    opt = make(name, list(net.parameters()), lr=0.0, master_weights=True, **kw)
    attr = (
        "param_groups_full_precision"
        if name == "FusedMixedPrecisionLamb"
        else "param_groups_master"
    )
    exact = 0.123456789  # bf16 holds 0.12353515625
    with torch.no_grad():
        for m, p in zip(getattr(opt, attr)[0]["params"], net.parameters()):
            m.fill_(exact)
            p.copy_(m)
    net(torch.randn(3, 4).bfloat16()).float().sum().backward()
    opt.step()
    for p in net.parameters():
        assert torch.equal(
            opt.state[p]["master_param"], torch.full_like(p, exact, dtype=torch.float32)
        )


def test_a_plain_mapping_assigned_to_state_is_the_state():
    """As torch.optim: a mapping assigned to opt.state is used as it is (code may hold it), not
    copied into another."""
    from collections import defaultdict

    p = torch.nn.Parameter(torch.randn(3))
    opt = FusedAdam([p], lr=0.1)
    mine = defaultdict(dict)
    opt.state = mine
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state is mine and "exp_avg" in mine[p]


def test_a_numpy_lr_is_accepted():
    np = pytest.importorskip("numpy")
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=np.array(0.5))
    p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))


def test_importing_the_optimizers_does_not_import_dynamo():
    """step is made opaque to torch.compile lazily: importing torch._dynamo costs most of a
    second, which an import of apex.optimizers (or of apex.amp) should not pay."""
    import subprocess
    import sys

    code = "import sys, apex.optimizers, apex.optimizers.fused_adam; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name", NAMES)
def test_param_made_channels_last_with_contiguous_grad_changes_nothing(name):
    """A param switched to channels_last through .data after cached steps, its grad still
    contiguous (a kept grad buffer): refused by name before any group steps."""
    a = torch.nn.Parameter(torch.randn(4, 5))
    w = torch.nn.Parameter(torch.randn(3, 4, 2, 2))
    opt = make(name, [{"params": [a]}, {"params": [w]}])
    for _ in range(3):
        a.grad, w.grad = torch.randn_like(a), torch.randn_like(w)
        opt.step()
    a0, steps = a.detach().clone(), [str(g.get("step")) for g in opt.param_groups]
    w.data = w.data.to(memory_format=torch.channels_last)
    a.grad, w.grad = torch.randn_like(a), torch.randn(3, 4, 2, 2)
    with pytest.raises(ValueError, match="param group 1: the grad of parameter 0 has strides"):
        opt.step()
    assert torch.equal(a, a0)
    assert [str(g.get("step")) for g in opt.param_groups] == steps
