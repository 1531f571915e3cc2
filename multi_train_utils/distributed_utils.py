"""Process-group set-up and tear-down, and the rank helpers the rest of the code uses.

Everything here also works with one process and no process group, so the training code never has to
ask "am I distributed?" before printing, saving or reducing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import Preempted, UserInputError, exit_code, exit_quietly, stop_when_launcher_dies
from .launch import Launch, check_one_gpu_per_process, cpu_threads_per_process, detect_launch
from .versions import abort_process_group, default_store, has_default_store

# How long a failing process asks the process group's key-value store before it gives up on it (not the
# --dist-timeout of the collectives: the store's host may be gone with the rest of the job).
STORE_TIMEOUT_S = 5.0


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


def resolve_device(requested: str | None, local_rank: int, distributed: bool) -> torch.device:
    """`--device`: auto (CUDA when present), cpu, cuda, cuda:N, a bare GPU index, or mps (one process)."""
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.isdigit():
        requested = f"cuda:{requested}"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserInputError(f"--device {requested!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        return apple_gpu()
    if device.type != "cuda":
        raise UserInputError(f"--device {requested!r}: only cpu, cuda and mps are supported")
    if not torch.cuda.is_available():
        raise UserInputError(f"--device {requested}: no CUDA GPU is visible (use --device cpu)")
    # With several processes on a node, each one takes the GPU of its local rank; where the scheduler
    # shows each process only its own GPU (srun --gpus-per-task=1), that one.
    index = (local_rank if torch.cuda.device_count() > 1 else 0) if distributed else (device.index or 0)
    if index >= torch.cuda.device_count():
        raise UserInputError(f"--device {requested}: GPU {index} asked for, "
                             f"but only {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def apple_gpu() -> torch.device:
    """The GPU of Apple silicon, for one process (the multi-process scripts refuse it: DDP has no backend
    that runs on it)."""
    if not torch.backends.mps.is_available():
        raise UserInputError("--device mps: no Apple GPU is available here (use --device cpu)")
    return torch.device("mps")


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs where it exists; gloo on CPUs and on Windows, whose PyTorch has no NCCL (gloo
    all-reduces CUDA tensors too, through host memory)."""
    return "nccl" if device.type == "cuda" and sys.platform != "win32" else "gloo"


def tcp_store_uses_libuv() -> bool:
    """Whether the TCPStore the processes meet in may use libuv: not on Windows, where PyTorch is built
    without it (and releases before 2.5 still asked for it there by default, and failed)."""
    return sys.platform != "win32"


def init_distributed_mode(device: str | None = None, dist_url: str = "env://", timeout_s: float = 900.0,
                          spawn_rank: int | None = None, spawn_world_size: int | None = None) -> DistContext:
    """Join the process group of whatever launcher started this process (also a group of one, so that
    `torchrun --nproc_per_node=1` runs the same DDP code as eight processes); plain python: one process."""
    launch = detect_launch(os.environ, spawn_rank, spawn_world_size)
    ctx = process_context(launch, device)
    if not ctx.distributed:
        return ctx
    stop_when_launcher_dies()
    if launch.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    if not tcp_store_uses_libuv():
        os.environ.setdefault("USE_LIBUV", "0")  # read by the store init_process_group makes for env://
    backend = process_group_backend(ctx.device)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = restart_safe_store(ctx, timeout) if dist_url == "env://" else None
        dist.init_process_group(
            backend=backend, init_method=None if store else dist_url, store=store, world_size=ctx.world_size,
            rank=ctx.rank, timeout=timeout, device_id=ctx.device if backend == "nccl" else None,
        )
    except RuntimeError as err:
        if not port_was_taken(err) or os.environ.get("MASTER_PORT_CHOSEN_BY") == "spawn":
            raise  # the spawn script picked that port itself, and tries another
        raise UserInputError(f"MASTER_PORT {os.environ.get('MASTER_PORT')}: another program listens on that "
                             "port; choose a free one, or unset MASTER_PORT for the spawn script to pick one"
                             ) from None
    print(f"| distributed init ({launch.source}, {backend}): rank {ctx.rank}/{ctx.world_size}, "
          f"local rank {ctx.local_rank}, {ctx.device}", flush=True)
    return ctx


def process_context(launch: Launch, device: str | None) -> DistContext:
    """This process's rank and device, its share of the CPU cores, its GPU. A mistake found here is found
    by every process alike, before they can talk to each other: rank 0 alone says so."""
    distributed = launch.source != "single"
    try:
        if distributed and resolve_device(device, 0, distributed=False).type == "cuda":
            check_one_gpu_per_process(launch, torch.cuda.device_count(), os.environ)
        ctx = DistContext(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                          resolve_device(device, launch.local_rank, distributed), distributed)
    except UserInputError as err:
        if launch.rank != 0:
            exit_quietly(exit_code(err))
        raise
    if ctx.device.type == "cpu":
        # SLURM gives each task its own CPUs already (--cpus-per-task); the others share the machine's.
        torch.set_num_threads(cpu_threads_per_process(1 if launch.source == "slurm" else ctx.local_world_size))
    use_device(ctx.device)
    return ctx


