"""Long runs on shared clusters: checkpoints inside an epoch, a scheduler's stop signal, and a resume on
another number of processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import multi_train_utils.train_eval_utils as engine
from conftest import (
    REPO,
    TINY_FLAGS,
    checkpointer,
    free_port,
    make_image_folder,
    python,
    run,
    run_single_in_this_process,
    script_env,
    signal_once_ready,
    spawned_by,
    torchrun,
)
from multi_train_utils import errors, features
from multi_train_utils.data import ResumableDistributedSampler, leave_signals_to_the_trainer, loader_start_method
from multi_train_utils.errors import Preempted
from multi_train_utils.optim import StepEnd
from multi_train_utils.periodic_checkpoints import PeriodicCheckpoints
from multi_train_utils.recorder import write_checkpoint

# 36 images: 30 train. 2 processes x batch 3 = 5 steps per epoch; 3 processes x batch 3 = 3 steps.
FLAGS = [*TINY_FLAGS, "--epochs", "1", "--batch-size", "3", "--lr", "0.002"]
SCRIPTS = {"single": [python(), str(REPO / "train_single_gpu.py")],
           "spawn": [python(), str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2"]}


def torchrun_cmd() -> list[str]:
    return [*torchrun(), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            str(REPO / "train_multi_gpu_using_launch.py")]


# ---- the data position: a permutation dealt round-robin, resumable from any sample --------------------------

@pytest.mark.parametrize(("size", "before", "after", "batch", "steps_done"), [
    (23, 2, 3, 2, 3), (30, 2, 1, 3, 2), (30, 3, 2, 3, 1), (31, 1, 4, 2, 5)])
def test_an_epoch_resumed_on_another_world_size_deals_every_remaining_sample_once(
        size: int, before: int, after: int, batch: int, steps_done: int) -> None:
    def shares(world_size: int, samples_seen: int) -> list[list[int]]:
        samplers = [ResumableDistributedSampler(range(size), world_size, rank, seed=7) for rank in range(world_size)]
        for sampler in samplers:
            sampler.set_epoch(4)
            sampler.skip(samples_seen)
        return [list(sampler) for sampler in samplers]

    first = [share[:steps_done * batch] for share in shares(before, 0)]  # what the stopped run trained
    seen = steps_done * batch * before
    rest = shares(after, seen)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(7 + 4)).tolist()
    assert sorted(i for share in first for i in share) == sorted(order[:seen]), "the first part is a prefix"
    assert all(len(share) == len(rest[0]) for share in rest), "equal shares keep the processes in step"
    trained = [i for share in first + rest for i in share]
    assert len(trained) == len(set(trained)), "no sample twice in one epoch"
    assert set(trained) == set(order[:seen + len(rest[0]) * after])
    assert size - len(trained) < after, "only what does not divide among the processes waits for the next epoch"


@pytest.mark.parametrize("size", [24, 23])
def test_a_fresh_epoch_is_the_shuffle_distributed_sampler_deals_without_its_repeats(size: int) -> None:
    samples = list(range(size))
    for rank in range(3):
        ours = ResumableDistributedSampler(samples, 3, rank, seed=5)
        theirs = torch.utils.data.DistributedSampler(samples, num_replicas=3, rank=rank, shuffle=True, seed=5)
        ours.skip(9)
        ours.set_epoch(2)  # a new epoch starts at its beginning
        theirs.set_epoch(2)
        # 23 on 3: DistributedSampler pads to 24 with a repeat and gives each 8; each gets its first 7 here.
        assert list(ours) == list(theirs)[:size // 3] and len(ours) == size // 3


# ---- when to write a checkpoint inside an epoch, and when to stop ---------------------------------------------

def step_end(epoch: int, step: int, steps_per_epoch: int = 6) -> StepEnd:
    return StepEnd(epoch, step, steps_per_epoch, step * 2, torch.zeros(()), torch.zeros(()), nn.Linear(1, 1))


def test_checkpoints_come_every_n_steps_or_m_minutes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "run", batches=6) as saver:
        saved: list[tuple[int, int]] = []
        monkeypatch.setattr(saver, "save_at", lambda step: saved.append((step.epoch, step.step)))
        by_steps = PeriodicCheckpoints(saver, every_steps=4, every_minutes=None, timeout_s=60)
        for epoch in (0, 1):
            for step in range(1, 7):
                by_steps.on_step_end(step_end(epoch, step))
        # Steps counted over epochs: step 2 of epoch 1 is step 8 of the run.
        assert saved == [(0, 4), (1, 2), (1, 6)]

        saved.clear()
        clock = [saver.saved_at]
        monkeypatch.setattr(time, "monotonic", lambda: clock[0])
        by_time = PeriodicCheckpoints(saver, every_steps=None, every_minutes=0.5, timeout_s=60)
        clock[0] += 29
        by_time.on_step_end(step_end(0, 1))
        clock[0] += 2
        by_time.on_step_end(step_end(0, 2))
        assert saved == [(0, 2)]


@pytest.mark.parametrize("last_word", ["SIGTERM", "SIGHUP"])  # a scheduler's; a closed terminal's
def test_a_stop_signal_waits_for_the_next_step_during_training_and_stops_at_once_before_or_at_the_deadline(
        tmp_path: Path, last_word: str) -> None:
    model = nn.Linear(2, 2)
    errors.listen_for_stop_signals()
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "run") as saver:
        stop = features.StopAtStep(saver, grace_s=0.5, timeout_s=60, epochs=2)
        stop.on_fit_start()
        try:
            os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's early warning: no deadline yet
            time.sleep(1.5)  # the handler has run; nothing is raised: the next step will stop the run
            assert features.stop_signal() == "SIGUSR1"
            with pytest.raises(Preempted):  # at the next step, with the checkpoint of that step
                stop.on_step_end(step_end(0, 3))
            assert torch.load(saver.recorder.checkpoint_path, weights_only=True)["progress"]["step"] == 3
            with pytest.raises(SystemExit) as stopped:
                os.kill(os.getpid(), getattr(signal, last_word))  # the last word: the kill follows
                started = time.monotonic()
                time.sleep(10)  # a rank that never reaches its next step (a long validation, a hung loader)
            assert stopped.value.code == 143 and time.monotonic() - started < 2, "stopped at the deadline"
        finally:
            stop.on_fit_end()


def finishes_when_signalled_again_at_every_line(handler: Callable[[int, object], None], signum: int) -> bool:
    """Whether `handler` ends (returns or raises) when the same signal runs it again at each line it executes,
    as a second signal does in the main thread: SLURM signals every process of a torchrun job, and torchrun
    passes the signal on, milliseconds apart. Run in a thread of its own, which a handler that waits for a
    lock its own first call holds never leaves."""

    def handle_twice() -> None:
        def again_at_each_line(frame: object, event: str, arg: object) -> object:
            if event == "line":  # Python traces nothing inside this function: the second call runs whole
                with contextlib.suppress(BaseException):
                    handler(signum, None)
            return again_at_each_line

        sys.settrace(again_at_each_line)
        try:
            with contextlib.suppress(BaseException):
                handler(signum, None)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=handle_twice, daemon=True)
    thread.start()
    thread.join(10)
    return not thread.is_alive()


@pytest.mark.parametrize("moment", ["training", "past the deadline"])
def test_a_stop_signal_that_comes_again_inside_its_own_handler_is_handled_both_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str) -> None:
    model = nn.Linear(2, 2)
    monkeypatch.setattr(errors._Ending, "under_way", False)  # stop_now's: this test's stops end nothing
    with checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "run") as saver:
        stop = features.StopAtStep(saver, grace_s=60, timeout_s=60, epochs=2)
        stop.on_fit_start()
        try:
            request = features.StopRequest.current
            request.at_steps = moment == "training"
            handlers = {signal.getsignal(signum) for signum in errors.STOP_SIGNALS}
            assert handlers == {request.on_signal}
            assert finishes_when_signalled_again_at_every_line(request.on_signal, signal.SIGTERM)
            assert request.signal_name == "SIGTERM"
        finally:
            request.at_steps = True
            stop.on_fit_end()


# ---- --keep-checkpoints ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [1, 3])
def test_keep_checkpoints_keeps_the_newest_k(tmp_path: Path, keep: int) -> None:
    positions = [(0, 2), (0, 4), (0, None), (1, 2), (1, 4)]  # (epoch, step); None: the end of the epoch
    for epoch, step in positions:
        progress = {"epoch": epoch, "step": step} if step else None
        write_checkpoint(tmp_path, {"model": {}, "epoch": epoch if progress is None else epoch - 1,
                                    "progress": progress}, keep)
        time.sleep(0.01)  # distinct modification times, by which the oldest go first
    newest = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert newest["progress"] == {"epoch": 1, "step": 4}
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("*")) if keep > 1 else []
    assert kept == ["epoch-0-end.pth", "epoch-1-step-2.pth"][:keep - 1]
    assert (tmp_path / "checkpoints").exists() == (keep > 1)
    if keep > 1:
        assert torch.load(tmp_path / "checkpoints" / "epoch-1-step-2.pth", weights_only=True)["progress"] == {
            "epoch": 1, "step": 2}


# ---- loader workers: the scheduler's SIGTERM reaches them too ---------------------------------------------------

class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        time.sleep(0.02)
        return index


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="Linux only")
def test_a_loader_worker_ignores_a_sigterm_that_its_training_process_did_not_send() -> None:
    # As build_loaders makes them: forked with the stop signals blocked, so that every thread of the worker
    # leaves them to the one that sorts them. (Torch starts a thread in the worker before worker_init_fn.)
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=1,
                                         worker_init_fn=leave_signals_to_the_trainer,
                                         multiprocessing_context=loader_start_method(1))
    batches = iter(loader)
    assert next(batches).tolist() == [0, 1]
    (worker,) = batches._workers
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # sent by another process, as slurmstepd does
    subprocess.run(["kill", "-USR1", str(worker.pid)], check=True)
    time.sleep(0.5)
    assert worker.is_alive()
    assert next(batches).tolist() == [2, 3]
    # SIGTERM from the training process itself still ends it, as the loader's shut-down and Python's exit
    # send it (the loader first stops watching for workers that die).
    torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
    batches._worker_pids_set = False
    worker.terminate()
    worker.join(5)
    assert not worker.is_alive()
    batches._shutdown_workers()


# ---- a stop signal in the middle of an epoch, on every launcher, and the resume ------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("preempt") / "images", {"red": 12, "green": 12, "blue": 12})


def signal_env(tmp_path: Path, name: str, to: str, record: Path | None = None) -> dict[str, str]:
    """Rank 1 (or the only rank) sends `name` when it takes batch 1, once."""
    extra = {"SIGNAL_RANK": "0" if to == "itself" else "1", "SIGNAL_EPOCH": "0", "SIGNAL_STEP": "1",
             "SIGNAL_NAME": name, "SIGNAL_TO": to, "SIGNAL_ONCE_FILE": str(tmp_path / "signalled")}
    if record:
        extra["RECORD_SAMPLES"] = str(record)
    return script_env(PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}", **extra)


def weights_differ(a: Path, b: Path) -> float:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


def stop(cmd: list[str], data: Path, out: Path, env: dict[str, str]) -> dict:
    """Run until the signal stops it, check how it stopped, and return the checkpoint it left."""
    stopped = run([*cmd, "--data-path", str(data), "--output-dir", str(out), *FLAGS], env=env)
    # torchrun itself reports 1 (its SignalException) after passing SIGTERM on; its workers exit 143.
    assert stopped.returncode == (1 if "torch.distributed.run" in cmd else 143), stopped.stderr[-3000:]
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    progress = saved["progress"]
    assert progress["epoch"] == 0 and 0 < progress["step"] < 5, progress
    line = (f"Stopped by SIG{env['SIGNAL_NAME']} at epoch 0, step {progress['step']}; its checkpoint is "
            f"{out / 'checkpoint.pth'}; go on with --resume auto")
    assert line in stopped.stderr.splitlines(), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr or "torch.distributed.run" in cmd, stopped.stderr[-3000:]
    # Sent while batch 1 was trained (the second step); passed on by a launcher it may arrive a step later.
    assert 2 <= progress["step"] <= 3
    return saved


def resume(cmd: list[str], data: Path, out: Path, saved: dict, env: dict[str, str] | None = None,
           processes: int = 2) -> str:
    """Continue the stopped run to its end; return its output."""
    resumed = run([*cmd, "--data-path", str(data), "--output-dir", str(out), *FLAGS, "--resume", "auto"], env=env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    # The step in this run's own steps (batch 3 x processes): the samples seen, not the saved run's step count.
    step = saved["progress"]["samples_seen"] // (3 * processes)
    assert f"Resuming from {out / 'checkpoint.pth'} at epoch 0, step {step}" in resumed.stdout
    # Its progress bar counts the whole epoch: the batches trained before the stop, of 30 // processes // 3.
    assert re.search(rf"{step}/{30 // processes // 3} ", resumed.stdout), resumed.stdout[-2000:]
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]
    return resumed.stdout


def train_in_this_process(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *FLAGS, *extra])


def test_a_single_process_run_stopped_by_sigterm_mid_epoch_and_resumed_ends_with_the_unbroken_weights(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert train_in_this_process(data, tmp_path / "unbroken").returncode == 0
    real_train_one_epoch = engine.train_one_epoch

    def sigterm_at_batch_1(*args: object, **kwargs: object) -> float:
        loader = args[3]

        class Signalling:  # the loader, sending SIGTERM as it hands out batch 1
            def __len__(self) -> int:
                return len(loader)

            def __iter__(self) -> Iterator[object]:
                for index, batch in enumerate(loader):
                    if index == 1:
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield batch

        return real_train_one_epoch(*args[:3], Signalling(), *args[4:], **kwargs)

    monkeypatch.setattr(engine, "train_one_epoch", sigterm_at_batch_1)
    stopped = train_in_this_process(data, tmp_path / "run")
    assert stopped.returncode == 143
    monkeypatch.setattr(engine, "train_one_epoch", real_train_one_epoch)
    saved = torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=True)
    assert saved["progress"] == {**saved["progress"], "epoch": 0, "step": 2, "samples_seen": 2 * 3}
    assert (f"Stopped by SIGTERM at epoch 0, step 2; its checkpoint is {tmp_path / 'run' / 'checkpoint.pth'}; "
            "go on with --resume auto") in stopped.stderr
    resumed = train_in_this_process(data, tmp_path / "run", "--resume", "auto")
    assert resumed.returncode == 0 and "at epoch 0, step 2" in resumed.stdout
    assert weights_differ(tmp_path / "unbroken" / "weights" / "model-0.pth",
                          tmp_path / "run" / "weights" / "model-0.pth") == 0


@pytest.fixture(scope="module")
def unbroken(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights of a run of two processes that nothing stopped (torchrun and spawn train alike)."""
    out = tmp_path_factory.mktemp("unbroken")
    result = run([*SCRIPTS["spawn"], "--data-path", str(data), "--output-dir", str(out), *FLAGS])
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "weights" / "model-0.pth"


