"""clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
from optim_testing import DTYPES, TOLERANCES, params

import apex.optimizers
from apex.optimizers import clip_grad_norm_


def with_grads(ps, scale=1.0):
    for p in ps:
        p.grad = (torch.randn(p.shape) * scale).to(p.dtype)
    return ps


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch(dtype, max_norm):
    ps = with_grads(params(dtype))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, ref):
        q.grad = p.grad.clone()
    # float32 math for every dtype (torch sums fp16/bf16 norms in their own precision)
    norm32 = torch.linalg.vector_norm(torch.cat([p.grad.float().reshape(-1) for p in ps]))
    total = clip_grad_norm_(ps, max_norm)
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    atol, rtol = TOLERANCES[dtype]
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, norm32, atol=1e-5, rtol=1e-5)
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol)


def test_mixed_dtypes_one_norm():
    ps = with_grads(params(torch.float16)[:2] + params()[2:4] + params(torch.bfloat16)[4:])
    expected = torch.linalg.vector_norm(torch.cat([p.grad.float().reshape(-1) for p in ps]))
    before = [p.grad.float().clone() for p in ps]
    total = clip_grad_norm_(iter(ps), max_norm=1.0)  # any iterable, as torch takes
    torch.testing.assert_close(total, expected)
    coef = 1.0 / (expected + 1e-6)
    for p, b in zip(ps, before):
        tol = TOLERANCES[p.dtype]
        torch.testing.assert_close(p.grad.float(), b * coef, atol=tol[0], rtol=tol[1])


def test_single_tensor_frozen_params_and_no_grads():
    p, frozen = with_grads(params(shapes=[(3, 4)]))[0], params(shapes=[(2,)])[0]
    norm = p.grad.norm()
    assert torch.allclose(clip_grad_norm_(p, 1e9), norm)
    assert torch.allclose(clip_grad_norm_([p, frozen], 1e9), norm)
    assert clip_grad_norm_([frozen], 1.0).item() == 0.0


def test_other_norm_types_and_errors_go_to_torch():
    ps = with_grads(params())
    expected = max(p.grad.abs().max() for p in ps)
    assert torch.allclose(clip_grad_norm_(ps, 1e9, norm_type=float("inf")), expected)
    ps[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    assert clip_grad_norm_(ps, 1.0, foreach=True).isnan()


def test_exposed_under_apex_optimizers():
    assert apex.optimizers.clip_grad_norm_ is clip_grad_norm_
    from apex.optimizers.clip_grad import clip_grad_norm_ as same

    assert same is clip_grad_norm_
