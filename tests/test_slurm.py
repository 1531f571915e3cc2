"""SLURM for real: the batch scripts of docs/clusters.md, run by a one-node cluster (tests/slurm_cluster.py).

Each script is taken from the page as written; only what cannot fit this machine changes: its resources
(one node, at most two tasks, no GPUs), its data and output paths, and tiny training sizes appended to the
training command (later flags win). The stops are what SLURM itself sends: `scancel JOB` is what the time
limit and preemption do (SIGTERM to every process of the job, SIGKILL KillWait s later), and
`scancel --signal=USR1 --batch JOB` is what `#SBATCH --signal=B:USR1@90` delivers, to the batch script
alone. Runs as root where slurmctld and slurmd are installed (`.ci/install-slurm`); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_FLAGS, make_image_folder, run, script_env, torchrun
from slurm_cluster import (
    SlurmCluster,
    for_this_machine,
    sbatch_scripts,
    start_cluster,
    start_cluster_on,
    why_no_cluster,
)
from two_hosts import two_hosts

WHY_SKIP = why_no_cluster()
pytestmark = [pytest.mark.schedulers, pytest.mark.slow, pytest.mark.skipif(WHY_SKIP is not None, reason=WHY_SKIP or "")]

PAGE = REPO / "docs" / "clusters.md"
# 10 + 10 + 15 images: 28 train, 7 validate (an odd count: 2 processes cannot split it evenly). Two processes
# with batches of 3 take 4 steps an epoch.
FLAGS = [*TINY_FLAGS, "--batch-size", "3", "--epochs", "2", "--lr", "0.002"]
STEPS_PER_EPOCH = 4
# A job's states on its way to running again: a requeued one passes through the last three, its stopped run's
# processes still ending (COMPLETING) while its restart count has already gone up.
NOT_ENDED = {"PENDING", "RUNNING", "REQUEUED", "PREEMPTED", "COMPLETING"}
STOPPED = re.compile(r"Stopped by SIGTERM (?:at epoch (\d+), step (\d+)|after epoch (\d+)); its checkpoint is ")


def requeue_scripts() -> dict[str, str]:
    """The page's scripts that requeue before the time limit, by launcher."""
    scripts = {}
    for script in sbatch_scripts(PAGE):
        if "--signal=B:USR1" in script:
            scripts["torchrun" if "srun torchrun" in script else "python"] = script
    return scripts


# ---- the cluster, the data, and the run that nothing stopped -------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    # Jobs run `python` and `torchrun` from PATH: this Python's first.
    started = start_cluster(tmp_path_factory.mktemp("slurm"), f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("slurm_data") / "images", {"a": 10, "b": 10, "c": 15})


def samples_loaded(record: Path) -> int:
    """How many images the processes have loaded so far (tests/fault_injection's record: a file each)."""
    return sum(len(path.read_text().splitlines()) for path in record.iterdir())


def job_env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    """What sbatch passes on to a job: a script's environment (no ranks of ours), and the cluster."""
    return script_env(SLURM_CONF=cluster.env["SLURM_CONF"], PATH=cluster.env["PATH"], **extra)


