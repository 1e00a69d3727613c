"""One forward+backward of apex-norm's RMSNorm and LayerNorm (bf16 [32768, H]) for Nsight
Compute: each kernel launches once, so `ncu -k regex:...` profiles each once.

    ncu --clock-control none -k regex:"fwd_fast|bwd_ring" --section SpeedOfLight \
        python3 scripts/ncu_norm_driver.py [H]
"""

from __future__ import annotations

import sys

import torch

import apex.normalization as N


def main() -> int:
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    for module in (N.FusedRMSNorm(H), N.FusedLayerNorm(H)):
        module = module.cuda().to(torch.bfloat16)
        x = torch.randn(32768, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        torch.autograd.grad(module(x), [x, *module.parameters()], dy)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
