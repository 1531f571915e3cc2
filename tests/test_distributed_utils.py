"""Reading ranks from each launcher, picking the device, and the helpers that work with one process."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from multi_train_utils.distributed_utils import (
    SLURM_PORT_BASE,
    cpu_threads_per_process,
    detect_launch,
    first_host,
    get_rank,
    get_world_size,
    is_dist_avail_and_initialized,
    is_main_process,
    reduce_value,
    resolve_device,
    single_process,
    wrap_ddp,
)
from multi_train_utils.errors import UserInputError


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size, launch.source) == (
        5, 1, 8, 4, "torchrun")
    assert launch.master_addr is None  # torchrun sets MASTER_ADDR itself; we leave it alone


def test_slurm_variables_under_srun() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (3, 1, 4, 2)
    assert launch.source == "slurm"
    assert launch.master_addr == "gpu07"
    assert launch.master_port == SLURM_PORT_BASE + 4242


def test_slurm_step_values_and_preset_master_win() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_NODELIST": "a1,b2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"}
    launch = detect_launch(env)
    assert (launch.world_size, launch.local_world_size, launch.master_addr, launch.master_port) == (
        2, 2, "10.1.2.3", 1234)


def test_a_slurm_batch_script_without_srun_is_one_process() -> None:
    """sbatch --ntasks=8 running `python train...` directly: no other task will ever join."""
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}).source == "single"


def test_torchrun_inside_a_slurm_job_wins_over_slurm() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_launch(env).source == "torchrun"


def test_spawn_rank_wins_over_the_environment() -> None:
    launch = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, spawn_rank=1, spawn_world_size=3)
    assert (launch.rank, launch.world_size, launch.local_world_size, launch.source) == (1, 3, 3, "spawn")


def test_nothing_set_means_one_process() -> None:
    launch = detect_launch({})
    assert (launch.rank, launch.world_size, launch.source) == (0, 1, "single")


@pytest.mark.parametrize(("node_list", "host"), [("node1", "node1"), ("gpu[07-09,12],cpu3", "gpu07"),
                                                 ("a-1,b-2", "a-1"), ("n[3,5]", "n3"), ("cn[0012-0013]", "cn0012")])
def test_first_host_of_a_slurm_node_list(node_list: str, host: str) -> None:
    assert first_host(node_list) == host


def test_cpu_device_and_bad_devices() -> None:
    assert resolve_device("cpu", 0, distributed=False) == torch.device("cpu")
    with pytest.raises(UserInputError, match="--device 'tpu'"):
        resolve_device("tpu", 0, distributed=False)
    with pytest.raises(UserInputError, match="--device"):
        resolve_device("nonsense:x", 0, distributed=False)
    if not torch.cuda.is_available():
        assert resolve_device("auto", 0, distributed=False) == torch.device("cpu")
        with pytest.raises(UserInputError, match="no CUDA GPU is visible"):
            resolve_device("cuda", 0, distributed=False)


@requires_cuda
@pytest.mark.gpu
def test_each_process_takes_the_gpu_of_its_local_rank() -> None:
    last = torch.cuda.device_count() - 1
    assert resolve_device("cuda", last, distributed=True) == torch.device("cuda", last)
    assert resolve_device("auto", 0, distributed=False).type == "cuda"
    with pytest.raises(UserInputError, match="visible"):
        resolve_device("cuda", last + 1, distributed=True)


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 3, 0), (4, 3, 3), (8, 0, 0)])
def test_gpu_of_each_process(monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: int, expected: int) -> None:
    """One GPU per process on a node; a process that sees only one GPU (srun --gpus-per-task=1) takes it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert resolve_device("cuda", local_rank, distributed=True) == torch.device("cuda", expected)
    if visible > 1:
        with pytest.raises(UserInputError, match=f"GPU {visible} asked for, but only {visible} visible"):
            resolve_device("cuda", visible, distributed=True)


def test_cores_are_shared_between_processes_on_a_machine() -> None:
    cores = cpu_threads_per_process(1)
    assert cores >= 1
    assert cpu_threads_per_process(2) == max(1, cores // 2)
    assert cpu_threads_per_process(10_000) == 1


def test_helpers_work_without_a_process_group() -> None:
    assert not is_dist_avail_and_initialized()
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)
    value = torch.tensor([3.0])
    assert reduce_value(value) is value and value.item() == 3.0
    ctx = single_process("cpu")
    model = torch.nn.Linear(2, 2)
    assert wrap_ddp(model, ctx, sync_bn=True) is model
    assert ctx.is_main and not ctx.distributed
