"""Who this process is, and the process group it trains in: the launcher's variables read once, the device,
joining and leaving the group, the rank helpers, the collectives the rest of the code uses, and the DDP wrapper.

Everything here also works with one process and no process group, so the training code never has to
ask "am I distributed?" before printing, saving or reducing. Reading the launcher (detect_launch) is a pure
function of the environment it is given, so every launcher (torchrun, the legacy torch.distributed.launch,
srun, torch.multiprocessing.spawn, plain python) is tested without starting one.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import socket
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .errors import UserInputError, report, signals_end_the_wait
from .versions import abort_process_group, uncompiled

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
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        # A launcher that lost one of the two would start N processes that each train alone, into one folder.
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise UserInputError(f"{given}={env[given]} is set but {missing} is not: a launcher sets both (torchrun "
                             f"does); set {missing} too, or unset {given} to train in one process")
    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun also says how many of the processes share this machine. Whoever sets RANK and WORLD_SIZE
        # alone (a cluster operator that starts one process per container) starts one per machine.
        return Launch(env_number(env, "RANK"), env_number(env, "LOCAL_RANK", 0), env_number(env, "WORLD_SIZE"),
                      env_number(env, "LOCAL_WORLD_SIZE", 1), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # Only srun sets SLURM_STEP_NUM_TASKS. A batch script or an salloc shell also has SLURM_PROCID=0
        # and the allocation's SLURM_NTASKS, but no other tasks will come: there we run as one process.
        world_size = env_number(env, "SLURM_STEP_NUM_TASKS")
        nodes = env_number(env, "SLURM_STEP_NUM_NODES", env_number(env, "SLURM_NNODES", 1))
        job_id = env_number(env, "SLURM_JOB_ID", 0)
        node_list = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST")))
        return Launch(
            rank=env_number(env, "SLURM_PROCID"),
            local_rank=env_number(env, "SLURM_LOCALID", 0),
            world_size=world_size,
            local_world_size=max(1, world_size // max(1, nodes)),
            source="slurm",
            master_addr=env.get("MASTER_ADDR") or (first_host(node_list) if node_list else "127.0.0.1"),
            master_port=env_number(env, "MASTER_PORT", SLURM_PORT_BASE + job_id % SLURM_PORT_RANGE),
        )
    return Launch(0, 0, 1, 1, "single")


def env_number(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A launcher's variable that must be a whole number 0 or more; `default` where it is not set."""
    if name not in env and default is not None:
        return default
    value = env[name]
    if not value.strip().isdigit():
        raise UserInputError(f"{name}={value}: a launcher's variable that must be a whole number (0 or more)")
    return int(value)


