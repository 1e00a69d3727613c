"""amp with torch's wrappers applied after initialize: torch.compile and DistributedDataParallel
(one gloo process)."""

from __future__ import annotations

import os

import pytest
import torch
from amp_testing import batches, make_model, train_amp

import apex.amp as amp


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_compiled_model_trains_like_the_eager_one(opt_level):
    data = batches(5)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, low_precision_dtype=torch.bfloat16, verbosity=0
    )
    compiled = torch.compile(model, backend="aot_eager")
    losses = train_amp(compiled, opt, data, amp)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    amp.reset()
    ref, ref_opt = amp.initialize(
        ref, ref_opt, opt_level=opt_level, low_precision_dtype=torch.bfloat16, verbosity=0
    )
    ref_losses = train_amp(ref, ref_opt, data, amp)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=1e-3)


@pytest.mark.distributed
def test_ddp_after_initialize_one_process(tmp_path):
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = amp.initialize(
            model, opt, opt_level="O2", low_precision_dtype=torch.float16, verbosity=0
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        losses = train_amp(ddp, opt, batches(10), amp)
        assert losses[-1] < losses[0]
        assert all(m.dtype == torch.float32 for m in amp.master_params(opt))
    finally:
        dist.destroy_process_group()
