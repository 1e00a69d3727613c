"""apex's ``python -m apex.parallel.multiproc`` launcher is replaced by torchrun.

Use ``torchrun --nproc_per_node=NUM_GPUS train.py ...``: it starts one process per GPU and
sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; in the script call
``torch.distributed.init_process_group("nccl")`` and
``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``. Running this module says so.
"""

from __future__ import annotations

MESSAGE = (
    "apex.parallel.multiproc was removed: launch with torchrun instead, e.g. "
    "`torchrun --nproc_per_node=NUM_GPUS train.py ARGS` (it sets RANK, LOCAL_RANK and "
    "WORLD_SIZE; call torch.distributed.init_process_group('nccl') in the script)."
)


def main() -> int:
    import sys

    sys.stderr.write(MESSAGE + "\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
