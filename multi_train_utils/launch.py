"""This process as its launcher started it: who it is (its rank in its job, read once from the variables of torchrun,
the legacy torch.distributed.launch, srun, the spawn script, or none for plain python), where it computes (its
device, and its share of the CPU's cores), where it meets the other processes, and a watch on the launcher.

Reading the launcher (detect_launch) is a pure function of the environment it is given, so every launcher is tested
without starting one. What to say when the processes do not meet is meeting.py's, which runs once they have not.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from .errors import GroupNotFormedError, UserInputError, _Ending, signals_end_the_wait
from .meeting import choose_gloo_interface, meeting_failure
from .versions import ddp_constructible_under_checks, flight_recorder_size_variable

# SLURM gives no port; every job on a node needs its own, so derive one from the job id.
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 10000
# The flag that sets how many processes run on one machine, by launcher: what a user must change.
PROCESSES_PER_MACHINE_FLAG = {"torchrun": "--nproc_per_node", "slurm": "--ntasks-per-node", "spawn": "--world-size"}
LAUNCHER_POLL_S = 1.0
KILL_AFTER_S = 20.0  # if a SIGTERM cannot end this process (stuck inside a GPU wait), SIGKILL does
# Collectives each process's flight recorder keeps: the last few steps', all a hang needs; each entry is a few
# hundred bytes, and recorded whatever the size, so a larger buffer would only hold older history.
FLIGHT_RECORDER_ENTRIES = 200
CHECK_COLLECTIVES_VARIABLE = "TORCH_DISTRIBUTED_DEBUG"  # DETAIL: --check-collectives


@dataclass(frozen=True)
class Launch:
    """Who this process is, as told by whatever started it."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str  # "torchrun", "slurm", "spawn" or "single"


