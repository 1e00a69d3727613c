"""Opt levels O0-O3: apex's property tables and the overrides ``initialize`` accepts."""

from __future__ import annotations

import torch

_LOW_PRECISION = "low"  # stands for the chosen low-precision dtype in the tables below


class Properties:
    """The properties of one opt level, after overrides (``_amp_state.opt_properties``)."""

    def __init__(self) -> None:
        self.options = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name):
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'Properties' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if "options" not in self.__dict__:
            super().__setattr__(name, value)
            return
        if name not in self.options:
            super().__setattr__(name, value)
            return
        self.options[name] = _check_property(name, value)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"Properties({body})"


def _check_property(name: str, value):
    if name == "cast_model_type":
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(
                f"cast_model_type must be a floating-point torch.dtype (torch.float16, "
                f"torch.bfloat16, torch.float32) or None, got {value!r}"
            )
        return value
    if name == "keep_batchnorm_fp32":
        if isinstance(value, str):
            if value not in ("True", "False"):
                raise ValueError(
                    f"keep_batchnorm_fp32 must be True, False, 'True', 'False' or None, "
                    f"got {value!r}"
                )
            return value == "True"
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"keep_batchnorm_fp32 must be a bool or None, got {value!r}")
        return value
    if name == "loss_scale":
        if value == "dynamic":
            return value
        try:
            scale = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"loss_scale must be 'dynamic', a number or a numeric string, got {value!r}"
            ) from None
        if not scale > 0 or scale == float("inf"):
            raise ValueError(f"loss_scale must be a positive finite number, got {value!r}")
        return scale
    if name in ("patch_torch_functions", "master_weights", "enabled"):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r}")
        return value
    return value


# apex's tables; "low" is fp16 (apex) or bf16 (chosen as README.md describes).
OPT_LEVELS = {
    "O0": {
        "cast_model_type": torch.float32,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": None,
        "master_weights": False,
        "loss_scale": 1.0,
    },
    "O1": {
        "cast_model_type": None,
        "patch_torch_functions": True,
        "keep_batchnorm_fp32": None,
        "master_weights": None,
        "loss_scale": "dynamic",
    },
    "O2": {
        "cast_model_type": _LOW_PRECISION,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": True,
        "master_weights": True,
        "loss_scale": "dynamic",
    },
    "O3": {
        "cast_model_type": _LOW_PRECISION,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": False,
        "master_weights": False,
        "loss_scale": 1.0,
    },
}

DESCRIPTIONS = {
    "O0": "Pure FP32 training.",
    "O1": "Insert automatic casts around Pytorch functions and Tensor methods.",
    "O2": "FP16 training with FP32 batchnorm and FP32 master weights.",
    "O3": "Pure FP16 training.",
}


def opt_level_properties(opt_level: str, low_precision: torch.dtype) -> Properties:
    """The defaults of ``opt_level`` with ``low_precision`` as the model's cast type (O2, O3).

    bf16 has fp32's exponent range, so where the table says "dynamic" a bf16 run uses a static
    scale of 1.0 (no scaling, no overflow checks); an explicit loss_scale still wins.
    """
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        hint = ""
        if isinstance(opt_level, str) and opt_level[:1] == "0":
            hint = " The prefix O is the letter O, not the number zero."
        raise RuntimeError(
            f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', 'O2', "
            f"'O3'.{hint}"
        )
    props = Properties()
    props.enabled = True
    props.opt_level = opt_level
    for name, value in OPT_LEVELS[opt_level].items():
        if value == _LOW_PRECISION:
            value = low_precision
        if name == "loss_scale" and value == "dynamic" and low_precision == torch.bfloat16:
            value = 1.0
        setattr(props, name, value)
    return props
