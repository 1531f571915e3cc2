"""Wrapping a model in DistributedDataParallel, and getting the plain model back out of it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .distributed_utils import DistContext, is_dist_avail_and_initialized, print_main
from .versions import uncompiled

COMM_HOOKS = ("none", "bf16", "fp16")


def wrap_ddp(model: nn.Module, ctx: DistContext, sync_bn: bool = False, compile_model: bool = False,
             bucket_cap_mb: float = 25.0, comm_hook: str = "none") -> nn.Module:
    """Put `model` (already on ctx.device) under DDP; with one process, return it unchanged (compiled if
    asked).

    DDP's constructor broadcasts rank 0's parameters and buffers, so every rank starts from the
    same weights without a shared temporary file.
    """
    if not ctx.distributed:
        if sync_bn:
            print_main("--syncBN: ignored with one process (there is nothing to synchronise).")
        return torch.compile(model) if compile_model else model
    if sync_bn and ctx.device.type != "cuda":
        print_main("--syncBN: switched off, because PyTorch's SyncBatchNorm only runs on CUDA; "
                   "each process normalises over its own batch.")
    elif sync_bn:
        # Convert after the device move and before DDP, so DDP registers the synchronised layers.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if compile_model:
        # Compiled after the SyncBatchNorm swap, which a compiled graph would not see, and before DDP,
        # whose gradient hooks then fire on the compiled model's parameters as on the plain one's.
        model = torch.compile(model)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # gradient_as_bucket_view: the gradients live inside DDP's all-reduce buffers, so memory holds one copy
    # of them instead of two. Larger buckets mean fewer, longer all-reduces.
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                  bucket_cap_mb=bucket_cap_mb)
    if comm_hook != "none":
        # Halves the bytes each all-reduce sends; the averaged gradient is rounded to 16 bits once.
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[comm_hook]
        ddp.register_comm_hook(dist.group.WORLD, hook)
    return ddp


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and torch.compile: what gets saved (no `module.` or `_orig_mod.`
    prefix) and evaluated."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return uncompiled(model)


@torch.no_grad()
def broadcast_buffers_from_main(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics), the ones rank 0 saves.

    DDP sends rank 0's buffers to the others at the start of each training forward, but then every
    rank updates its copy with its own batch. Evaluated as they are, the ranks would each use slightly
    different statistics, and the accuracy would be that of no saved model.
    """
    if not is_dist_avail_and_initialized():
        return
    for buffer in unwrap_model(model).buffers():
        dist.broadcast(buffer, src=0)