def detect_launch(env: Mapping[str, str], spawn_rank: int | None = None,
                  spawn_world_size: int | None = None) -> Launch:
    """Who started this process, read from `env` alone: torch.multiprocessing.spawn's rank (also inside a SLURM
    allocation), else torchrun's (and the legacy torch.distributed.launch's), else srun's, else nobody's."""
    if spawn_rank is not None:
        return Launch(spawn_rank, spawn_rank, spawn_world_size, spawn_world_size, "spawn")
    if ("RANK" in env) != ("WORLD_SIZE" in env):  # N processes would each train alone, into one folder
        raise half_of_rank_and_world_size(env)
    if "RANK" in env:  # torchrun; whoever sets RANK and WORLD_SIZE alone (a PyTorchJob) starts one per machine
        return rank_in_its_world(Launch(env_number(env, "RANK"), env_number(env, "LOCAL_RANK", 0),
                                        env_number(env, "WORLD_SIZE"), env_number(env, "LOCAL_WORLD_SIZE", 1),
                                        "torchrun"), "RANK", "WORLD_SIZE")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # srun; in sbatch or salloc alone, one process
        return rank_in_its_world(slurm_launch(env), "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
    return Launch(0, 0, 1, 1, "single")


def rank_in_its_world(launch: Launch, rank_name: str, size_name: str) -> Launch:
    """`launch`, where its rank is one of its world's: a rank past them would wait for the others until
    --dist-timeout, and a world of no process fails inside PyTorch."""
    if not launch.rank < launch.world_size:
        raise UserInputError(f"{rank_name}={launch.rank} with {size_name}={launch.world_size}: the ranks of a job run "
                             f"from 0 to {size_name} - 1; set both as a launcher does")
    return launch


def half_of_rank_and_world_size(env: Mapping[str, str]) -> UserInputError:
    given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
    return UserInputError(f"{given}={env[given]} is set but {missing} is not: a launcher sets both (torchrun does); "
                          f"set {missing} too, or unset {given} to train in one process")


def slurm_launch(env: Mapping[str, str]) -> Launch:
    """A task of srun (only srun sets SLURM_STEP_NUM_TASKS): the step's tasks, spread evenly over its nodes."""
    world_size = env_number(env, "SLURM_STEP_NUM_TASKS")
    nodes = env_number(env, "SLURM_STEP_NUM_NODES", env_number(env, "SLURM_NNODES", 1))
    return Launch(env_number(env, "SLURM_PROCID"), env_number(env, "SLURM_LOCALID", 0), world_size,
                  max(1, world_size // max(1, nodes)), "slurm")


def srun_meeting_point(env: Mapping[str, str]) -> dict[str, str]:
    """Where the tasks of srun meet, which SLURM does not say: MASTER_ADDR and MASTER_PORT where set, else the
    step's first node and a port derived from the job id (every job on a node needs its own)."""
    node_list = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST")))
    port = env_number(env, "MASTER_PORT", SLURM_PORT_BASE + env_number(env, "SLURM_JOB_ID", 0) % SLURM_PORT_RANGE)
    return {"MASTER_ADDR": env.get("MASTER_ADDR") or (first_host(node_list) if node_list else "127.0.0.1"),
            "MASTER_PORT": str(port)}


def env_number(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A launcher's variable that must be a whole number 0 or more; `default` where it is not set."""
    if name not in env and default is not None:
        return default
    if not env[name].strip().isdigit():
        raise UserInputError(f"{name}={env[name]}: a launcher's variable that must be a whole number (0 or more)")
    return int(env[name])


def first_host(node_list: str) -> str:
    """First host of a SLURM node list such as ``gpu[07-09,12],cpu3`` (gives ``gpu07``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", node_list.strip())
    if not match:
        raise UserInputError(f"cannot read the SLURM node list {node_list!r}")
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


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


def record_collectives(backend: str) -> None:
    """Switch on PyTorch's flight recorder for the process groups made from now on: every collective, its number
    and the stack that called it, which flight_recorder.py reads once a collective has failed. A user's own size
    is kept. Older releases record NCCL's collectives only. Where --check-collectives (or its user) asks PyTorch
    to check every collective, PyTorch reads that now: it read its variables when torch was imported, before."""
    os.environ.setdefault(flight_recorder_size_variable(), str(FLIGHT_RECORDER_ENTRIES))
    if os.environ.get(CHECK_COLLECTIVES_VARIABLE):
        dist.set_debug_level_from_env()
        ddp_constructible_under_checks(backend)


@contextlib.contextmanager
def meeting(launch: Launch, backend: str, dist_url: str, timeout_s: float) -> Iterator[dist.Store | None]:
    """Around init_process_group: where the processes meet (srun's first node; after a torchrun restart, a store of
    the new attempt's own; across machines, gloo's network interface); Ctrl-C and the stop signals end the wait at
    once; a failure to meet ends in one line (meeting.py). The group records its collectives.
    Yields the store to meet in, or None: dist_url's."""
    record_collectives(backend)
    if launch.source == "slurm":
        os.environ.update(srun_meeting_point(os.environ))
    if not tcp_store_uses_libuv():
        os.environ.setdefault("USE_LIBUV", "0")  # read by the store init_process_group makes for env://
    check_meeting_host(dist_url)
    if backend == "gloo" and launch.world_size > launch.local_world_size:  # several machines
        choose_gloo_interface(os.environ, says=launch.local_rank == 0)
    restarted = dist_url == "env://" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    try:
        with signals_end_the_wait(launch.rank, "while the processes were meeting"):
            yield restart_safe_store(launch, datetime.timedelta(seconds=timeout_s)) if restarted else None
    except Exception as err:  # whatever PyTorch raises: translated where it is a known failure to meet
        failure = meeting_failure(err, launch.rank, launch.world_size, timeout_s, dist_url)
        if failure is None:
            raise
        raise failure from None


def check_meeting_host(dist_url: str) -> None:
    """Where rank 0's address is a name this machine cannot look up, or port 0, say so at once: PyTorch would retry
    the name until --dist-timeout, printing pages of its C++ log, and rank 0 would listen on a port no other rank
    knows."""
    if dist_url == "env://":
        host, named = os.environ.get("MASTER_ADDR"), f"MASTER_ADDR {os.environ.get('MASTER_ADDR')}"
        if os.environ.get("MASTER_PORT", "").strip() == "0":
            raise UserInputError("MASTER_PORT=0: a port is a number from 1 to 65535")
    else:
        host, named = urlparse(dist_url).hostname, f"--dist-url {dist_url}"
    try:
        if host:
            socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise GroupNotFormedError(f"{named}: this machine cannot find the host {host} ({err.strerror.lower()}); "
                                  "give rank 0's IP address, or a name that every machine resolves") from None


def tcp_store_uses_libuv() -> bool:
    """Not on Windows, whose PyTorch is built without libuv (and before 2.5 still asked for it there, and failed)."""
    return sys.platform != "win32"


def restart_safe_store(launch: Launch, timeout: datetime.timedelta) -> dist.Store:
    """After torchrun restarted the job, the store the processes meet in, with a prefix of the attempt's own:
    torchrun keeps one store for all attempts, where the new processes would read what the dead ones left
    ("connectFullMesh failed")."""
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and launch.rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launch.world_size,
                          is_master=hosts_store, timeout=timeout, use_libuv=tcp_store_uses_libuv())
    return dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def stop_when_launcher_dies(poll_s: float = LAUNCHER_POLL_S, kill_after_s: float = KILL_AFTER_S) -> None:
    """Stop this process within seconds if the launcher that started it is killed outright (SIGKILL, the
    out-of-memory killer) and cannot stop it: it would train on, and write, alone."""
    _Ending.launcher = os.getppid()
    threading.Thread(target=watch_the_launcher, args=(poll_s, kill_after_s), name="launcher-watch", daemon=True).start()


def watch_the_launcher(poll_s: float, kill_after_s: float) -> None:
    """SIGTERM this process, the usual clean stop, once the launcher is gone; SIGKILL if that cannot run."""
    while not launcher_gone():
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(kill_after_s)  # a main thread stuck waiting for a GPU cannot stop
    os.kill(os.getpid(), signal.SIGKILL)


def launcher_gone() -> bool:
    """Whether the launcher this process watches has ended (this process then has another parent)."""
    return _Ending.launcher is not None and os.getppid() != _Ending.launcher