@pytest.mark.slow
@pytest.mark.every_launcher  # the single-process stop above is the README command's
def test_a_torchrun_job_stopped_by_sigterm_mid_epoch_and_resumed_ends_with_the_unbroken_weights(
        data: Path, tmp_path: Path, unbroken: Path) -> None:
    """torchrun passes the SIGTERM it gets (from Kubernetes, SLURM, a person) on to its workers. The run is
    resumed by the spawn script: the checkpoint belongs to the run, not to its launcher."""
    out = tmp_path / "run"
    saved = stop(torchrun_cmd(), data, out, signal_env(tmp_path, "TERM", "launcher"))
    assert saved["progress"]["samples_seen"] == saved["progress"]["step"] * 3 * 2
    resume(SCRIPTS["spawn"], data, out, saved)
    assert weights_differ(unbroken, out / "weights" / "model-0.pth") == 0


@pytest.mark.slow
@pytest.mark.schedulers  # SLURM's --signal=B:USR1, and a resume on another number of processes
def test_a_usr1_to_spawn_checkpoints_its_step_and_three_processes_train_every_remaining_sample_once(
        data: Path, tmp_path: Path) -> None:
    """SLURM's --signal=B:USR1@90 passed on to the spawn script; the checkpoint of the step where it stopped
    resumed by three processes, which train every sample left in the epoch once."""
    out, record = tmp_path / "run", tmp_path / "samples"
    record.mkdir()
    saved = stop(SCRIPTS["spawn"], data, out, signal_env(tmp_path, "USR1", "launcher", record=record))
    resumed = resume([*SCRIPTS["spawn"][:-1], "3"], data, out, saved,
                     env=script_env(PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}",
                                    RECORD_SAMPLES=str(record)), processes=3)
    assert "Resuming with 3 processes instead of 2" in resumed and "the lr follows the batch of one step" in resumed
    train = {str(data / path) for path in json.loads((out / "split.json").read_text())["train"]}
    # One file per process of either run; the validation images they loaded are left out.
    trained = [path for log in record.glob("*") for path in log.read_text().splitlines() if path in train]
    seen = saved["progress"]["samples_seen"]
    assert len(trained) == len(set(trained)), "a sample trained twice in one epoch"
    assert len(trained) == seen + (30 - seen) // 3 // 3 * 9, "every remaining sample, but what fills no batch of 3"


@pytest.mark.slow
def test_a_signal_while_the_spawned_processes_start_still_ends_the_job_for_a_requeue(data: Path,
                                                                                     tmp_path: Path) -> None:
    """While the launcher starts its processes, and before a started one has its handlers (the signal's
    own default then ends it), the job must still end, exit with the code a requeue expects, and say so."""
    # Sent as soon as the launcher is starting its processes.
    cmd = [*SCRIPTS["spawn"], "--data-path", str(data), "--output-dir", str(tmp_path / "run"), *FLAGS]
    code, output = signal_once_ready(cmd, script_env(), tmp_path / "log", lambda job: bool(spawned_by(job.pid)),
                                     signal.SIGTERM)
    assert code == 143, output[-3000:]
    assert output.count("Stopped by SIGTERM") == 1, output[-3000:]
    assert "before any checkpoint was written" in output or "nothing was trained" in output, output[-3000:]
