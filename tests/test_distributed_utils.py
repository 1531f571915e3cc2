"""Reading ranks from each launcher, picking the device, and the helpers that work with one process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, requires_cuda
from multi_train_utils import distributed_utils, errors, launch, shutdown
from multi_train_utils.distributed_utils import (
    get_rank,
    get_world_size,
    init_distributed_mode,
    is_dist_avail_and_initialized,
    is_main_process,
    reduce_value,
    single_process,
    wrap_ddp,
)
from multi_train_utils.errors import QuietExit, UserInputError
from multi_train_utils.launch import (
    SLURM_PORT_BASE,
    Launch,
    check_one_gpu_per_process,
    cpu_share,
    cpu_threads_for,
    detect_launch,
    first_host,
    resolve_device,
    srun_meeting_point,
    use_device,
)


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size, launch.source) == (
        5, 1, 8, 4, "torchrun")


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set but RANK is not"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK=one: a launcher's variable that must be a whole number"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x2"}, "SLURM_STEP_NUM_TASKS=x2")])
def test_a_launchers_variables_that_do_not_fit_are_refused(env: dict[str, str], message: str) -> None:
    """Half of RANK and WORLD_SIZE would start N processes that each train alone, into one folder."""
    with pytest.raises(UserInputError, match=message):
        detect_launch(env)


def test_a_slurm_job_id_that_is_no_number_is_refused() -> None:
    with pytest.raises(UserInputError, match="SLURM_JOB_ID=x1"):
        srun_meeting_point({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "x1"})


def test_one_process_per_container_when_only_rank_and_world_size_are_set() -> None:
    """Kubernetes' PyTorchJob without torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each
    pod: one process per pod, which must not divide the pod's CPUs by the world size or count its one GPU
    as too few for WORLD_SIZE processes."""
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (3, 0, 4, 1)
    check_one_gpu_per_process(launch, 1, env)


def test_slurm_variables_under_srun() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (3, 1, 4, 2)
    assert launch.source == "slurm"
    assert srun_meeting_point(env) == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(SLURM_PORT_BASE + 4242)}


def test_slurm_step_values_and_preset_master_win() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_NODELIST": "a1,b2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"}
    launch = detect_launch(env)
    assert (launch.world_size, launch.local_world_size) == (2, 2)
    assert srun_meeting_point(env) == {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"}


def test_the_tasks_of_srun_meet_where_srun_meeting_point_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of one started by srun: SLURM sets no MASTER_ADDR, which the step's first node becomes."""
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # and restored to what it was (or unset) once the test ends
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "localhost",
           "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ctx = init_distributed_mode("cpu")
    try:
        assert ctx.distributed and get_world_size() == 1 and os.environ["MASTER_ADDR"] == "localhost"
    finally:
        distributed_utils.cleanup()


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


@pytest.mark.parametrize(("env", "threads"), [
    ({"SLURM_CPUS_PER_TASK": "3"}, 3),  # a task of srun: its --cpus-per-task, bound to cores or not
    ({"SLURM_CPUS_PER_TASK": "64"}, 8),  # but never more than it may use
    ({}, 4),  # srun without --cpus-per-task: the node's usable cores shared by its 2 tasks
])
def test_a_slurm_task_takes_its_cpus_per_task(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                              threads: int) -> None:
    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    task = Launch(rank=1, local_rank=1, world_size=2, local_world_size=2, source="slurm")
    assert cpu_threads_for(task, env) == threads
    torchrun = Launch(rank=1, local_rank=1, world_size=2, local_world_size=2, source="torchrun")
    assert cpu_threads_for(torchrun, {"SLURM_CPUS_PER_TASK": "3"}) == 4, "torchrun inside a job shares the cores"


