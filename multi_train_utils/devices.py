"""Where each process computes: its device (a GPU of its own, the CPU, or Apple's), chosen once at set-up, and its
share of the CPU's cores, for its threads and its data-loader workers."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .errors import UserInputError
from .launch import PROCESSES_PER_MACHINE_FLAG, Launch


def check_one_gpu_per_process(launch: Launch, visible_gpus: int, env: Mapping[str, str]) -> None:
    """Refuse, before any process group exists, more processes on this machine than GPUs they can tell apart
    (NCCL would fail inside init_process_group: "Duplicate GPU detected"). A task of srun that sees one GPU
    (--gpus-per-task=1) trusts SLURM, unless SLURM itself says the node has fewer GPUs than tasks."""
    if launch.local_world_size <= visible_gpus:
        return
    if launch.source == "slurm" and visible_gpus == 1:
        gpus_on_node = env.get("SLURM_GPUS_ON_NODE", "")
        if not gpus_on_node.isdigit() or int(gpus_on_node) >= launch.local_world_size:
            return
        visible_gpus = int(gpus_on_node)
    flag = PROCESSES_PER_MACHINE_FLAG.get(launch.source, "--nproc_per_node")
    raise UserInputError(f"{flag} {launch.local_world_size}: {launch.local_world_size} processes on this machine "
                         f"but {visible_gpus} GPU(s); NCCL needs a GPU of its own for each process (start at "
                         f"most {visible_gpus}, or train on the CPU with --device cpu)")


def usable_cpus(cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may run on (its affinity mask), within its cgroups' CPU quota, which the mask hides."""
    if not hasattr(os, "sched_getaffinity"):  # macOS and Windows have no affinity masks, nor cgroups
        return os.cpu_count() or 1
    cpus = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for line in own.read_text().splitlines():  # v2: "0::/its/path"; v1: "4:cpu,cpuacct:/its/path"
            _, controllers, path = line.split(":", 2)
            folder = cgroups / controllers  # v2's are "": its files are in every cgroup; v1 mounts each hierarchy
            if "cpu" in controllers.split(",") and not folder.is_dir():  # under another order ("cpuacct,cpu")
                folder = cgroups / "cpu"
            here = folder / path.lstrip("/")  # in a container, its own cgroup is the mount's root
            for level in [here, *here.parents][:len(Path(path).parts)]:
                cpus = min(cpus, cgroup_cpu_quota(level))
    return max(1, int(cpus))


def cgroup_cpu_quota(level: Path) -> float:
    """The CPUs one cgroup's quota grants (v2: cpu.max; v1: cpu.cfs_quota_us over cpu.cfs_period_us); inf if none."""
    v2, v1 = level / "cpu.max", level / "cpu.cfs_quota_us"
    with contextlib.suppress(OSError, ValueError):  # no such files, or no quota (v2's "max", v1's -1)
        if v2.is_file():
            quota, period = v2.read_text().split()
        else:
            quota, period = v1.read_text(), v1.with_name("cpu.cfs_period_us").read_text()
        return int(quota) / int(period) if int(quota) > 0 else math.inf
    return math.inf


def cpu_share(local_world_size: int) -> int:
    """Share the cores: every process otherwise starts one thread per core and they fight (3x slower)."""
    return max(1, usable_cpus() // local_world_size)


def cpu_threads_for(launch: Launch, env: Mapping[str, str]) -> int:
    """This process's share of the cores: OMP_NUM_THREADS where the user set it; SLURM's --cpus-per-task for a
    task of srun (bound to cores of its own or not); else the usable CPUs shared by the machine's processes."""
    asked, per_task = env.get("OMP_NUM_THREADS", ""), env.get("SLURM_CPUS_PER_TASK", "")
    if asked.isdigit() and int(asked) > 0 and (
            launch.source != "torchrun" or set_before_the_launcher("OMP_NUM_THREADS")):  # not torchrun's own 1
        return int(asked)
    if launch.source == "slurm" and per_task.isdigit() and int(per_task) > 0:
        return min(int(per_task), usable_cpus())
    return cpu_share(launch.local_world_size)


def set_before_the_launcher(name: str) -> bool:
    """Whether `name` was in the environment the launcher (this process's parent) started with: torchrun sets
    OMP_NUM_THREADS=1 where the user did not. Without /proc, what a process got counts as the user's."""
    try:
        return f"\0{name}=".encode() in b"\0" + Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return True


def resolve_device(requested: str | None, local_rank: int, distributed: bool) -> torch.device:
    """`--device`: auto (CUDA when present), cpu, cuda, cuda:N, a bare GPU index, or mps (one process)."""
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cpu") if requested == "cpu" else accelerator(requested, local_rank, distributed)


def accelerator(requested: str, local_rank: int, distributed: bool) -> torch.device:
    """A --device other than cpu: this process's GPU (with several processes, the GPU of its local rank, or the only
    one it sees: srun --gpus-per-task=1), or Apple's."""
    try:
        device = torch.device(f"cuda:{requested}" if requested.isdigit() else requested)
    except RuntimeError:
        raise UserInputError(f"--device {requested!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type in ("cpu", "mps"):
        return device if device.type == "cpu" else apple_gpu()
    if device.type != "cuda":
        raise UserInputError(f"--device {requested!r}: only cpu, cuda and mps are supported")
    if not torch.cuda.is_available():
        raise UserInputError(f"--device {requested}: no CUDA GPU is visible (use --device cpu)")
    index = (local_rank if torch.cuda.device_count() > 1 else 0) if distributed else (device.index or 0)
    if index >= torch.cuda.device_count():
        raise UserInputError(f"--device {requested}: GPU {index} asked for, "
                             f"but only {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def apple_gpu() -> torch.device:
    """The GPU of Apple silicon, for one process (DDP has no backend that runs on it)."""
    if not torch.backends.mps.is_available():
        raise UserInputError("--device mps: no Apple GPU is available here (use --device cpu)")
    return torch.device("mps")


def use_device(device: torch.device) -> None:
    """Make `device` this process's GPU, once, at set-up."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # the input size is fixed: cuDNN times its algorithms, keeps the fastest


def process_device(launch: Launch, requested: str | None) -> torch.device:
    """This process's device (--device; with several processes on GPUs, the GPU of its local rank), made its own,
    and on a CPU its share of the cores."""
    distributed = launch.source != "single"
    if distributed and resolve_device(requested, 0, distributed=False).type == "cuda":
        check_one_gpu_per_process(launch, torch.cuda.device_count(), os.environ)
    device = resolve_device(requested, launch.local_rank, distributed)
    if device.type == "cpu":  # torch's own count is the machine's cores, whatever a container's quota says
        torch.set_num_threads(cpu_threads_for(launch, os.environ))
    use_device(device)
    return device