def first_host(node_list: str) -> str:
    """First host of a SLURM node list such as ``gpu[07-09,12],cpu3`` (gives ``gpu07``)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", node_list.strip())
    if not match:
        raise UserInputError(f"cannot read the SLURM node list {node_list!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


# The flag that sets how many processes run on one machine, by launcher: what a user must change.
PROCESSES_PER_MACHINE_FLAG = {"torchrun": "--nproc_per_node", "slurm": "--ntasks-per-node", "spawn": "--world-size"}


def check_one_gpu_per_process(launch: Launch, visible_gpus: int, env: Mapping[str, str]) -> None:
    """Refuse, before any process group exists, more processes on this machine than GPUs they can tell apart.

    Two processes on one GPU make NCCL fail inside init_process_group ("Duplicate GPU detected"). One
    exception: srun may show each task only its own GPU (--gpus-per-task=1), so a task that sees one GPU
    trusts SLURM, unless SLURM itself says the node has fewer GPUs than tasks.
    """
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
    """The CPUs this process may use: those it may run on (a cpuset, SLURM's binding, taskset), and no more
    than its cgroup's CPU quota allows (a container's `--cpus` or Kubernetes' CPU limit, which the
    affinity mask does not show), not the machine's core count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity masks, nor cgroups
        return os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroups, own)
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def cgroup_cpu_quota(cgroups: Path, own: Path) -> float | None:
    """The CPUs a quota grants this process's cgroup, or its nearest limited ancestor's (cgroup v2's cpu.max,
    v1's cpu.cfs_quota_us over cpu.cfs_period_us); None without a quota, or where there are no cgroups."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, the cpu controller's files in every cgroup
            folder, read = cgroups, read_cpu_max
        elif "cpu" in controllers.split(","):
            folder = next((cgroups / name for name in (controllers, "cpu", "cpu,cpuacct") if (cgroups / name).is_dir()),
                          None)
            read = read_cfs_quota
            if folder is None:
                continue
        else:
            continue
        # Inside a container the cgroup's own folder is the mount's root; elsewhere, the path below it.
        here = folder / path.lstrip("/")
        for level in [here, *here.parents]:
            if level == folder.parent:
                break
            quota = read(level)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def read_cpu_max(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def read_cfs_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cpu_threads_per_process(local_world_size: int) -> int:
    """Share the cores: every process otherwise starts one thread per core and they fight (3x slower)."""
    return max(1, usable_cpus() // local_world_size)


def cpu_threads_for(launch: Launch, env: Mapping[str, str]) -> int:
    """This process's share of the cores: OMP_NUM_THREADS where the user set it; SLURM's --cpus-per-task for a
    task of srun (whether or not SLURM binds each task to cores of its own: without that, each would take all
    the node's); else the usable CPUs shared by the processes on this machine."""
    asked = env.get("OMP_NUM_THREADS", "")
    users_own = launch.source != "torchrun" or set_before_the_launcher("OMP_NUM_THREADS")
    if asked.isdigit() and int(asked) > 0 and users_own:
        return int(asked)
    cpus_per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if launch.source == "slurm" and cpus_per_task.isdigit() and int(cpus_per_task) > 0:
        return min(int(cpus_per_task), usable_cpus())
    return cpu_threads_per_process(launch.local_world_size)


def set_before_the_launcher(name: str) -> bool:
    """Whether `name` was in the environment the launcher (this process's parent) started with: torchrun sets
    OMP_NUM_THREADS=1 for its processes where the user did not, which is no choice of the user's. Linux keeps
    a process's starting environment in /proc; elsewhere, what a process got counts as the user's."""
    try:
        return f"\0{name}=".encode() in b"\0" + Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return True


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

    @property
    def runs_on(self) -> str:
        """Where it computes, for the start line: the GPU (its kind, with several processes), or the CPU and
        how many threads each process computes with."""
        if self.device.type == "cpu":
            return f"cpu, {torch.get_num_threads()} thread(s) per process"
        return self.device.type if self.distributed else str(self.device)


def resolve_device(requested: str | None, local_rank: int, distributed: bool) -> torch.device:
    """`--device`: auto (CUDA when present), cpu, cuda, cuda:N, a bare GPU index, or mps (one process)."""
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(f"cuda:{requested}" if requested.isdigit() else requested)
    except RuntimeError:
        raise UserInputError(f"--device {requested!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        return apple_gpu()
    if device.type != "cuda":
        raise UserInputError(f"--device {requested!r}: only cpu, cuda and mps are supported")
    return cuda_device(requested, device.index, local_rank, distributed)


def cuda_device(requested: str, index: int | None, local_rank: int, distributed: bool) -> torch.device:
    """This process's GPU. With several processes on a node, each one takes the GPU of its local rank; where the
    scheduler shows each process only its own GPU (srun --gpus-per-task=1), that one."""
    if not torch.cuda.is_available():
        raise UserInputError(f"--device {requested}: no CUDA GPU is visible (use --device cpu)")
    index = (local_rank if torch.cuda.device_count() > 1 else 0) if distributed else (index or 0)
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
    if ctx.distributed:
        join_process_group(launch, ctx, dist_url, timeout_s)
    return ctx


def join_process_group(launch: Launch, ctx: DistContext, dist_url: str, timeout_s: float) -> None:
    """init_process_group: NCCL between GPUs, gloo on CPUs; the processes meet where the launcher says."""
    if launch.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    if not tcp_store_uses_libuv():
        os.environ.setdefault("USE_LIBUV", "0")  # read by the store init_process_group makes for env://
    if dist_url == "env://":  # set by every launcher; by hand, with RANK and WORLD_SIZE, easily forgotten
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise UserInputError(f"{name} is not set: the processes meet at MASTER_ADDR:MASTER_PORT (rank 0's "
                                     "address and a free port), which a launcher such as torchrun sets")
        env_number(os.environ, "MASTER_PORT")
    backend = process_group_backend(ctx.device)
    if backend == "gloo":
        chosen = choose_gloo_interface(launch, os.environ)
        if chosen and ctx.local_rank == 0:
            report(chosen, sys.stdout)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        with signals_end_the_wait(ctx.rank, "while the processes were meeting"):
            store = restart_safe_store(ctx, timeout) if dist_url == "env://" else None
            dist.init_process_group(
                backend=backend, init_method=None if store else dist_url, store=store, world_size=ctx.world_size,
                rank=ctx.rank, timeout=timeout, device_id=ctx.device if backend == "nccl" else None,
            )
    except RuntimeError as err:
        if port_was_taken(err):
            raise UserInputError(port_taken_line(os.environ.get("MASTER_PORT"))) from None
        missing = processes_missing_line(err, ctx, timeout_s)
        if missing is None:
            raise
        raise GroupNotFormedError(missing) from None
    report(f"| distributed init ({launch.source}, {backend}): rank {ctx.rank}/{ctx.world_size}, "
           f"local rank {ctx.local_rank}, {ctx.device}", sys.stdout)  # every rank: one write each, never run together


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def own_name_is_loopback() -> bool:
    """Whether this machine's name resolves to a loopback address (127.0.1.1 in /etc/hosts is the default of
    many images), which gloo then tells the other machines to reach this one at."""
    try:
        return all(is_loopback(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        return False


def interface_towards(address: str) -> str | None:
    """The name of the network interface this machine reaches `address` through, by the routing table (a
    UDP socket's connect sends nothing); None if no route leads there or the interface cannot be named."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for name, ip in interface_addresses().items() if ip == local and not is_loopback(ip)), None)


def interface_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address (Linux: SIOCGIFADDR)."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def choose_gloo_interface(launch: Launch, env: MutableMapping[str, str]) -> str | None:
    """Where the machine's name resolves to loopback, gloo would give the other machines an address they
    cannot reach, and every process would wait until --dist-timeout. Unless GLOO_SOCKET_IFNAME says which
    interface to use, the one that routes to MASTER_ADDR is chosen (on MASTER_ADDR's own machine, the one
    that routes to the other machines: its only other interface, or its default route's). Returns the line
    that says so, or None where there is nothing to choose (one machine, a name that resolves, the variable
    set). Where none can be found, one line names the host and the fix."""
    if "GLOO_SOCKET_IFNAME" in env or launch.world_size == launch.local_world_size or not own_name_is_loopback():
        return None
    master = env.get("MASTER_ADDR", "")
    try:
        master_ip = socket.gethostbyname(master)
    except OSError:
        master_ip = ""
    chosen = interface_towards(master_ip) if master_ip and not is_loopback(master_ip) else None
    if chosen is None:  # this is MASTER_ADDR's machine (or its name is loopback here too)
        others = [name for name, ip in interface_addresses().items() if not is_loopback(ip)]
        chosen = others[0] if len(others) == 1 else interface_towards("192.0.2.1")  # TEST-NET: the default route
    if chosen is None:
        raise GroupNotFormedError(
            f"this machine's name, {socket.gethostname()}, resolves to a loopback address, which the other "
            "machines cannot reach, and no network interface towards them was found; set GLOO_SOCKET_IFNAME to "
            "the interface they reach this machine through (see `ip -o -4 addr`)")
    env["GLOO_SOCKET_IFNAME"] = chosen
    return (f"| {socket.gethostname()} resolves to a loopback address: gloo uses the network interface "
            f"{chosen} (set GLOO_SOCKET_IFNAME to choose another)")


class GroupNotFormedError(UserInputError):
    """The processes never met: each says so itself, since none can count on another to (shutdown.end_run)."""


def processes_missing_line(err: BaseException, ctx: DistContext, timeout_s: float) -> str | None:
    """The line for a group that never formed within --dist-timeout: on rank 0, how many of the processes
    came (the store counts them); on the others, that rank 0's address did not answer. None for other
    errors."""
    message, address = str(err), meeting_point()
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if joined:
        return (f"only {joined.group(1)} of the {joined.group(2)} processes joined within --dist-timeout "
                f"{timeout_s:g} s (WORLD_SIZE={ctx.world_size}): start every rank (torchrun --nproc_per_node "
                f"starts them all), or check that the other machines reach MASTER_ADDR:MASTER_PORT {address}")
    if re.search(r"failed to connect|connection refused|timed out|timeout", message, re.IGNORECASE):
        return (f"rank {ctx.rank} could not reach rank 0's MASTER_ADDR:MASTER_PORT {address} within "
                f"--dist-timeout {timeout_s:g} s: is rank 0 running, and is that its address on this network "
                "(not 127.0.0.1 from another machine)?")
    return None


def meeting_point() -> str:
    """MASTER_ADDR:MASTER_PORT, where the processes of an env:// group meet (rank 0's store), or "" unset."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{host}:{port}" if host and port else ""


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


def port_taken_line(port: str | None) -> str:
    if os.environ.get("MASTER_PORT_CHOSEN_BY") == "spawn":  # free when chosen, taken a moment later
        return (f"port {port}, free when the spawn script chose it, was taken by another program before the "
                "processes met there; start the job again")
    return (f"MASTER_PORT {port}: another program listens on that port; choose a free one, or unset "
            "MASTER_PORT for the spawn script to pick one")


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
    if ctx.device.type == "cpu":  # torch's own count is the machine's cores, whatever a container's quota says
        torch.set_num_threads(cpu_threads_for(Launch(0, 0, 1, 1, "single"), os.environ))
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


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (any object that pickles): what only rank 0 reads from the file system."""
    if not is_dist_avail_and_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (another program may take it before it is used: port_taken_line)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


COMM_HOOKS = ("none", "bf16", "fp16")


def wrap_ddp(model: nn.Module, ctx: DistContext, sync_bn: bool = False, compile_model: bool = False,
             comm_hook: str = "none", **ddp_options: Any) -> nn.Module:
    """Put `model` (already on ctx.device) under DDP; with one process, return it unchanged (compiled if
    asked). `ddp_options` are DistributedDataParallel's own keyword arguments (bucket_cap_mb,
    find_unused_parameters, static_graph, ...).

    DDP's constructor broadcasts rank 0's parameters and buffers, so every rank starts from the
    same weights without a shared temporary file.
    """
    if sync_bn and not sync_bn_applies(ctx):
        print_main("--syncBN: switched off: PyTorch's SyncBatchNorm runs on CUDA GPUs only, with several processes"
                   "; each process normalises over its own batch.")
    if not ctx.distributed:
        return torch.compile(model) if compile_model else model
    return distributed_model(model, ctx, sync_bn and sync_bn_applies(ctx), compile_model, comm_hook, ddp_options)


def distributed_model(model: nn.Module, ctx: DistContext, sync_bn: bool, compile_model: bool, comm_hook: str,
                      ddp_options: dict[str, Any]) -> DistributedDataParallel:
    if sync_bn:
        # Convert after the device move and before DDP, so DDP registers the synchronised layers.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if compile_model:
        # Compiled after the SyncBatchNorm swap, which a compiled graph would not see, and before DDP,
        # whose gradient hooks then fire on the compiled model's parameters as on the plain one's.
        model = torch.compile(model)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # gradient_as_bucket_view: the gradients live inside DDP's all-reduce buffers, so memory holds one copy
    # of them instead of two.
    ddp = DistributedDataParallel(model, device_ids=device_ids, **{"gradient_as_bucket_view": True, **ddp_options})
    if comm_hook != "none":
        # Halves the bytes each all-reduce sends; the averaged gradient is rounded to 16 bits once.
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}[comm_hook]
        ddp.register_comm_hook(dist.group.WORLD, hook)
    return ddp


def sync_bn_applies(ctx: DistContext) -> bool:
    """Whether --syncBN turns BatchNorm into SyncBatchNorm here: in a process group on CUDA GPUs only
    (PyTorch's SyncBatchNorm refuses CPU modules, and one process has nothing to synchronise)."""
    return ctx.distributed and ctx.device.type == "cuda"


def normalised_batch(batch_size: int, ctx: DistContext, sync_bn: bool = False) -> int:
    """The images each BatchNorm layer normalises over in a training step: this process's batch, or under
    SyncBatchNorm the batches of every process."""
    return batch_size * ctx.world_size if sync_bn and sync_bn_applies(ctx) else batch_size


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