class Job:
    """One batch script submitted: its id, its log, the folder it trains into and its record of loaded
    samples (tests/fault_injection: one file per process)."""

    def __init__(self, cluster: SlurmCluster, script: str, data: Path, folder: Path, nodes: int = 1) -> None:
        self.cluster, self.out, self.record, self.log = cluster, folder / "run", folder / "samples", folder / "log"
        self.record.mkdir(parents=True, exist_ok=True)
        self.path = folder / "job.sh"
        self.path.write_text(for_this_machine(script, data, self.out, FLAGS, nodes))
        self.id = 0

    def submit(self) -> Job:
        env = job_env(self.cluster, PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}",
                      RECORD_SAMPLES=str(self.record))
        self.id = self.cluster.sbatch(f"--chdir={REPO}", f"--output={self.log}", str(self.path), env=env)
        return self

    def loaded(self) -> int:
        """Samples loaded so far, by every process of every run of this job."""
        return samples_loaded(self.record)

    def wait_until_training(self, loaded_before: int, timeout: float = 120) -> None:
        """Until both processes have taken a batch more than `loaded_before` samples: inside an optimizer step."""
        deadline = time.monotonic() + timeout
        while self.loaded() < loaded_before + 6:
            state = self.cluster.job(self.id)["JobState"]
            assert state in NOT_ENDED and time.monotonic() < deadline, f"{state}\n{self.output()}"
            time.sleep(0.05)

    def wait_until_gone(self, timeout: float = 180) -> dict[str, str]:
        try:
            return self.cluster.wait_until_gone(self.id, timeout)
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{self.output()}") from None

    def wait_for_requeues(self, count: int, timeout: float = 120) -> None:
        """Until the job has been put back in the queue `count` times; fails at once if it ended instead."""
        deadline = time.monotonic() + timeout
        while int((fields := self.cluster.job(self.id))["Restarts"]) < count:
            ended = fields["JobState"] not in NOT_ENDED
            assert not ended and time.monotonic() < deadline, (f"job {self.id} not requeued {count} time(s): "
                                                               f"{fields['JobState']}\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        """The job's log, and what a failure that leaves no trace there needs: how far each process loaded, and
        what slurmd logged of the job (its signals and kills)."""
        log = self.log.read_text() if self.log.exists() else "(no log)"
        if len(log) > 9000:  # a requeued job's log: how its first run stopped, and how the last one ended
            log = f"{log[:4000]}\n[...]\n{log[-5000:]}"
        loaded = {path.name: len(path.read_text().splitlines()) for path in sorted(self.record.iterdir())}
        of_the_job = re.compile(rf"\b(?:job|JobId=|StepId=)\s*{self.id}\b", re.IGNORECASE)
        slurmd = [line for path in sorted((self.cluster.root / "log").glob("slurmd.*.log"))
                  for line in path.read_text(errors="replace").splitlines() if of_the_job.search(line)]
        return (f"{log}\n-- samples loaded per process: {loaded}\n-- slurmd on job {self.id}:\n"
                + "\n".join(slurmd[-30:]))

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "weights" / "model-1.pth", weights_only=True)


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


def epochs_logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(cluster: SlurmCluster, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The page's first batch script (srun, no requeue), run to its end: the weights every stopped run
    must end with."""
    (script,) = [script for script in sbatch_scripts(PAGE) if "--requeue" not in script]
    job = Job(cluster, script, data, tmp_path_factory.mktemp("unbroken")).submit()
    fields = job.wait_until_gone()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{job.output()}"
    return job


@pytest.fixture(scope="module")
def unbroken_torchrun(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same run under torchrun, outside SLURM: the weights a stopped srun + torchrun job must end with."""
    out = tmp_path_factory.mktemp("unbroken_torchrun")
    result = run([*torchrun(), "--standalone", "--nproc_per_node=2", str(REPO / "train_multi_gpu_using_launch.py"),
                  "--data-path", str(data), "--output-dir", str(out), *FLAGS])
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "weights" / "model-1.pth", weights_only=True)


# ---- srun: the ranks, the master, exact evaluation ---------------------------------------------------------------

def test_srun_two_tasks_evaluate_exactly_and_the_batch_script_alone_is_one_process(
        cluster: SlurmCluster, unbroken: Job, data: Path, tmp_path: Path) -> None:
    """Two tasks of srun count the 7 validation images (2 processes cannot split them evenly) as one
    process does on the same weights; that process is the launch script run inside a batch script without
    srun, which is one process."""
    assert "(slurm, gloo): rank 1/2" in unbroken.output()
    last = epochs_logged(unbroken.out)[-1]
    assert [m["epoch"] for m in epochs_logged(unbroken.out)] == [0, 1] and last["world_size"] == 2
    command = " ".join(["python", "train_multi_gpu_using_launch.py", "--data-path", str(data), "--output-dir",
                        str(unbroken.out), *FLAGS, "--eval-only", "--weights",
                        str(unbroken.out / "weights" / "model-1.pth")])
    alone = cluster.sbatch(f"--chdir={REPO}", f"--output={tmp_path / 'log'}", f"--wrap={command}",
                           env=job_env(cluster))
    fields, output = cluster.wait_until_gone(alone), (tmp_path / "log").read_text()
    assert fields["JobState"] == "COMPLETED" and "distributed init" not in output, output[-3000:]
    evaluated = json.loads(output.splitlines()[-1])
    assert last["val_total"] == 7
    assert (last["val_correct"], last["val_total"]) == (evaluated["val_correct"], evaluated["val_total"])


def test_srun_two_tasks_train_as_torchrun(unbroken: Job, unbroken_torchrun: dict[str, torch.Tensor]) -> None:
    assert max_difference(unbroken.weights(), unbroken_torchrun) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_what_srun_does_with_a_signal_it_gets(cluster: SlurmCluster, data: Path, tmp_path: Path,
                                              signum: signal.Signals) -> None:
    """The launcher table: srun answers a SIGTERM of its own with SIGKILL to every task (nothing saved), and
    passes SIGUSR1 on (every rank stops at a step and saves it)."""
    record = tmp_path / "samples"
    record.mkdir()
    env = job_env(cluster, PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}", RECORD_SAMPLES=str(record))
    with open(tmp_path / "log", "w") as log:
        srun = subprocess.Popen(["srun", "--ntasks=2", "python", "train_multi_gpu_using_launch.py", "--data-path",
                                 str(data), "--output-dir", str(tmp_path / "run"), *FLAGS], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while samples_loaded(record) < 6:  # each process has taken its first batch
            assert srun.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.05)
        srun.send_signal(signum)
        srun.wait(timeout=60)
    finally:
        if srun.poll() is None:
            srun.kill()
    output = (tmp_path / "log").read_text()
    if signum == signal.SIGTERM:
        assert "srun: forcing job termination" in output and "Stopped by" not in output, output[-3000:]
        assert srun.returncode != 143 and not (tmp_path / "run" / "checkpoint.pth").exists()
    else:
        assert srun.returncode == 143 and "Stopped by SIGUSR1 at epoch 0, step " in output, output[-3000:]
        assert torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=True)["progress"]["epoch"] == 0


# ---- stopped by SLURM, and the run that goes on ------------------------------------------------------------------

def stops_and_resumes(job: Job) -> tuple[list[str], list[str]]:
    """Where each run of the job stopped and where each resumed, as the log says."""
    log = job.log.read_text()
    return STOPPED.findall(log), re.findall(rf"Resuming from {re.escape(str(job.out))}/checkpoint.pth at epoch "
                                            r"(\d+), step (\d+)", log)


def unbroken_weights(launcher: str, request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    """The weights of the same job that nothing stopped, under the same launcher."""
    return request.getfixturevalue("unbroken").weights() if launcher == "python" else request.getfixturevalue(
        "unbroken_torchrun")


@pytest.mark.parametrize(("launcher", "stops"), [("python", ["warning", "preemption"]), ("torchrun", ["warning"])],
                         ids=["srun-warned-then-preempted", "srun-torchrun-warned"])
def test_the_warning_and_preemption_requeue_the_job_and_it_ends_with_the_unbroken_weights(
        cluster: SlurmCluster, data: Path, tmp_path: Path, launcher: str, stops: list[str],
        request: pytest.FixtureRequest) -> None:
    """The page's requeue script, stopped in the middle of an epoch by the time-limit warning (as
    --signal=B:USR1@90 sends it: the script requeues the job) or by a job of a higher partition that takes
    the node (SLURM signals every process, srun too, and requeues the job itself). srun alone is stopped
    both ways, one after the other: a job requeued twice, its log appended to."""
    job = Job(cluster, requeue_scripts()[launcher], data, tmp_path).submit()
    loaded = 0
    for requeues, stop in enumerate(stops, start=1):
        job.wait_until_training(loaded)
        if stop == "warning":
            cluster.command("scancel", "--signal=USR1", "--batch", str(job.id))
        else:
            cluster.sbatch("--partition=urgent", "--ntasks=2", "--output=/dev/null", "--wrap=sleep 1",
                           env=job_env(cluster))
        job.wait_for_requeues(requeues)
        loaded = job.loaded()  # the stopped run's; the next one starts seconds later
    fields = job.wait_until_gone(timeout=300)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == str(len(stops)), f"{fields}\n{job.output()}"
    stops_logged, resumes = stops_and_resumes(job)
    # --open-mode=append: the log still holds what the first run wrote (SLURM truncates it otherwise).
    assert len(stops_logged) == len(resumes) == len(stops), job.output()
    assert max_difference(unbroken_weights(launcher, request), job.weights()) == 0
    assert [m["epoch"] for m in epochs_logged(job.out)] == [0, 1]


@pytest.mark.parametrize("launcher", ["python", "torchrun"], ids=["srun", "srun-torchrun"])
def test_scancel_mid_epoch_leaves_the_checkpoint_of_a_step_and_the_next_job_goes_on_from_it(
        cluster: SlurmCluster, data: Path, tmp_path: Path, launcher: str, request: pytest.FixtureRequest) -> None:
    """`scancel JOB`: what the time limit and preemption do. SLURM signals the batch script and srun as well,
    and srun asks for its SIGKILL; the tasks must still stop at a step and save it."""
    job = Job(cluster, requeue_scripts()[launcher], data, tmp_path).submit()
    job.wait_until_training(0)
    cluster.command("scancel", str(job.id))
    fields = job.wait_until_gone()
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", f"{fields}\n{job.output()}"
    (stop,) = STOPPED.findall(job.log.read_text()) or [None]
    assert stop, job.output()
    progress = torch.load(job.out / "checkpoint.pth", weights_only=True)["progress"]
    assert (progress["epoch"], progress["step"]) == (0, int(stop[1])) and 0 < progress["step"] < STEPS_PER_EPOCH
    job.submit()  # the next job: the same script, --resume auto
    fields = job.wait_until_gone()
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{job.output()}"
    assert f"Resuming from {job.out / 'checkpoint.pth'} at epoch 0, step {progress['step']}" in job.log.read_text()
    assert max_difference(unbroken_weights(launcher, request), job.weights()) == 0


def listening_ports() -> set[int]:
    """The TCP ports something on this machine listens on."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_two_jobs_on_one_node_meet_on_ports_of_their_own(cluster: SlurmCluster, data: Path, tmp_path: Path) -> None:
    """The master is the first host of the node list, on port 20000 + job id mod 10000: two jobs sharing
    a node train side by side, each on its own port."""
    jobs = []
    for name in ("first", "second"):
        command = " ".join(["srun", "python", "train_multi_gpu_using_launch.py", "--data-path", str(data),
                            "--output-dir", str(tmp_path / name), *FLAGS, "--epochs", "1"])
        jobs.append(cluster.sbatch("--oversubscribe", "--ntasks=2", f"--chdir={REPO}",
                                   f"--output={tmp_path / name}.log", f"--wrap={command}", env=job_env(cluster)))
    ports = {20000 + job % 10000 for job in jobs}
    seen_together = False
    while not seen_together and any(cluster.job(job)["JobState"] in {"PENDING", "RUNNING"} for job in jobs):
        seen_together = ports <= listening_ports()
        time.sleep(0.1)
    for job, name in zip(jobs, ("first", "second"), strict=True):
        fields = cluster.wait_until_gone(job)
        log = (tmp_path / f"{name}.log").read_text()
        assert fields["JobState"] == "COMPLETED", f"{fields}\n{log[-3000:]}"
        assert epochs_logged(tmp_path / name)[0]["world_size"] == 2
    assert seen_together, f"the two jobs did not listen on ports {sorted(ports)} at the same time"


# ---- two nodes: one slurmd in each of two hosts (tests/two_hosts.py) ---------------------------------------

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with two_hosts(loopback_names=False) as hosts:
        started = start_cluster_on(hosts, tmp_path_factory.mktemp("slurm_two_nodes"),
                                   f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        try:
            yield started
        finally:
            started.stop()


def test_on_two_nodes_the_batch_script_trains_stops_at_a_step_on_scancel_and_the_next_job_ends_unbroken(
        two_nodes: SlurmCluster, data: Path, tmp_path: Path) -> None:
    """The page's requeue script with `srun`, on two nodes of one task each, each node a host of its own: one
    job runs to its end; another is cancelled inside its first epoch (scancel: SIGTERM to every task on both
    nodes), stops at one step on both, and the next job goes on from that step to the first job's weights."""
    script = requeue_scripts()["python"]
    unbroken = Job(two_nodes, script, data, tmp_path / "unbroken", nodes=2).submit()
    fields = unbroken.wait_until_gone()
    assert fields["JobState"] == "COMPLETED" and fields["NodeList"] == "node-a,node-b", f"{fields}\n{unbroken.output()}"
    assert {line["world_size"] for line in epochs_logged(unbroken.out)} == {2}
    job = Job(two_nodes, script, data, tmp_path / "stopped", nodes=2).submit()
    job.wait_until_training(0)
    two_nodes.command("scancel", str(job.id))
    fields = job.wait_until_gone()
    assert fields["JobState"] == "CANCELLED", f"{fields}\n{job.output()}"
    (stop,) = STOPPED.findall(job.log.read_text()) or [None]
    assert stop, job.output()
    progress = torch.load(job.out / "checkpoint.pth", weights_only=True)["progress"]
    assert (progress["epoch"], progress["step"]) == (0, int(stop[1])) and 0 < progress["step"] < STEPS_PER_EPOCH
    job.submit()
    fields = job.wait_until_gone()
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{job.output()}"
    assert f"Resuming from {job.out / 'checkpoint.pth'} at epoch 0, step {progress['step']}" in job.log.read_text()
    assert max_difference(unbroken.weights(), job.weights()) == 0
