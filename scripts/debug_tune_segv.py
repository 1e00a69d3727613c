"""Debugging aid (2026-12-05): the SIGSEGV of processes whose APEX_NORM_TUNE gives notes. One
forward+backward of FusedLayerNorm at [33, 4096] bf16 on the first op call (the library loads
inside it), under faulthandler; VARIANT: plain, nowarn (the post-load hook dropped), quiet (the notes read but printed, not warned), keep (the
Python loaders not destroyed before the library opens), preload (the library loaded before the
first op call, outside any dispatch)."""

import faulthandler
import sys
import warnings

import torch

faulthandler.enable()
variant = sys.argv[1]
from apex.multi_tensor_apply.build import loader  # noqa: E402
from apex.normalization import FusedLayerNorm, ops  # noqa: E402

if variant == "nowarn":
    loader._post_load[ops.NORM.name].clear()
if variant == "quiet":
    import ctypes

    def quiet(ext):
        notes = ctypes.CDLL(str(ext.path)).apex_norm_tune_notes
        notes.restype = ctypes.c_char_p
        print("notes", notes().decode().replace("\n", " | "), flush=True)

    loader._post_load[ops.NORM.name][:] = [quiet]
if variant == "keep":
    loader._pre_load[ops.NORM.name].clear()
if variant == "preload":
    ops.OPS.ensure_loaded()
print("start", variant, flush=True)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    m = FusedLayerNorm(4096).cuda().bfloat16()
    x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(x).sum().backward()
    torch.cuda.synchronize()
print("ok", variant, len(seen), [str(w.message)[:60] for w in seen], flush=True)
