"""The tutorial's distributed_utils.py, correct where it is not: who this process is in its job (DistContext), joining
the process group and leaving it, the rank helpers, the collectives the rest of the code uses, and the DDP wrapper.

Everything here also works with one process and no process group, so the training code never has to ask "am I
distributed?" before printing, saving or reducing. What stands beside the lesson has modules of its own: which
launcher started the process, with its device, its CPU threads and where the processes meet (launch.py), and what
to say when they do not meet (meeting.py).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .errors import UserInputError, report
from .launch import Launch, detect_launch, meeting, process_device
from .versions import abort_process_group

COMM_HOOKS = ("none", "bf16", "fp16")
DIST_TIMEOUT_S = 900.0  # how long a collective waits for the other processes: --dist-timeout's default


@dataclass(frozen=True)
class DistContext:
    """What the rest of the program needs to know about its process, computed once at set-up."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # the one process that prints, logs and writes files

    @property
    def runs_on(self) -> str:
        """Where it computes, for the start line: the GPU, or the CPU and each process's threads."""
        if self.device.type == "cpu":
            return f"cpu, {torch.get_num_threads()} thread(s) per process"
        return self.device.type if self.distributed else str(self.device)


def init_distributed_mode(device: str | None = None, dist_url: str = "env://", timeout_s: float = DIST_TIMEOUT_S,
                          spawn_rank: int | None = None, spawn_world_size: int | None = None) -> DistContext:
    """Join the process group of whatever launcher started this process (also a group of one, so that
    `torchrun --nproc_per_node=1` runs the same DDP code as eight processes); plain python: one process."""
    launch = detect_launch(os.environ, spawn_rank, spawn_world_size)  # RANK, WORLD_SIZE, LOCAL_RANK, or spawn's
    ctx = DistContext(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                      process_device(launch, device), distributed=launch.source != "single")
    if ctx.distributed:
        backend = process_group_backend(ctx.device)
        with meeting(launch, backend, dist_url, timeout_s) as store:  # where they meet, and the line if they do not
            dist.init_process_group(backend, init_method=None if store else dist_url, store=store,
                                    world_size=ctx.world_size, rank=ctx.rank,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=ctx.device if backend == "nccl" else None)
        report(f"| distributed init ({launch.source}, {backend}): rank {ctx.rank}/{ctx.world_size}, "
               f"local rank {ctx.local_rank}, {ctx.device}", sys.stdout)  # every rank: one write each
    return ctx


def single_process(device: str | None = None) -> DistContext:
    """The context of a plain one-process run, whatever the environment says."""
    return DistContext(0, 0, 1, 1, process_device(Launch(0, 0, 1, 1, "single"), device), distributed=False)


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs; gloo on CPUs and on Windows, whose PyTorch has no NCCL (gloo reduces CUDA tensors too)."""
    return "nccl" if device.type == "cuda" and sys.platform != "win32" else "gloo"


def cleanup(failed: bool = False) -> None:
    """Leave the process group, if there is one (safe to call more than once); after a failure, at once."""
    if not is_dist_avail_and_initialized():
        return
    gc.collect()  # now: a DDP wrapper collected later would destroy gloo's group from inside it, waiting on the GIL
    if failed and dist.get_backend() == "nccl":
        abort_process_group()  # destroying would wait, until --dist-timeout, for collectives failed ranks never end
    else:
        dist.destroy_process_group()


def is_dist_avail_and_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def print_main(*args: object) -> None:
    """Print on rank 0 only, so N processes do not print N copies."""
    if is_main_process():
        print(*args, flush=True)


def barrier() -> None:
    if is_dist_avail_and_initialized():
        dist.barrier()


def reduce_value(value: torch.Tensor, average: bool = True) -> torch.Tensor:
    """Sum `value` over all processes (in place), and divide by the world size if `average`.

    For reporting only: DDP already averages the gradients inside backward(), so the loss that
    backward() sees must stay each process's own.
    """
    world_size = get_world_size()
    if world_size < 2:
        return value
    with torch.no_grad():
        dist.all_reduce(value)
        if average:
            value /= world_size
    return value


def cpu_side_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group beside NCCL's for the decisions taken on the host every step, which then never wait for the GPU;
    None (the default group) without NCCL. Every rank must make it, in the same order."""
    if not is_dist_avail_and_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank if `flag` is true on any (one all-reduce of one number, on the CPU)."""
    vote = torch.tensor([flag], dtype=torch.int32)
    if is_dist_avail_and_initialized():
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


def reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each named sum added up over all processes, in one all-reduce, in float64 (exact for counts up to
    2**53). Every process must pass the same names and shapes (dicts keep their order)."""
    values = [value.detach().flatten() for value in sums.values()]
    if get_world_size() > 1:  # added up on the device, which is where NCCL reads them
        flat = reduce_value(torch.cat([value.double() for value in values]), average=False).cpu()
    else:  # on the CPU: Apple's GPUs have no float64
        flat = torch.cat([value.cpu().double() for value in values])
    totals, start = {}, 0
    for name, value in sums.items():
        totals[name] = flat[start:start + value.numel()].view(value.shape)
        start += value.numel()
    return totals