def cgroup_tree(root: Path, own: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /sys/fs/cgroup of `files` (path: content) and a /proc/self/cgroup of `own`."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    (root / "self_cgroup").write_text(own)
    return root / "fs", root / "self_cgroup"


@pytest.mark.parametrize(("own", "files", "cpus"), [
    ("0::/kubepods/pod1/c1\n", {"fs/kubepods/pod1/c1/cpu.max": "250000 100000\n"}, 2),  # v2: 2.5 CPUs
    ("0::/\n", {"fs/cpu.max": "100000 100000\n"}, 1),  # v2 inside a container: its cgroup is the root
    ("0::/job\n", {"fs/job/cpu.max": "max 100000\n", "fs/cpu.max": "300000 100000\n"}, 3),  # a parent's limit
    ("4:cpu,cpuacct:/docker/abc\n", {"fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                                      "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 2),  # v1
    # v1 as RHEL 7 names it: the hierarchy "cpuacct,cpu", mounted as cpu,cpuacct with a link "cpu" to it
    ("4:cpuacct,cpu:/\n", {"fs/cpu/cpu.cfs_quota_us": "150000\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ("1:cpu:/\n", {"fs/cpu/cpu.cfs_quota_us": "-1\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}, 8),  # none
    ("0::/\n", {}, 8)])
def test_a_containers_cpu_quota_counts_as_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own: str,
                                                    files: dict[str, str], cpus: int) -> None:
    """`docker --cpus`, Kubernetes' CPU limit: the affinity mask shows every core of the machine, and four
    threads sharing two cores' worth of quota run many times slower than two."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    assert launch.usable_cpus(*cgroup_tree(tmp_path, own, files)) == cpus


def test_a_users_omp_num_threads_is_kept_but_not_torchruns_own_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    torchrun = Launch(rank=0, local_rank=0, world_size=2, local_world_size=2, source="torchrun")
    spawn = Launch(rank=0, local_rank=0, world_size=2, local_world_size=2, source="spawn")
    assert cpu_threads_for(spawn, {"OMP_NUM_THREADS": "3"}) == 3, "the user's choice"
    monkeypatch.setattr(launch, "set_before_the_launcher", lambda name: True)
    assert cpu_threads_for(torchrun, {"OMP_NUM_THREADS": "3"}) == 3, "set before torchrun started: the user's"
    monkeypatch.setattr(launch, "set_before_the_launcher", lambda name: False)
    assert cpu_threads_for(torchrun, {"OMP_NUM_THREADS": "1"}) == 4, "torchrun's own 1: the cores are shared"
    assert cpu_threads_for(spawn, {"OMP_NUM_THREADS": "zero"}) == 4


@pytest.mark.slow
def test_a_real_cgroup_quota_is_read(tmp_path: Path) -> None:
    """A cgroup v1 `cpu` controller (this project's CI mounts one; v2 where that is what the machine has), a
    quota of one CPU, and a process moved into it: it counts one usable CPU."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        group, limits = v1 / f"train_multi_gpu_test_{os.getpid()}", {"cpu.cfs_quota_us": "100000",
                                                                   "cpu.cfs_period_us": "100000"}
    elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text():
        group, limits = v2 / f"train_multi_gpu_test_{os.getpid()}", {"cpu.max": "100000 100000"}
    else:
        pytest.skip("no cgroup cpu controller to write to here")
    try:
        group.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a cgroup here ({err.strerror})")
    try:
        for name, value in limits.items():
            (group / name).write_text(value)
        code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()));"
                "import time; time.sleep(0.5); from multi_train_utils.launch import usable_cpus;"
                "print(usable_cpus())")
        child = subprocess.Popen([sys.executable, "-c", code, str(group / "cgroup.procs")], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and out.strip() == "1", out
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def test_cores_are_shared_between_processes_on_a_machine() -> None:
    cores = cpu_share(1)
    assert cores >= 1
    assert cpu_share(2) == max(1, cores // 2)
    assert cpu_share(10_000) == 1


def test_helpers_work_without_a_process_group() -> None:
    assert not is_dist_avail_and_initialized()
    assert (get_rank(), get_world_size(), is_main_process()) == (0, 1, True)
    value = torch.tensor([3.0])
    assert reduce_value(value) is value and value.item() == 3.0
    ctx = single_process("cpu")
    model = torch.nn.Linear(2, 2)
    assert wrap_ddp(model, ctx, sync_bn=True) is model
    assert ctx.is_main and not ctx.distributed


def torchrun_env(local_world_size: int) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": str(local_world_size), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": str(local_world_size)}


@pytest.mark.parametrize(("env", "visible", "flag"), [
    (torchrun_env(2), 1, "--nproc_per_node 2"),
    (torchrun_env(8), 4, "--nproc_per_node 8"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "1"},
     1, "--ntasks-per-node 2"),
])
def test_more_processes_than_gpus_on_a_machine_is_one_line_naming_the_flag(
        env: dict[str, str], visible: int, flag: str) -> None:
    with pytest.raises(UserInputError, match=f"^{flag}: .* but {visible} GPU\\(s\\)"):
        check_one_gpu_per_process(detect_launch(env), visible, env)


