"""Every way to start training, run for real with several processes on 127.0.0.1 (gloo on the CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, python, run, script_env, torchrun

pytestmark = pytest.mark.slow
LAUNCH = str(REPO / "train_multi_gpu_using_launch.py")
SPAWN = str(REPO / "train_multi_gpu_using_spawn.py")
SINGLE = str(REPO / "train_single_gpu.py")
VAL_IMAGES = 7  # an odd count: 2 processes cannot split it evenly


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 10 + 10 + 15 images: 2 + 2 + 3 of them for validation.
    return make_image_folder(tmp_path_factory.mktemp("odd") / "images", {"a": 10, "b": 10, "c": 15})


def flags(data: Path, out: Path) -> list[str]:
    return ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS]


def finished(result: subprocess.CompletedProcess, out: Path, world_size: int) -> list[dict]:
    """Assert that the run ended well and wrote one epoch of metrics for `world_size` processes."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [0]
    assert metrics[0]["world_size"] == world_size
    assert metrics[0]["val_total"] == VAL_IMAGES
    assert (out / "weights" / "model-0.pth").is_file()
    # the collectives were recorded (flight_recorder.py), but a record is written only once one has failed
    assert not (out / "flight-recorder").exists()
    return metrics


def test_plain_python_runs_the_launch_script_as_one_process(odd_folder: Path, tmp_path: Path) -> None:
    finished(run([python(), LAUNCH, *flags(odd_folder, tmp_path)]), tmp_path, world_size=1)


def test_torchrun_two_processes(odd_folder: Path, tmp_path: Path) -> None:
    # --check-collectives: PyTorch checks that the ranks call the same collectives, on ranks whose shares of the
    # validation images differ; with gloo it made DDP's constructor crash (versions.ddp_constructible_under_checks)
    cmd = [*torchrun(), "--standalone", "--nproc_per_node=2", LAUNCH, *flags(odd_folder, tmp_path), "--syncBN",
           "--check-collectives"]
    result = run(cmd)
    finished(result, tmp_path, world_size=2)
    assert result.stdout.count("[epoch 0] train_loss") == 1, "only rank 0 reports"
    assert "lr 0.01 x 2 process(es) x 1 accumulated batch(es) = 0.02" in result.stdout
    assert result.stdout.count("--syncBN: switched off: PyTorch's SyncBatchNorm runs on CUDA GPUs only") == 1
    assert result.stdout.count("| distributed init") == 2 and "cpu| distributed" not in result.stdout, "one line each"


@pytest.mark.every_launcher  # torchrun's own runs in the README command
def test_legacy_launcher_without_use_env(odd_folder: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [python(), "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={port}",
           LAUNCH, *flags(odd_folder, tmp_path)]
    finished(run(cmd), tmp_path, world_size=2)


def test_spawn_two_processes_with_the_speed_flags(odd_folder: Path, tmp_path: Path) -> None:
    speed = ["--amp", "bf16", "--channels-last", "--accum-steps", "2", "--comm-hook", "bf16", "--bucket-cap-mb", "5",
             "--lr", "0.005", "--image-size", "32"]  # bf16: 0.01 x 4 batches is a step too far; on 16 px the
    # last stages see 1 x 1 maps, where PyTorch's bf16 backward on the CPU turns a gradient NaN on some draws
    result = run([python(), SPAWN, "--world-size", "2", *flags(odd_folder, tmp_path), *speed])
    finished(result, tmp_path, world_size=2)
    assert "(spawn, gloo): rank 1/2" in result.stdout
    assert "lr 0.005 x 2 process(es) x 2 accumulated batch(es) = 0.02" in result.stdout


# The README command's failing rank is test_failures.py's (a NaN on one rank, a rank killed outright, under spawn).
@pytest.mark.parametrize("launcher", [pytest.param(launcher, marks=pytest.mark.every_launcher)
                                      for launcher in ("torchrun", "spawn")])
def test_a_failing_rank_ends_the_whole_job(odd_folder: Path, tmp_path: Path, launcher: str) -> None:
    env = script_env(FAIL_RANK="1", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    cmd = ([*torchrun(), "--standalone", "--nproc_per_node=2", LAUNCH] if launcher == "torchrun"
           else [python(), SPAWN, "--world-size", "2"])
    result = run([*cmd, *flags(odd_folder, tmp_path)], timeout=120, env=env)
    ended = time.time()
    assert result.returncode != 0
    failed = re.search(r"failure injected on rank 1 at (\d+\.\d+)", result.stdout + result.stderr)
    assert failed, result.stderr[-3000:]
    # From the failure, not from the start: how long processes take to start depends on the machine's load.
    assert ended - float(failed[1]) < 30, f"took {ended - float(failed[1]):.0f} s to notice"
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.schedulers  # two jobs a scheduler placed on one machine
def test_two_spawn_jobs_at_once_both_finish(odd_folder: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "first", tmp_path / "second"]
    jobs = [subprocess.Popen([python(), SPAWN, "--world-size", "2", *flags(odd_folder, out)], cwd=REPO,
                             env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for out in outs]
    outputs = [job.communicate(timeout=240)[0] for job in jobs]
    for job, output, out in zip(jobs, outputs, outs, strict=True):
        finished(subprocess.CompletedProcess([], job.returncode, output, ""), out, world_size=2)


def test_same_validation_count_as_one_process(odd_folder: Path, tmp_path: Path) -> None:
    finished(run([python(), SINGLE, *flags(odd_folder, tmp_path)]), tmp_path, world_size=1)