def read_on_main(read: Callable[[], Any]) -> Any:
    """`read()` run by rank 0 alone, its answer (any object that pickles) sent to every rank: what only rank 0
    reads from the file system. Its one-line error is raised on every rank, rather than leaving them waiting."""
    box: list[Any] = [None]
    if get_rank() == 0:
        try:
            box[0] = read()
        except UserInputError as err:
            box[0] = err
    if is_dist_avail_and_initialized():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserInputError):
        raise box[0]
    return box[0]


def wrap_ddp(model: nn.Module, ctx: DistContext, sync_bn: bool = False, compile_model: bool = False,
             comm_hook: str = "none", **ddp_options: Any) -> nn.Module:
    """`model` (already on ctx.device) under DDP, whose constructor gives every rank rank 0's weights; with one
    process, the model itself (compiled if asked). `ddp_options`: DistributedDataParallel's keyword arguments."""
    if sync_bn and sync_bn_switched_on(ctx):  # after the device move and before DDP, which then registers them
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if compile_model:  # after the SyncBatchNorm swap, which a compiled graph would not see; DDP's hooks work alike
        model = torch.compile(model)
    if not ctx.distributed:
        return model
    # gradient_as_bucket_view: the gradients live in DDP's all-reduce buffers, one copy of them instead of two
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                  **{"gradient_as_bucket_view": True, **ddp_options})
    if comm_hook != "none":  # half the bytes each all-reduce sends; the averaged gradient is rounded to 16 bits once
        ddp.register_comm_hook(dist.group.WORLD, getattr(default_hooks, f"{comm_hook}_compress_hook"))
    return ddp


def sync_bn_switched_on(ctx: DistContext) -> bool:
    """Whether --syncBN applies here (sync_bn_applies); where it does not, rank 0 says that it is off."""
    if not sync_bn_applies(ctx):
        print_main("--syncBN: switched off: PyTorch's SyncBatchNorm runs on CUDA GPUs only, with several processes"
                   "; each process normalises over its own batch.")
    return sync_bn_applies(ctx)


def sync_bn_applies(ctx: DistContext) -> bool:
    """Whether --syncBN turns BatchNorm into SyncBatchNorm here: in a process group on CUDA GPUs only
    (PyTorch's SyncBatchNorm refuses CPU modules, and one process has nothing to synchronise)."""
    return ctx.distributed and ctx.device.type == "cuda"


def batchnorm_batch_size(batch_size: int, ctx: DistContext, sync_bn: bool = False) -> int:
    """The images each BatchNorm layer normalises over in a step: this process's, or under SyncBatchNorm all's."""
    return batch_size * ctx.world_size if sync_bn and sync_bn_applies(ctx) else batch_size


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and torch.compile: what is saved (no `module.`, `_orig_mod.` prefix) and evaluated."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return getattr(model, "_orig_mod", model)  # where torch.compile's wrapper keeps the model it wraps


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
