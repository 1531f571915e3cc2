"""Who this process is, and the process group it trains in: the launcher's variables read once, the device and
the CPU threads, joining and leaving the group, the rank helpers, the collectives the rest of the code uses, and
the DDP wrapper.

Everything here also works with one process and no process group, so the training code never has to ask "am I
distributed?" before printing, saving or reducing. Reading the launcher (detect_launch) is a pure function of the
environment it is given, so every launcher (torchrun, the legacy torch.distributed.launch, srun,
torch.multiprocessing.spawn, plain python) is tested without starting one.

A mistake found before the processes meet (process_context) is found by every process alike, and rank 0 alone
says it; where they never meet (GroupNotFormedError), each says so itself (shutdown.end_run).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .errors import UserInputError, report, signals_end_the_wait
from .versions import abort_process_group

# SLURM gives no port; every job on a node needs its own, so derive one from the job id.
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 10000
# The flag that sets how many processes run on one machine, by launcher: what a user must change.
PROCESSES_PER_MACHINE_FLAG = {"torchrun": "--nproc_per_node", "slurm": "--ntasks-per-node", "spawn": "--world-size"}
COMM_HOOKS = ("none", "bf16", "fp16")
DIST_TIMEOUT_S = 900.0  # how long a collective waits for the other processes: --dist-timeout's default


@dataclass(frozen=True)
class Launch:
    """Who this process is, as told by whatever started it."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str  # "torchrun", "slurm", "spawn" or "single"


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


def cpu_threads_per_process(local_world_size: int) -> int:
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
    return cpu_threads_per_process(launch.local_world_size)


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


def single_process(device: str | None = None) -> DistContext:
    """The context of a plain one-process run, whatever the environment says."""
    ctx = DistContext(0, 0, 1, 1, resolve_device(device, 0, distributed=False), distributed=False)
    if ctx.device.type == "cpu":  # torch's own count is the machine's cores, whatever a container's quota says
        torch.set_num_threads(cpu_threads_for(Launch(0, 0, 1, 1, "single"), os.environ))
    use_device(ctx.device)
    return ctx


def process_context(launch: Launch, device: str | None) -> DistContext:
    """This process's rank and device, its share of the CPU cores, its GPU."""
    distributed = launch.source != "single"
    if distributed and resolve_device(device, 0, distributed=False).type == "cuda":
        check_one_gpu_per_process(launch, torch.cuda.device_count(), os.environ)
    ctx = DistContext(launch.rank, launch.local_rank, launch.world_size, launch.local_world_size,
                      resolve_device(device, launch.local_rank, distributed), distributed)
    if ctx.device.type == "cpu":  # every process otherwise starts one thread per core, and they fight
        torch.set_num_threads(cpu_threads_for(launch, os.environ))
    use_device(ctx.device)
    return ctx


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs; gloo on CPUs and on Windows, whose PyTorch has no NCCL (gloo reduces CUDA tensors too)."""
    return "nccl" if device.type == "cuda" and sys.platform != "win32" else "gloo"


def tcp_store_uses_libuv() -> bool:
    """Not on Windows, whose PyTorch is built without libuv (and before 2.5 still asked for it there, and failed)."""
    return sys.platform != "win32"


def init_distributed_mode(device: str | None = None, dist_url: str = "env://", timeout_s: float = DIST_TIMEOUT_S,
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
    if launch.source == "slurm":
        os.environ.update(srun_meeting_point(os.environ))
    if not tcp_store_uses_libuv():
        os.environ.setdefault("USE_LIBUV", "0")  # read by the store init_process_group makes for env://
    if dist_url == "env://":  # set by every launcher; by hand, with RANK and WORLD_SIZE, easily forgotten
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise meeting_point_unset(name)
        if not 0 < env_number(os.environ, "MASTER_PORT") < 65536:
            raise UserInputError(f"MASTER_PORT={os.environ['MASTER_PORT']}: a port is a number from 1 to 65535")
        check_meeting_host(os.environ["MASTER_ADDR"], f"MASTER_ADDR {os.environ['MASTER_ADDR']}")
    elif host := urlparse(dist_url).hostname:  # tcp://HOST:PORT
        check_meeting_host(host, f"--dist-url {dist_url}")
    backend = process_group_backend(ctx.device)
    if backend == "gloo" and launch.world_size > launch.local_world_size:  # several machines
        choose_gloo_interface(os.environ, says=ctx.local_rank == 0)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        with signals_end_the_wait(ctx.rank, "while the processes were meeting"):
            store = restart_safe_store(ctx, timeout) if dist_url == "env://" else None
            dist.init_process_group(backend=backend, init_method=None if store else dist_url, store=store,
                                    world_size=ctx.world_size, rank=ctx.rank, timeout=timeout,
                                    device_id=ctx.device if backend == "nccl" else None)
    except RuntimeError as err:
        failure = meeting_failure(err, ctx, timeout_s, dist_url)
        if failure is None:
            raise
        raise failure from None
    report(f"| distributed init ({launch.source}, {backend}): rank {ctx.rank}/{ctx.world_size}, "
           f"local rank {ctx.local_rank}, {ctx.device}", sys.stdout)  # every rank: one write each, never run together


def restart_safe_store(ctx: DistContext, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the store the processes meet in, with a prefix per restart attempt: torchrun keeps one store
    for all attempts, where the new processes would read what the dead ones left ("connectFullMesh failed")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and ctx.rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ctx.world_size,
                          is_master=hosts_store, timeout=timeout, use_libuv=tcp_store_uses_libuv())
    return dist.PrefixStore(f"attempt{attempt}", store)


def check_meeting_host(host: str, named: str) -> None:
    """Where rank 0's address is a name this machine cannot look up, say so at once: PyTorch would retry it until
    --dist-timeout, printing pages of its C++ log."""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise GroupNotFormedError(f"{named}: this machine cannot find the host {host} ({err.strerror.lower()}); "
                                  "give rank 0's IP address, or a name that every machine resolves") from None


def meeting_point_unset(name: str) -> UserInputError:
    return UserInputError(f"{name} is not set: the processes meet at MASTER_ADDR:MASTER_PORT (rank 0's address and "
                          "a free port), which a launcher such as torchrun sets")


class GroupNotFormedError(UserInputError):
    """The processes never met: each says so itself, since none can count on another to."""


def meeting_failure(err: RuntimeError, ctx: DistContext, timeout_s: float,
                    dist_url: str = "env://") -> UserInputError | None:
    """The one-line error for processes that could not meet (their port was taken, or some never came), or None."""
    if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
        return UserInputError(port_taken_line(os.environ.get("MASTER_PORT")))
    if "ping failed" in str(err).lower():  # the store's first exchange had an answer no store gives
        return GroupNotFormedError(f"rank {ctx.rank}: another program, not rank 0's store, answers at "
                                   f"{meeting_place(dist_url)}; choose a port that nothing else listens on")
    missing = processes_missing_line(err, ctx, timeout_s, dist_url)
    return None if missing is None else GroupNotFormedError(missing)


def port_taken_line(port: str | None) -> str:
    if os.environ.get("MASTER_PORT_CHOSEN_BY") == "spawn":  # free when chosen, taken a moment later
        return (f"port {port}, free when the spawn script chose it, was taken by another program before the "
                "processes met there; start the job again")
    return (f"MASTER_PORT {port}: another program listens on that port; choose a free one, or unset "
            "MASTER_PORT for the spawn script to pick one")


def processes_missing_line(err: BaseException, ctx: DistContext, timeout_s: float,
                           dist_url: str = "env://") -> str | None:
    """For a group that never formed within --dist-timeout: on rank 0, how many of the processes came (the store
    counts them); on the others, that rank 0's address did not answer. None for other errors."""
    message, where = str(err), meeting_place(dist_url)
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if joined:
        return (f"only {joined.group(1)} of the {joined.group(2)} processes joined within --dist-timeout "
                f"{timeout_s:g} s (WORLD_SIZE={ctx.world_size}): start every rank (torchrun --nproc_per_node "
                f"starts them all), or check that the other machines reach {where}")
    if re.search(r"failed to connect|connection refused|timed out|timeout", message, re.IGNORECASE):
        return (f"rank {ctx.rank} could not reach rank 0's {where} within "
                f"--dist-timeout {timeout_s:g} s: is rank 0 running, and is that its address on this network "
                "(not 127.0.0.1 from another machine)?")
    return None