@pytest.mark.parametrize("env", [
    torchrun_env(2),
    # srun --gpus-per-task=1: each task sees only its own GPU, and SLURM says the node has enough.
    {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "4"},
    {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "1"},
])
def test_one_gpu_per_process_is_allowed(env: dict[str, str]) -> None:
    check_one_gpu_per_process(detect_launch(env), 1 if "SLURM_PROCID" in env else 2, env)


def test_two_processes_on_one_gpu_stop_before_any_process_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --nproc_per_node=2 on a one-GPU machine: NCCL would fail inside init_process_group."""
    for name, value in torchrun_env(2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("init_process_group was called")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    monkeypatch.setattr(torch.cuda, "set_device", no_group)
    with pytest.raises(UserInputError, match="--nproc_per_node 2: 2 processes on this machine but 1 GPU"):
        init_distributed_mode("auto")


def test_a_gpu_process_asks_cudnn_for_its_fastest_convolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    use_device(torch.device("cpu"))
    assert not chosen and not torch.backends.cudnn.benchmark
    use_device(torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)] and torch.backends.cudnn.benchmark


class FakeGroup:
    """Stands in for torch.distributed's process-group functions; records which were called."""

    def __init__(self, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        monkeypatch.setattr(distributed_utils, "is_dist_avail_and_initialized", lambda: not self.calls)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda: backend)
        monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: self.calls.append("destroy"))
        monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group",
                            lambda: self.calls.append("abort"))


@pytest.mark.parametrize(("backend", "fails", "expected"), [
    ("nccl", True, ["abort"]), ("nccl", False, ["destroy"]), ("gloo", True, ["destroy"])])
def test_a_failed_rank_aborts_nccl_instead_of_waiting_for_the_others(
        monkeypatch: pytest.MonkeyPatch, backend: str, fails: bool, expected: list[str]) -> None:
    """destroy_process_group on NCCL waits for collectives that ranks still blocked may never finish."""
    group = FakeGroup(backend, monkeypatch)
    distributed_utils.cleanup(failed=fails)
    distributed_utils.cleanup(failed=fails)  # once left, left
    assert group.calls == expected


