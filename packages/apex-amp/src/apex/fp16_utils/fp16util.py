"""apex.fp16_utils' model helpers: casting networks (batchnorm kept fp32), fp32 master params,
and grad/param copies between model and masters (through ``multi_tensor_scale``)."""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from apex.multi_tensor_apply import ops


class tofp16(nn.Module):  # noqa: N801  (apex's name)
    """A module that casts its input to fp16."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802  (apex's name)
    """Turn affine batchnorm layers (everywhere inside ``module``) back to fp32, in place."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in fp16 (batchnorm fp32) behind a module that casts inputs to fp16."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating-point params and buffers (not its children's) to dtype."""
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param._grad is not None and param._grad.is_floating_point():
                param._grad.data = param._grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``network`` to ``dtype``, leaving affine batchnorm layers in fp32 (in place)."""
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (batchnorm fp32), casting its inputs to fp16."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        inputs = tuple(t.half() if t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


@torch.no_grad()
def _copy_lists(src: list, dst: list) -> None:
    if not src:
        return
    groups: dict = {}
    for s, d in zip(src, dst):
        pair = groups.setdefault(s.device, ([], []))
        pair[0].append(s)
        pair[1].append(d)
    for device, (s, d) in groups.items():
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        ops.multi_tensor_scale(s, d, flag, 1.0)


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the trainable params, and fp32 copies of them (one
    flat fp32 tensor when ``flat_master``, which needs all params of one dtype)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(
                "prep_param_lists(flat_master=True) needs the model's params in one dtype, got "
                f"{sorted(str(d) for d in dtypes)}; call it with flat_master=False, or convert "
                "the whole model first (convert_network or model.half())."
            )
        master = _flatten_dense_tensors([p.data for p in model_params]).float()
        master = nn.Parameter(master)
        master.grad = master.new_empty(master.size())
        return model_params, [master]
    masters = [p.detach().clone().float() for p in model_params]
    for m in masters:
        m.requires_grad = True
    return model_params, masters


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model's grads into the masters' grads (fp32)."""
    if flat_master:
        grads = [p.grad.data if p.grad is not None else torch.zeros_like(p) for p in model_params]
        master_params[0].grad.data.copy_(_flatten_dense_tensors(grads))
        return
    src, dst = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad)
        dst.append(master.grad)
    _copy_lists(src, dst)


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the masters' values into the model's params (rounded to their dtype)."""
    if flat_master:
        views = _unflatten_dense_tensors(master_params[0].data, model_params)
        for model, master in zip(model_params, views):
            model.data.copy_(master)
        return
    _copy_lists([m.data for m in master_params], [p.data for p in model_params])


def to_python_float(t):
    """``t`` as a Python float (``t.item()``), or ``t[0]`` for a sequence."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


def clip_grad_norm(parameters, max_norm, norm_type=2):
    """``torch.nn.utils.clip_grad_norm_`` (apex's alias)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
