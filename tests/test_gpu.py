"""Checks that need CUDA GPUs (NCCL, SyncBatchNorm); each skips itself where there are too few.

bench/gpu_check.py runs them on a GPU machine, with the demo run and the benchmark: those with "compile" in
their names in a part of their own, last, and test_the_benchmark_on_one_gpu not at all (its benchmark part
measures the same).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ddp_workers
import pytest
import torch
import torch.multiprocessing as mp

from conftest import REPO, free_port, make_image_folder, python, run, script_env, torchrun
from multi_train_utils.distributed_utils import single_process

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_FLAGS = ["--model", "resnet18", "--image-size", "32", "--batch-size", "4", "--epochs", "1", "--device", "cuda"]
# One training run that compiles: about a minute on a 16-core GPU machine with a cold cache. A test of two
# such runs stays within gpu_check's limit for its compile part.
COMPILE_RUN_TIMEOUT_S = 150
COMPILE_TIMEOUT_S = 2 * COMPILE_RUN_TIMEOUT_S + 30


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_with_syncbn_equal_one_gpu_with_the_whole_batch(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    batch, samples = 4, 32
    cases = {"syncbn": ddp_workers.Case(batch_size=batch, sync_bn=True)}
    mp.spawn(ddp_workers.equal_weights_worker, args=(2, samples, str(tmp_path), cases, "cuda"), nprocs=2)
    rank0 = torch.load(tmp_path / "rank0_syncbn.pth", weights_only=True)["weights"]
    # One GPU with plain BatchNorm over the whole batch is what SyncBatchNorm over two halves reproduces.
    ctx = single_process("cuda")
    ddp_workers.exact_gpu_math()
    single, _ = ddp_workers.train_fixed_order(ctx, 2 * batch, samples, sync_bn=True)
    for name, weight in single.state_dict().items():
        assert torch.allclose(rank0[name], weight.cpu(), atol=1e-5, rtol=1e-4), name


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_torchrun_trains_through_an_nccl_process_group(tmp_path: Path) -> None:
    """On one GPU too: torchrun with one process still forms an NCCL group and runs DDP, evaluation and the
    checkpoint through it. NCCL_DEBUG=VERSION makes NCCL itself print its version when a group starts."""
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    nproc = min(GPUS, 2)
    result = run([*torchrun(), "--standalone", f"--nproc_per_node={nproc}",
                  str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data),
                  "--output-dir", str(tmp_path / "out"), *GPU_FLAGS, "--syncBN", "True"],
                 env=script_env(NCCL_DEBUG="VERSION"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NCCL version" in result.stdout + result.stderr, "no NCCL communicator was created"
    assert f"(torchrun, nccl): rank 0/{nproc}" in result.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["world_size"] == nproc and metrics["val_total"] == 6
    # Saved as CPU tensors: loads without map_location on a machine without a GPU.
    weights = torch.load(tmp_path / "out" / "weights" / "model-0.pth", weights_only=True)
    assert {tensor.device.type for tensor in weights.values()} == {"cpu"}


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_more_processes_than_gpus_is_one_line_before_nccl_starts(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    result = run([*torchrun(), "--standalone", f"--nproc_per_node={GPUS + 1}",
                  str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data),
                  "--output-dir", str(tmp_path / "out"), *GPU_FLAGS], env=script_env(NCCL_DEBUG="VERSION"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors and all(f"--nproc_per_node {GPUS + 1}: " in line for line in errors), result.stderr[-3000:]
    assert "NCCL version" not in result.stdout + result.stderr, "stopped before any NCCL communicator"


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_a_rank_failing_alone_on_nccl_ends_the_job_within_seconds(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 waits in an all-reduce: aborting (not destroying) NCCL's group lets
    rank 1 exit at once, so torchrun stops rank 0 instead of both waiting out --dist-timeout."""
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    env = script_env(FAIL_RANK="1", FAIL_EPOCH="1", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    started = time.monotonic()
    result = run([*torchrun(), "--standalone", "--nproc_per_node=2", str(REPO / "train_multi_gpu_using_launch.py"),
                  "--data-path", str(data), "--output-dir", str(tmp_path / "out"), *GPU_FLAGS, "--epochs", "3",
                  "--dist-timeout", "300"], env=env, timeout=200)
    assert result.returncode != 0
    assert time.monotonic() - started < 120, "a rank waited for the failed one"
    assert torch.load(tmp_path / "out" / "checkpoint.pth", weights_only=True)["epoch"] == 0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_single_gpu_run(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    result = run([python(), str(REPO / "train_single_gpu.py"), "--data-path", str(data),
                  "--output-dir", str(tmp_path / "out"), *GPU_FLAGS])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on cuda:0" in result.stdout


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_a_cpu_checkpoint_resumes_on_the_gpu_with_fp16_and_channels_last(tmp_path: Path) -> None:
    """The CPU run saves a non-fused optimizer with NCHW momentum; the fused fp16 step refuses both unless
    the resume fits them to this run."""
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    out = tmp_path / "out"
    common = [python(), str(REPO / "train_single_gpu.py"), "--data-path", str(data), "--output-dir", str(out),
              *GPU_FLAGS]
    assert run([*common, "--device", "cpu"]).returncode == 0
    result = run([*common, "--epochs", "2", "--resume", "auto", "--amp", "fp16", "--channels-last"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 1


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
def test_fp16_channels_last_compiled_run_keeps_its_loss_scale_across_a_resume(tmp_path: Path) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    out = tmp_path / "out"

    def train(epochs: str) -> None:
        result = run([python(), str(REPO / "train_single_gpu.py"), "--data-path", str(data), "--output-dir", str(out),
                      *GPU_FLAGS, "--amp", "fp16", "--channels-last", "--compile", "--epochs", epochs,
                      "--resume", "auto"], timeout=COMPILE_RUN_TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]

    train("1")
    # A scale the run could not reach by itself in a few steps (it starts at 65536 and grows every 2000).
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    saved["scaler"]["scale"] = 1024.0
    torch.save(saved, out / "checkpoint.pth")
    train("2")
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 1 and saved["scaler"]["scale"] <= 1024.0, "the resumed run went on from 1024"
    assert not any(key.startswith(("_orig_mod.", "module.")) for key in saved["model"])


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(COMPILE_TIMEOUT_S)
def test_torchrun_on_nccl_with_every_speed_option_compiled(tmp_path: Path) -> None:
    """fp16 with its scaler, under DDP's no_sync accumulation and a compressing hook, on NCCL."""
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    result = run([*torchrun(), "--standalone", "--nproc_per_node=2", str(REPO / "train_multi_gpu_using_launch.py"),
                  "--data-path", str(data), "--output-dir", str(tmp_path / "out"), *GPU_FLAGS, "--amp", "fp16",
                  "--channels-last", "--compile", "--accum-steps", "2", "--comm-hook", "bf16"],
                 timeout=COMPILE_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["val_total"] == 6


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_the_benchmark_on_one_gpu(tmp_path: Path) -> None:
    result = run([python(), str(REPO / "bench" / "benchmark.py"), "--device", "cuda", "--nproc", "1",
                  "--model", "resnet18", "--image-size", "32", "--batch-size", "4", "--steps", "2",
                  "--warmup-steps", "1", "--amp", "bf16", "--channels-last", "--skip-launch",
                  "--output", str(tmp_path / "gpu.json")], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["single_images_per_s"] > 0 and figures["ddp_images_per_s"] is None
    assert 0 < figures["peak_memory_mb"]["single"] < 100_000, "CUDA memory of the process, in MB"


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_sigterm_on_nccl_stops_every_rank_at_one_step_and_the_run_resumes_from_it(tmp_path: Path) -> None:
    """On NCCL the ranks vote in a gloo group of their own (no GPU waits for it): torchrun's SIGTERM must
    still stop them at one step, with its checkpoint, and the resume must finish the run from there."""
    data = make_image_folder(tmp_path / "images", {"a": 12, "b": 12, "c": 12})
    nproc = min(GPUS, 2)
    cmd = [*torchrun(), "--standalone", f"--nproc_per_node={nproc}", str(REPO / "train_multi_gpu_using_launch.py"),
           "--data-path", str(data), "--output-dir", str(tmp_path / "out"), *GPU_FLAGS, "--epochs", "2",
           "--batch-size", "2", "--workers", "1"]
    env = script_env(SIGNAL_RANK=str(nproc - 1), SIGNAL_EPOCH="1", SIGNAL_STEP="1", SIGNAL_NAME="TERM",
                     SIGNAL_TO="launcher", SIGNAL_ONCE_FILE=str(tmp_path / "signalled"),
                     PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    stopped = run(cmd, env=env)
    assert "Stopped by SIGTERM at epoch 1, step" in stopped.stderr, stopped.stderr[-3000:]
    progress = torch.load(tmp_path / "out" / "checkpoint.pth", weights_only=True)["progress"]
    assert progress["epoch"] == 1 and progress["step"] >= 2
    resumed = run([*cmd, "--resume", "auto"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch 1, step {progress['step']}" in resumed.stdout
    assert [json.loads(line)["epoch"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [
        0, 1]
