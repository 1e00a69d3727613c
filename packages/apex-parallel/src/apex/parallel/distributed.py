"""apex.parallel.DistributedDataParallel, Reducer and the flat collective helpers, on
torch.distributed (NCCL on GPUs, gloo on CPUs).

Gradients are all-reduced in flat buckets while backward still runs: each parameter's
post-accumulate-grad hook marks it ready, and a bucket is launched as an asynchronous all_reduce
(on a side CUDA stream on GPUs) as soon as all of its parameters are. A callback queued on the
autograd engine waits for every bucket at the end of backward, averages and writes the results
back into ``.grad``. The first backward (and the first after the set of trainable parameters
changes) records the order in which gradients become ready; rank 0's order is broadcast, and
buckets of at least ``message_size`` elements per (dtype, device) are cut from it.

apex's ``multiproc`` launcher is replaced by torchrun: ``torchrun --nproc_per_node=N train.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.profiler import record_function

logger = logging.getLogger(__name__)

__all__ = [
    "DistributedDataParallel",
    "Reducer",
    "flat_dist_call",
    "apply_flat_dist_call",
    "flatten",
    "unflatten",
    "split_by_type",
    "split_half_float_double",
    "extract_tensors",
    "import_flatten_impl",
]


def import_flatten_impl():
    """apex's hook to pick its C++ flatten; torch's own is used here and is as fast."""
    return flatten, unflatten


def _scale_(flat, factor):
    """``flat *= factor``, skipped when the factor is 1 (no predivision; one rank averaging):
    the same bits, one kernel less per bucket."""
    if factor != 1.0:
        flat.mul_(factor)


def _copy_all_(dst, src):
    """``d.copy_(s)`` for each pair. Pairs of the same strides go to one multi-tensor launch
    (the reduced bucket written back: one kernel instead of one per parameter); the others, e.g.
    a channels_last conv weight's gradient against its bucket's contiguous view, copy one by
    one (torch's multi-tensor copy would take its slow path for the whole list because of one)."""
    same_d, same_s = [], []
    for d, s in zip(dst, src):
        if d.stride() == s.stride():
            same_d.append(d)
            same_s.append(s)
        else:
            d.copy_(s)
    if same_d:
        torch._foreach_copy_(same_d, same_s)


def flatten(bucket):
    """One contiguous 1-D tensor holding every tensor of ``bucket`` (same dtype and device)."""
    return torch._utils._flatten_dense_tensors(list(bucket))


def unflatten(coalesced, bucket):
    """Views of ``coalesced`` shaped like the tensors of ``bucket``."""
    return torch._utils._unflatten_dense_tensors(coalesced, list(bucket))


def split_by_type(tensors):
    """Tensors grouped by ``(dtype, device)``, in first-seen order."""
    buckets = OrderedDict()
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    return buckets


def split_half_float_double(tensors):
    """apex's helper, kept for callers: lists of tensors per dtype; bfloat16 is included
    (apex skipped it silently)."""
    return list(split_by_type(tensors).values())


def apply_flat_dist_call(bucket, call, extra_args=None):
    """``call(flat, *extra_args)`` on the flattened ``bucket``, copied back; after an
    ``all_reduce`` the result is divided by the world size, as apex does."""
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
        buf.copy_(synced)


def flat_dist_call(tensors, call, extra_args=None):
    """``apply_flat_dist_call`` on each ``(dtype, device)`` group of ``tensors``; e.g.
    ``flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))``."""
    with torch.no_grad():
        for bucket in split_by_type(tensors).values():
            apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor, tensor_list):
    """Append every tensor found in ``maybe_tensor`` (nested lists/tuples/dicts) to ``tensor_list``."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
    elif isinstance(maybe_tensor, dict):
        for v in maybe_tensor.values():
            extract_tensors(v, tensor_list)
    elif isinstance(maybe_tensor, (list, tuple)):
        for v in maybe_tensor:
            extract_tensors(v, tensor_list)


def _require_initialized(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs torch.distributed initialised first: call "
            "torch.distributed.init_process_group(...) (torchrun sets the environment it reads)"
        )


class Reducer:
    """All-reduce and average gradients by hand with ``reduce()``.

    ``Reducer(module)`` broadcasts the module's parameters from rank 0 at construction and
    ``reduce()`` averages the gradients of its parameters that have one; ``Reducer(grads)``
    keeps the given tensors and ``reduce()`` averages those.
    """

    def __init__(self, module_or_grads_list):
        _require_initialized("apex.parallel.Reducer")
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self):
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        if grads:
            flat_dist_call(grads, dist.all_reduce)


class _Bucket:
    __slots__ = ("params", "ready", "work", "flat", "group", "stream", "done")

    def __init__(self, params):
        self.params = params
        self.ready = 0
        self.work = None
        self.flat = None
        self.group = None
        self.stream = None
        self.done = False


class DistributedDataParallel(torch.nn.Module):
    """apex's DistributedDataParallel: gradients all-reduced in flat buckets during backward.

    Arguments are apex's. ``message_size`` is the minimum elements per bucket;
    ``delay_allreduce=True`` reduces everything once at the end of backward (no overlap);
    ``allreduce_trigger_params`` ends a bucket at each of those parameters instead of by size;
    ``retain_allreduce_buffers=True`` keeps the reduced flat buffers in ``allreduce_buffers``
    (gradients become views into them where dtypes match); ``allreduce_always_fp32`` reduces
    low-precision buckets in float32; ``num_allreduce_streams`` CUDA side streams (and process
    groups) take buckets in turn, or ``allreduce_communicators=(groups, streams)`` supplies them;
    ``gradient_average`` divides the sum by the world size, in two steps around the all_reduce
    when ``gradient_predivide_factor`` is not 1; ``prof`` labels each step for the profiler.
    ``shared_param`` is refused as in apex; ``gradient_average_split_factor`` is apex's old name
    of ``gradient_predivide_factor``.

    As in apex, parameters are broadcast from rank 0 at construction and buffers are never
    synchronised; ``disable_allreduce()``/``enable_allreduce()`` skip the reduction, for
    gradient accumulation. Unlike apex, bfloat16 parameters are supported, and a parameter
    that gets no gradient on a backward does not raise: its bucket is reduced at the end with
    zeros in its place, and it receives the reduced gradient.
    """

    def __init__(
        self,
        module,
        message_size=10000000,
        delay_allreduce=False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers=False,
        allreduce_always_fp32=False,
        num_allreduce_streams=1,
        allreduce_communicators=None,
        gradient_average=True,
        gradient_predivide_factor=1.0,
        gradient_average_split_factor=None,
        prof=False,
    ):
        super().__init__()
        _require_initialized("apex.parallel.DistributedDataParallel")
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported as an option. It was misleadingly named "
                "from the start; use delay_allreduce=True for the same effect"
            )
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError(
                "Setting allreduce_trigger_params is only valid if delay_allreduce=False."
            )
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 is only valid if delay_allreduce=False.")
        if num_allreduce_streams < 1:
            raise ValueError(
                f"num_allreduce_streams must be at least 1, got {num_allreduce_streams}"
            )
        if gradient_average_split_factor is not None:
            logger.warning(
                "gradient_average_split_factor is deprecated; use gradient_predivide_factor"
            )
            gradient_predivide_factor = gradient_average_split_factor

        self.module = module
        self.message_size = int(message_size)
        self.delay_allreduce = bool(delay_allreduce)
        self.retain_allreduce_buffers = bool(retain_allreduce_buffers)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = bool(prof)
        self.world_size = dist.get_world_size()
        self.allreduce_buffers = []
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_communicators = allreduce_communicators
        if allreduce_communicators is not None:
            groups, streams = allreduce_communicators
            if len(groups) != len(streams) or not groups:
                raise ValueError(
                    "allreduce_communicators must be (groups, streams) of the same nonzero length, "
                    f"got {len(groups)} groups and {len(streams)} streams"
                )
            self.allreduce_different_streams = True
            self.num_allreduce_streams = len(groups)
        self.trigger_ids = (
            {id(p) for p in allreduce_trigger_params}
            if allreduce_trigger_params is not None
            else None
        )
        self.needs_reduction = True
        self._groups = None
        self._streams = None

        params = list(self.module.parameters())
        backend = dist.get_backend()
        # Buckets reduce on CUDA side streams with NCCL (created at the first launch).
        self._side_streams = backend == "nccl" and torch.cuda.is_available()
        if backend == "nccl":
            for p in params:
                if not p.is_cuda:
                    raise ValueError(
                        "DistributedDataParallel with the NCCL backend needs every parameter on a "
                        "CUDA device; move the model with .cuda() first"
                    )
        flat_dist_call([p.data for p in params], dist.broadcast, (0,))

        if self.allreduce_different_streams and allreduce_communicators is None:
            # Created here, on every rank together; buckets take them in turn.
            self._groups = [
                dist.new_group(backend=backend) for _ in range(self.num_allreduce_streams)
            ]
        self._hooks = {}
        self._active_params = []
        self._param_index = {}
        self._buckets = None  # list of _Bucket once the structure is known
        self._param_bucket = {}
        self._order = []
        self._refresh = True
        self.create_hooks()
        self._begin_iteration()

    # -- public apex API ------------------------------------------------------------------------

    # apex's attributes for these two (a client may set them): needs_refresh rebuilds the
    # bucket structure at the next forward; _disable_allreduce is disable_allreduce()'s flag.
    @property
    def needs_refresh(self):
        return self._refresh

    @needs_refresh.setter
    def needs_refresh(self, value):
        self._refresh = bool(value)

    @property
    def _disable_allreduce(self):
        return not self.needs_reduction

    @_disable_allreduce.setter
    def _disable_allreduce(self, value):
        self.needs_reduction = not value

    def enable_allreduce(self):
        self.needs_reduction = True

    def disable_allreduce(self):
        self.needs_reduction = False

    def forward(self, *inputs, **kwargs):
        with self._label("forward"):
            active = [p for p in self.module.parameters() if p.requires_grad]
            if [id(p) for p in active] != [id(p) for p in self._active_params]:
                self._refresh = True
            if self._refresh:
                self.create_hooks()
            self._begin_iteration()
            return self.module(*inputs, **kwargs)

    def create_hooks(self):
        """Hook every trainable parameter (once) and forget the bucket structure."""
        self._active_params = [p for p in self.module.parameters() if p.requires_grad]
        self._param_index = {id(p): i for i, p in enumerate(self._active_params)}
        for p in self._active_params:
            if id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._grad_ready)
        self._buckets = None
        self._param_bucket = {}
        self._refresh = False

    def sync_bucket_structure(self):
        """Broadcast rank 0's order of ready gradients so every rank cuts the same buckets."""
        n = len(self._active_params)
        order = list(self._order) + [i for i in range(n) if i not in set(self._order)]
        device = self._comm_device()
        t = torch.tensor(order, dtype=torch.int64, device=device)
        if self.world_size > 1:
            dist.broadcast(t, 0)
        self._build_buckets([int(i) for i in t.tolist()])

    def allreduce_fallback(self):
        """Reduce every gradient at once in per-type buckets (delay_allreduce). Which parameters
        take part is agreed across ranks first (one small all_reduce of flags): one that has a
        gradient on any rank is reduced on every rank, with zeros where it has none; one that
        has none anywhere keeps None. (apex took each rank's own parameters with gradients, so
        ranks that disagreed, a branch taken on one rank only, paired all_reduces of different
        sizes: gloo aborts, NCCL hangs or mixes the data.)"""
        params = self._active_params
        has = [p.grad is not None for p in params]
        if self.world_size > 1 and params:
            flags = torch.tensor(has, dtype=torch.int32, device=self._comm_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group(0))
            has = [bool(v) for v in flags.tolist()]
        params = [p for p, h in zip(params, has) if h]
        chunks = list(split_by_type(params).values())
        self.allreduce_buffers = []
        for i, chunk in enumerate(chunks):
            bucket = _Bucket(chunk)
            self._launch(bucket, i)
            self._finish(bucket)

    def allreduce_bucket(self, bucket, bucket_idx=0, force_default_stream=False):
        """As apex: the tensors of ``bucket`` reduced (and, with ``gradient_average``, averaged)
        with this module's options into one flat tensor of their dtype, which is returned, and
        written back into them unless ``retain_allreduce_buffers``; waits for the result. The
        reduction runs on the current stream (through the process group that bucket
        ``bucket_idx`` would take), so ``force_default_stream`` changes nothing."""
        tensors = list(bucket)
        with torch.no_grad():
            flat = flatten(tensors)
            reduced = self._to_reduce(flat)  # a float32 copy with allreduce_always_fp32
            dist.all_reduce(reduced, group=self._group(bucket_idx))
            self._average_(reduced)
            if reduced is not flat:
                flat.copy_(reduced)
            if not self.retain_allreduce_buffers:
                _copy_all_(tensors, unflatten(flat, tensors))
        return flat

    def allreduce_maybe_retain(self, bucket, bucket_idx=0, force_default_stream=False):
        """Reduce ``bucket`` (allreduce_bucket); with ``retain_allreduce_buffers`` its tensors
        become views into the flat result (apex's ``grad.data = view``), which is kept in
        ``allreduce_buffers``."""
        flat = self.allreduce_bucket(bucket, bucket_idx, force_default_stream)
        if self.retain_allreduce_buffers:
            with torch.no_grad():
                for t, view in zip(bucket, unflatten(flat, bucket)):
                    t.data = view
            self.allreduce_buffers.append(flat)
        return flat

    def comm_ready_buckets(self, param):
        """apex's name for the hook body: ``param``'s gradient is ready."""
        self._grad_ready(param)

    # -- the machinery --------------------------------------------------------------------------

    def _label(self, what):
        return record_function(f"apex.parallel.DDP.{what}") if self.prof else nullcontext()

    def _comm_device(self):
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _begin_iteration(self):
        self._callback_queued = False
        self._order = []
        self._stray = []
        self._next_launch = 0
        if self._buckets is not None:
            for b in self._buckets:
                b.ready, b.work, b.flat, b.done = 0, None, None, False

    def _build_buckets(self, order):
        by_type = OrderedDict()
        self._buckets = []
        for idx in order:
            p = self._active_params[idx]
            key = (p.dtype, p.device)
            current = by_type.setdefault(key, [])
            current.append(p)
            size = sum(q.numel() for q in current)
            if self.trigger_ids is not None:
                cut = id(p) in self.trigger_ids
            else:
                cut = size >= self.message_size
            if cut:
                self._buckets.append(_Bucket(current))
                by_type[key] = []
        for rest in by_type.values():
            if rest:
                self._buckets.append(_Bucket(rest))
        self._param_bucket = {id(p): b for b in self._buckets for p in b.params}

    def _grad_ready(self, param):
        if not self.needs_reduction:
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.delay_allreduce:
            return
        if self._buckets is None:
            idx = self._param_index.get(id(param))
            if idx is not None:
                self._order.append(idx)
            return
        bucket = self._param_bucket.get(id(param))
        if bucket is None:  # backward without our forward: reduced at the end, structure rebuilt
            self._stray.append(param)
            self._refresh = True
            return
        bucket.ready += 1
        # Buckets go out in bucket order on every rank, so collectives pair up across ranks.
        while self._next_launch < len(self._buckets) and self._buckets[
            self._next_launch
        ].ready >= len(self._buckets[self._next_launch].params):
            self._launch(self._buckets[self._next_launch], self._next_launch)
            self._next_launch += 1

    def _group(self, i):
        """The process group of the bucket launched i-th (None: the default group)."""
        if self.allreduce_communicators is not None:
            groups = self.allreduce_communicators[0]
            return groups[i % len(groups)]
        if not self.allreduce_different_streams:
            return None
        return self._groups[i % self.num_allreduce_streams]

    def _stream(self, i):
        """The CUDA side stream of the bucket launched i-th, or None (no NCCL on CUDA)."""
        if self.allreduce_communicators is not None:
            streams = self.allreduce_communicators[1]
            return streams[i % len(streams)]
        if not self._side_streams:
            return None
        if self._streams is None:
            self._streams = [torch.cuda.Stream() for _ in range(self.num_allreduce_streams)]
        return self._streams[i % len(self._streams)]

    def _flat_to_reduce(self, tensors):
        """``tensors`` in one flat buffer for the all_reduce (_to_reduce)."""
        return self._to_reduce(flatten(tensors))

    def _to_reduce(self, flat):
        """What the all_reduce takes of ``flat``: a float32 copy with ``allreduce_always_fp32``
        (else ``flat`` itself), divided by ``gradient_predivide_factor``."""
        if self.allreduce_always_fp32 and flat.dtype != torch.float32:
            flat = flat.float()
        _scale_(flat, 1.0 / self.gradient_predivide_factor)
        return flat

    def _average_(self, flat):
        """The reduced sum averaged (``gradient_average``): times predivide / world size."""
        if self.gradient_average:
            _scale_(flat, self.gradient_predivide_factor / self.world_size)

    def _launch(self, bucket, i):
        with self._label(f"allreduce_bucket_{i}"):
            bucket.group, bucket.stream = self._group(i), self._stream(i)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            ctx = nullcontext()
            if bucket.stream is not None:
                bucket.stream.wait_stream(torch.cuda.current_stream())
                ctx = torch.cuda.stream(bucket.stream)
            with ctx, torch.no_grad():
                flat = self._flat_to_reduce(grads)
                bucket.flat = flat
                bucket.work = dist.all_reduce(flat, group=bucket.group, async_op=True)

    def _finish(self, bucket):
        ctx = nullcontext()
        if bucket.stream is not None:
            ctx = torch.cuda.stream(bucket.stream)
        with ctx, torch.no_grad():
            bucket.work.wait()
            flat = bucket.flat
            self._average_(flat)
            views = unflatten(flat, bucket.params)
            dst, src = [], []
            for p, v in zip(bucket.params, views):
                if self.retain_allreduce_buffers and v.dtype == p.dtype:
                    p.grad = v
                elif p.grad is None:
                    p.grad = v.to(p.dtype).clone()
                else:
                    dst.append(p.grad)
                    src.append(v)
            _copy_all_(dst, src)
            if self.retain_allreduce_buffers:
                self.allreduce_buffers.append(flat)
        if bucket.stream is not None:
            torch.cuda.current_stream().wait_stream(bucket.stream)
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.record_stream(bucket.stream)
        bucket.done = True
        bucket.work = None
        if not self.retain_allreduce_buffers:
            bucket.flat = None

    def _end_of_backward(self):
        with self._label("end_of_backward"):
            self.allreduce_buffers = []
            if self.delay_allreduce:
                self.allreduce_fallback()
            else:
                if self._buckets is None:
                    self.sync_bucket_structure()
                for i in range(self._next_launch, len(self._buckets)):
                    self._launch(self._buckets[i], i)
                for b in self._buckets:
                    if b.work is not None:
                        self._finish(b)
                for i, chunk in enumerate(split_by_type(self._stray).values()):
                    bucket = _Bucket(chunk)
                    self._launch(bucket, i)
                    self._finish(bucket)
            self._begin_iteration()
