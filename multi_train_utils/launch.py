"""Who started this process, and how many processes share its machine: read once from the environment.

Pure functions of the environment they are given, so every launcher (torchrun, the legacy
torch.distributed.launch, srun, torch.multiprocessing.spawn, plain python) is tested without starting one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

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
        # torchrun also says how many of the processes share this machine. Whoever sets RANK and WORLD_SIZE
        # alone (a cluster operator that starts one process per container) starts one per machine.
        return Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_WORLD_SIZE", 1)), "torchrun")
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


def usable_cpus() -> int:
    """The CPUs this process may run on: a container's or SLURM's limit, not the machine's core count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def cpu_threads_per_process(local_world_size: int) -> int:
    """Share the cores: every process otherwise starts one thread per core and they fight (3x slower)."""
    return max(1, usable_cpus() // local_world_size)


def cpu_threads_for(launch: Launch, env: Mapping[str, str]) -> int:
    """This process's share of the cores: SLURM's --cpus-per-task for a task of srun (whether or not SLURM binds
    each task to cores of its own: without that, each would take all the node's), else the usable CPUs shared
    by the processes on this machine."""
    cpus_per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if launch.source == "slurm" and cpus_per_task.isdigit() and int(cpus_per_task) > 0:
        return min(int(cpus_per_task), usable_cpus())
    return cpu_threads_per_process(launch.local_world_size)
