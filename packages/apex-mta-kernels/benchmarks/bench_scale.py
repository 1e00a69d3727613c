"""multi_tensor_scale vs torch._foreach_mul on the GPT-like list and on many small tensors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_utils import (  # noqa: E402
    Row,
    copy_bandwidth,
    gpt_like_shapes,
    host_ms,
    make,
    numel,
    small_shapes,
    time_cuda,
    wall_ms,
    write,
)

from apex.multi_tensor_apply import ops  # noqa: E402


def run(ceiling: Row) -> list[Row]:
    rows = []
    for case, shapes in (("gpt-1.3B", gpt_like_shapes()), ("5000x4096", small_shapes())):
        for dtype in (torch.float32, torch.bfloat16):
            xs = make(shapes, dtype)
            noop = torch.zeros(1, dtype=torch.int32, device="cuda")
            gb = 2 * numel(xs) * xs[0].element_size() / 1e9  # read + write in place
            label = f"{case} {str(dtype).removeprefix('torch.')}"

            def ours(xs=xs, noop=noop):
                ops.multi_tensor_scale(xs, xs, noop, 1.0001)

            def theirs(xs=xs):
                torch._foreach_mul_(xs, 1.0001)

            for impl, fn in (("apex_mta", ours), ("torch._foreach_mul_", theirs)):
                rows.append(
                    Row(
                        "scale",
                        label,
                        impl,
                        time_cuda(fn),
                        gb,
                        host_ms(fn),
                        {"wall_ms": wall_ms(fn)},
                    )
                )
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    ceiling = copy_bandwidth()
    print(write(run(ceiling), ceiling, args.out, "bench_scale"))


if __name__ == "__main__":
    main()
