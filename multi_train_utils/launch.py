"""Who started this process, read once from the environment, as a pure function of it: torch.multiprocessing.spawn
(the spawn script), torchrun and the legacy torch.distributed.launch, srun on SLURM, or plain python. Every launcher
is tested without starting one (tests/test_distributed_utils.py, tests/test_kubernetes.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UserInputError

# SLURM gives no port; every job on a node needs its own, so derive one from the job id.
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 10000
# The flag that sets how many processes run on one machine, by launcher: what a user must change.
PROCESSES_PER_MACHINE_FLAG = {"torchrun": "--nproc_per_node", "slurm": "--ntasks-per-node", "spawn": "--world-size"}


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