def port_was_taken(err: BaseException) -> bool:
    return "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()


def use_device(device: torch.device) -> None:
    """Make `device` this process's GPU, once, at set-up. cudnn.benchmark: with the fixed input size of
    training, cuDNN times its convolution algorithms on the first batches and keeps the fastest."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True


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
                          is_master=hosts_store, timeout=timeout, use_libuv=tcp_store_uses_libuv())
    return dist.PrefixStore(f"attempt{attempt}", store)


def single_process(device: str | None = None) -> DistContext:
    """The context of a plain one-process run, whatever the environment says."""
    ctx = DistContext(0, 0, 1, 1, resolve_device(device, 0, distributed=False), distributed=False)
    use_device(ctx.device)
    return ctx


class StalledRankError(UserInputError):
    """A collective waited past --dist-timeout because some rank stopped answering; names that rank."""


def stalled_rank_error(err: BaseException, ctx: DistContext, settle_s: float = 2.0) -> StalledRankError | None:
    """If `err` is a collective's time-out, the one-line error naming the ranks that stopped answering.

    Every rank still alive is stuck in the same collective and times out at about the same moment; each
    marks itself in the process group's key-value store, waits a moment for the others, and names the
    ranks that never marked themselves (hung in a data loader, a deadlock, a stopped machine). With
    NCCL, PyTorch's own watchdog ends the processes on a time-out and names the collective instead.
    """
    # gloo says "Timed out waiting ..." or "Application timeout caused pair closure", by where it waited.
    if not (isinstance(err, RuntimeError) and is_dist_avail_and_initialized() and has_default_store()
            and re.search(r"timed out|timeout", str(err), re.IGNORECASE)):
        return None
    try:
        store = default_store()
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        store.set(f"timed_out/{ctx.rank}", "1")
        time.sleep(settle_s)
        silent = [rank for rank in range(ctx.world_size) if not store.check([f"timed_out/{rank}"])]
    except Exception:  # the store's host (rank 0) is gone too: nothing to name, the original error stands
        return None
    return StalledRankError(f"rank {ctx.rank} waited longer than --dist-timeout for the other processes; "
                            f"{'rank(s) ' + ', '.join(map(str, silent)) if silent else 'no rank'} stopped "
                            "answering")


def cleanup(failed: bool = False) -> None:
    """Leave the process group, if there is one. Safe to call more than once.

    After a failure, NCCL's group is aborted rather than destroyed: destroy_process_group() waits for the
    collectives in flight, which the other ranks may never finish, and this rank would hang until
    --dist-timeout instead of exiting, so the launcher would not notice and stop the others.
    """
    if not is_dist_avail_and_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        abort_process_group()
    else:
        dist.destroy_process_group()


@contextlib.contextmanager
def leave_process_group_at_exit(ctx: DistContext) -> Iterator[None]:
    """Run the block, then leave the process group however it ended (see cleanup).

    A stop for preemption (every rank at the same step) leaves as a finished run does. When the block
    fails, the first process to stop explains why; the others, which then fail too
    ("connection closed by peer") or stop for the same reason, end with the same exit code and no word.
    A collective that timed out is explained as the ranks that stopped answering.
    """
    try:
        yield
    except Preempted:
        cleanup()  # every rank stopped at the same step, on purpose: leave as after a finished run
        raise
    except BaseException as err:
        reason = stalled_rank_error(err, ctx) or err
        first = first_to_stop()
        cleanup(failed=True)
        if not first:
            exit_quietly(exit_code(reason))
        if reason is not err:
            raise reason from err
        raise
    cleanup()


def first_to_stop() -> bool:
    """Whether this is the first process of the job to stop, counted in the process group's key-value
    store. A store that no longer answers was kept by a process that has stopped already."""
    if not is_dist_avail_and_initialized() or not has_default_store():
        return True
    try:
        store = default_store()
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return store.add("processes_stopped", 1) == 1
    except Exception:  # the store's host is gone: it stopped first
        return False


def another_process_failed() -> bool:
    """Whether a process of the job has already stopped on an error (first_to_stop counted it), or the
    store that counts them no longer answers."""
    if not is_dist_avail_and_initialized() or not has_default_store():
        return False
    try:
        return default_store().check(["processes_stopped"])
    except Exception:  # the store's host is gone
        return True


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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (it may be taken before we use it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