def meeting_place(dist_url: str) -> str:
    """Where the processes meet, as the job was told: MASTER_ADDR:MASTER_PORT, or --dist-url."""
    return f"MASTER_ADDR:MASTER_PORT {meeting_point()}" if dist_url == "env://" else f"--dist-url {dist_url}"


def meeting_point() -> str:
    """MASTER_ADDR:MASTER_PORT, where the processes of an env:// group meet (rank 0's store), or "" unset."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{host}:{port}" if host and port else ""


def choose_gloo_interface(env: MutableMapping[str, str], says: bool) -> None:
    """On several machines: where this machine's name resolves to loopback (127.0.1.1 in /etc/hosts, the default of
    many images), gloo gives the others an address they cannot reach, and every process waits until --dist-timeout.
    Unless GLOO_SOCKET_IFNAME names one, the interface that routes to MASTER_ADDR is chosen (on MASTER_ADDR's own
    machine: its only other interface, or its default route's), and the process that `says` says so; where none
    is found, one line names the host and the fix."""
    if "GLOO_SOCKET_IFNAME" in env or not own_name_is_loopback():
        return
    try:
        master_ip = socket.gethostbyname(env.get("MASTER_ADDR", ""))
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
    if says:
        report(f"| {socket.gethostname()} resolves to a loopback address: gloo uses the network interface "
               f"{chosen} (set GLOO_SOCKET_IFNAME to choose another)", sys.stdout)


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def own_name_is_loopback() -> bool:
    """Whether this machine's name resolves to a loopback address only."""
    try:
        return all(is_loopback(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        return False


def interface_towards(address: str) -> str | None:
    """The network interface this machine reaches `address` through, by the routing table (a UDP socket's
    connect sends nothing); None if no route leads there or the interface cannot be named."""
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


def cpu_side_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group beside NCCL's for the decisions taken on the host every step, which then never wait for the GPU;
    None (the default group) without NCCL. Every rank must make it, in the same order."""
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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` (IPv4 or IPv6) nobody listens on right now (another program may take it before it is used:
    port_taken_line). OSError where this machine cannot listen at `host`."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


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


def normalised_batch(batch_size: int, ctx: DistContext, sync_bn: bool = False) -> int:
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