@pytest.fixture
def connected(monkeypatch: pytest.MonkeyPatch) -> torch.distributed.Store:
    """A process group of two as end_run sees it: a key-value store shared by its processes, nothing to leave,
    and no moment's wait for a quiet exit."""
    store = torch.distributed.HashStore()
    monkeypatch.setattr(shutdown, "is_dist_avail_and_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(shutdown, "cleanup", lambda failed=False: None)
    monkeypatch.setattr(shutdown, "QUIET_EXIT_DELAY_S", 0.0)
    return store


def ended(err: BaseException, rank: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """end_run's exit code and what it wrote to stderr."""
    with pytest.raises(SystemExit) as stop:
        shutdown.end_run(err, rank)
    return stop.value.code, capsys.readouterr().err


def test_only_the_first_process_to_stop_explains(connected: torch.distributed.Store,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The others end with the same exit code and no word: their failure follows from the first one's."""
    assert ended(UserInputError("cannot read image a.jpg"), 1, capsys) == (2, "error: cannot read image a.jpg\n")
    assert ended(RuntimeError("Connection closed by peer"), 0, capsys) == (1, "")
    assert ended(UserInputError("the same mistake, found by another rank"), 2, capsys) == (2, "")


def test_a_signal_is_told_by_rank_0_without_asking_the_store(connected: torch.distributed.Store,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Every process got Ctrl-C or the launcher's SIGTERM: the store (whose host may be ending too) is not asked."""
    print("[epoch 2] train:  67%|######6   | 2/3", end="")  # a bar the stop cut short, before its line ended
    with pytest.raises(SystemExit) as stop:
        shutdown.end_run(KeyboardInterrupt(), 0)
    out, said = capsys.readouterr()
    assert stop.value.code == 130 and said == "Stopped by Ctrl-C before any checkpoint was written\n"
    assert out.endswith("\n"), "the line is its own in a terminal or a log holding both streams"
    assert ended(errors.Terminated("SIGTERM"), 1, capsys) == (143, "")
    assert not connected.check(["processes_stopped"])


def test_once_the_launcher_is_gone_any_error_is_its_stop_and_rank_0_says_so(connected: torch.distributed.Store,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun's agent killed: the rank whose watch saw it first stops, and its partner fails in a collective
    before its own watch sees it. That failure is the launcher's end too, told by rank 0, not by nobody."""
    shutdown._Ending.launcher = os.getppid() + 1  # as if the process that started this one had ended
    assert ended(RuntimeError("Connection closed by peer"), 0, capsys) == (
        143, "Stopped by the end of the launcher that started this run before any checkpoint was written\n")
    assert ended(RuntimeError("Connection closed by peer"), 1, capsys) == (143, "")


def test_a_stop_at_a_step_ends_quietly_when_its_partner_has_already_ended(
        connected: torch.distributed.Store, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun's agent killed between two steps: one rank stops at the step, and its partner, whose own stop
    reached it outside the steps, has already said so and ended. The barrier that waits for rank 0's word
    then fails ("connection closed by peer"); that is no traceback, and the exit code stays the stop's."""
    def partner_gone() -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:65160")

    monkeypatch.setattr(shutdown, "barrier", partner_gone)
    assert ended(errors.Preempted("Stopped by SIGTERM after epoch 3; ..."), 1, capsys) == (143, "")
    assert ended(errors.Preempted("Stopped by SIGTERM after epoch 3; ..."), 0, capsys) == (
        143, "Stopped by SIGTERM after epoch 3; ...\n")


def test_the_stop_line_names_the_checkpoint_only_when_there_is_one(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint.pth"
    assert shutdown.stopped_line(errors.Terminated("SIGTERM"), checkpoint) == (
        "Stopped by SIGTERM before any checkpoint was written")
    checkpoint.write_bytes(b"saved")
    assert shutdown.stopped_line(KeyboardInterrupt(), checkpoint) == (
        f"Stopped by Ctrl-C; the last checkpoint written, {checkpoint}, is kept; go on with --resume auto")


def test_a_store_nobody_answers_means_another_process_stopped_first(monkeypatch: pytest.MonkeyPatch) -> None:
    def gone() -> None:
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(shutdown, "is_dist_avail_and_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", gone)
    assert shutdown.first_to_stop() is False
    assert shutdown.another_process_failed() is True
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store",
                        lambda: pytest.fail("a store found gone is not asked again: each try prints C++ frames"))
    assert shutdown.first_to_stop() is False and shutdown.another_process_failed() is True


def test_a_quiet_exit_waits_for_the_explaining_process_and_stays_quiet_when_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops every process once one ends: the quiet ones wait a moment, so that the one that
    explains is not stopped before it has said why; torchrun's SIGTERM meanwhile ends them quietly too."""
    monkeypatch.setattr(shutdown, "QUIET_EXIT_DELAY_S", 5.0)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(QuietExit) as quiet:
        shutdown.exit_quietly(2)
    assert quiet.value.code == 2 and 0.2 < time.monotonic() - started < 4


def test_a_time_out_whose_store_is_gone_too_says_so_from_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Naming the silent ranks needs the store; if its host is gone or cut off, no other process can say it
    either: this one says that the store does not answer, where it is, and explains itself."""
    def gone() -> None:
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(shutdown, "is_dist_avail_and_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", gone)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    failure = shutdown.collective_failure(RuntimeError("Timed out waiting 5000ms"), 1)
    assert isinstance(failure, shutdown.CutOffError)
    assert str(failure).startswith("rank 1 waited longer than --dist-timeout") and "store at 10.0.0.1:29500 " \
        "does not answer" in str(failure)


class SilentStore:
    """A store whose every question waits for good, as one across a cut cable does."""

    def set_timeout(self, timeout: object) -> None:
        pass

    def add(self, key: str, value: int) -> int:
        time.sleep(3600)
        return 0


def test_a_store_that_never_answers_counts_as_gone_within_its_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutdown, "is_dist_avail_and_initialized", lambda: True)
    monkeypatch.setattr(shutdown._Ending, "store_gone", False)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", SilentStore, raising=False)
    started = time.monotonic()
    assert shutdown.store_answer(lambda store: store.add("processes_stopped", 1), gone="gone", longest_s=0.5) == "gone"
    assert time.monotonic() - started < 2 and shutdown._Ending.store_gone
