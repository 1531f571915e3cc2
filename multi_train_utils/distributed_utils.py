"""Process-group set-up and tear-down, and the rank helpers the rest of the code uses.

Everything here also works with one process and no process group, so the training code never has to
ask "am I distributed?" before printing, saving or reducing.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import UserInputError
from .launch import Launch, check_one_gpu_per_process, cpu_threads_for, detect_launch
from .versions import abort_process_group


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
    from .shutdown import stop_when_launcher_dies  # imported here: shutdown builds on this module

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
    by every process alike, before they can talk to each other (rank 0 alone says so: shutdown.end_run)."""
    distributed = launch.source != "single"
    if distributed and resolve_device(device, 0, distributed=False).type == "cuda":
        check_one_gpu_per_process(launch, torch.cuda.device_count(), os.environ)
    ctx = DistContext(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                      resolve_device(device, launch.local_rank, distributed), distributed)
    if ctx.device.type == "cpu":  # every process otherwise starts one thread per core, and they fight
        torch.set_num_threads(cpu_threads_for(launch, os.environ))
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


def cleanup(failed: bool = False) -> None:
    """Leave the process group, if there is one. Safe to call more than once.

    After a failure, NCCL's group is aborted rather than destroyed: destroy_process_group() waits for the
    collectives in flight, which the other ranks may never finish, and this rank would hang until
    --dist-timeout instead of exiting, so the launcher would not notice and stop the others.
    """
    if not is_dist_avail_and_initialized():
        return
    # The DDP wrapper, freed by the garbage collector whenever it runs, must not take the last reference to the
    # group with it: gloo's group, destroyed from inside it, can wait for a thread that waits for the GIL.
    gc.collect()
    if failed and dist.get_backend() == "nccl":
        abort_process_group()
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


def cpu_side_group(timeout_s: float = 900.0) -> dist.ProcessGroup | None:
    """A process group for small decisions taken on the host every step (stop? checkpoint?): the default group
    where it is gloo (CPU tensors), else a gloo group beside NCCL's, so that deciding never makes the CPU wait
    for the GPU (gloo then needs to reach the other machines too: GLOO_SOCKET_IFNAME names the network
    interface). None, the default group, where there is no process group or it is gloo's. Every rank must
    make it, in the same order."""
    if not is_dist_avail_and_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def agree(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (it may be taken before we use it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
