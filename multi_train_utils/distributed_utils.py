"""Process-group set-up and tear-down, and the rank helpers the rest of the code uses.

Everything here also works with one process and no process group, so the training code never has to
ask "am I distributed?" before printing, saving or reducing.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .errors import UserInputError

# SLURM gives no port; every job on a node needs its own, so derive one from the job id.
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 10000


@dataclass(frozen=True)
class Launch:
    """Who this process is, as told by whatever started it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str  # "torchrun", "slurm", "spawn" or "single"
    master_addr: str | None = None
    master_port: int | None = None


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
        # Rank 0 is the one process that prints, logs and writes files.
        return self.rank == 0


def detect_launch(env: Mapping[str, str], spawn_rank: int | None = None,
                  spawn_world_size: int | None = None) -> Launch:
    """Read the ranks from whoever started this process. Pure: reads `env`, changes nothing.

    A rank handed in by `torch.multiprocessing.spawn` wins, because it is the most explicit (a spawn
    script started inside a SLURM allocation must not pick up SLURM's ranks). Then torchrun (and the
    legacy `torch.distributed.launch`, which sets the same variables), then SLURM's `srun`.
    """
    if spawn_rank is not None:
        if spawn_world_size is None:
            raise ValueError("spawn_world_size is needed with spawn_rank")
        return Launch(spawn_rank, spawn_rank, spawn_world_size, spawn_world_size, "spawn")
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        return Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), world_size,
                      int(env.get("LOCAL_WORLD_SIZE", world_size)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # Only srun sets SLURM_STEP_NUM_TASKS. A batch script or an salloc shell also has SLURM_PROCID=0
        # and the allocation's SLURM_NTASKS, but no other tasks will come: there we run as one process.
        world_size = int(env["SLURM_STEP_NUM_TASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", 1)))
        job_id = int(env.get("SLURM_JOB_ID", 0))
        node_list = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST")))
        return Launch(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world_size,
            local_world_size=max(1, world_size // max(1, nodes)),
            source="slurm",
            master_addr=env.get("MASTER_ADDR") or (first_host(node_list) if node_list else "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", SLURM_PORT_BASE + job_id % SLURM_PORT_RANGE)),
        )
    return Launch(0, 0, 1, 1, "single")


def first_host(node_list: str) -> str:
    """First host of a SLURM node list such as ``gpu[07-09,12],cpu3`` (gives ``gpu07``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", node_list.strip())
    if not match:
        raise UserInputError(f"cannot read the SLURM node list {node_list!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve_device(requested: str | None, local_rank: int, distributed: bool) -> torch.device:
    """`--device`: auto (CUDA when present), cpu, cuda, cuda:N or a bare GPU index."""
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.isdigit():
        requested = f"cuda:{requested}"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserInputError(f"--device {requested!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UserInputError(f"--device {requested!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise UserInputError(f"--device {requested}: no CUDA GPU is visible (use --device cpu)")
    # With several processes on a node, each one takes the GPU of its local rank; where the scheduler
    # shows each process only its own GPU (srun --gpus-per-task=1), that one.
    index = (local_rank if torch.cuda.device_count() > 1 else 0) if distributed else (device.index or 0)
    if index >= torch.cuda.device_count():
        raise UserInputError(f"--device {requested}: GPU {index} asked for, "
                             f"but only {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def cpu_threads_per_process(local_world_size: int) -> int:
    """Share the cores: every process otherwise starts one thread per core and they fight (3x slower)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def init_distributed_mode(device: str | None = None, dist_url: str = "env://", timeout_s: float = 900.0,
                          spawn_rank: int | None = None, spawn_world_size: int | None = None) -> DistContext:
    """Join the process group if a launcher started several processes; else return a one-process context."""
    launch = detect_launch(os.environ, spawn_rank, spawn_world_size)
    distributed = launch.world_size > 1
    ctx = DistContext(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                      resolve_device(device, launch.local_rank, distributed), distributed)
    if ctx.device.type == "cpu":
        # SLURM gives each task its own CPUs already (--cpus-per-task); the others share the machine's.
        torch.set_num_threads(cpu_threads_per_process(1 if launch.source == "slurm" else ctx.local_world_size))
    else:
        torch.cuda.set_device(ctx.device)
    if not distributed:
        return ctx
    if launch.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = restart_safe_store(ctx, timeout) if dist_url == "env://" else None
    dist.init_process_group(
        backend=backend, init_method=None if store else dist_url, store=store, world_size=ctx.world_size,
        rank=ctx.rank, timeout=timeout, device_id=ctx.device if backend == "nccl" else None,
    )
    print(f"| distributed init ({launch.source}, {backend}): rank {ctx.rank}/{ctx.world_size}, "
          f"local rank {ctx.local_rank}, {ctx.device}", flush=True)
    return ctx


def restart_safe_store(ctx: DistContext, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the key-value store the processes meet in, with a prefix per restart attempt.

    torchrun keeps one store for all attempts of a job. After a restart, the new processes would read
    the addresses the dead attempt left there and fail to connect (gloo: "connectFullMesh failed");
    a prefix of their own makes each attempt start clean.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and ctx.rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ctx.world_size,
                          is_master=hosts_store, timeout=timeout)
    return dist.PrefixStore(f"attempt{attempt}", store)


def single_process(device: str | None = None) -> DistContext:
    """The context of a plain one-process run, whatever the environment says."""
    ctx = DistContext(0, 0, 1, 1, resolve_device(device, 0, distributed=False), distributed=False)
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    return ctx


class StalledRankError(UserInputError):
    """A collective waited past --dist-timeout because some rank stopped answering; names that rank."""


def raise_if_a_rank_stalled(err: BaseException, ctx: DistContext, settle_s: float = 2.0) -> None:
    """If `err` is a collective's time-out, raise a one-line error naming the ranks that stopped answering.

    Every rank still alive is stuck in the same collective and times out at about the same moment; each
    marks itself in the process group's key-value store, waits a moment for the others, and reports
    the ranks that never marked themselves (hung in a data loader, a deadlock, a stopped machine). With
    NCCL, PyTorch's own watchdog ends the processes on a time-out and names the collective instead.
    """
    # gloo says "Timed out waiting ..." or "Application timeout caused pair closure", by where it waited.
    if not (is_dist_avail_and_initialized() and re.search(r"timed out|timeout", str(err), re.IGNORECASE)):
        return
    store = dist.distributed_c10d._get_default_store()
    store.set(f"timed_out/{ctx.rank}", "1")
    time.sleep(settle_s)
    silent = [rank for rank in range(ctx.world_size) if not store.check([f"timed_out/{rank}"])]
    raise StalledRankError(f"rank {ctx.rank} waited longer than --dist-timeout for the other processes; "
                           f"{'rank(s) ' + ', '.join(map(str, silent)) if silent else 'no rank'} stopped "
                           "answering") from err


def cleanup() -> None:
    """Leave the process group, if there is one. Safe to call more than once."""
    if is_dist_avail_and_initialized():
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
    return getattr(model, "_orig_mod", model)  # under torch.compile's wrapper


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (it may be taken before we use it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
