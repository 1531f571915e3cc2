"""Fixtures shared by the tests: small image folders and a way to run the scripts as a user would."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from multi_train_utils import errors
from multi_train_utils.checkpoint import Checkpointer
from multi_train_utils.cli import default_config
from multi_train_utils.config import RunConfig
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.optim import StepOptions, build_scheduler
from multi_train_utils.recorder import RunRecorder

REPO = Path(__file__).resolve().parent.parent
# Ctrl-C as at a terminal, in pytest and in every process it starts: a shell script that starts pytest in the
# background (`python -m pytest &`) leaves SIGINT ignored, and an ignored signal stays ignored across exec.
signal.signal(signal.SIGINT, signal.default_int_handler)
# The multi-process tests start several Python processes on 2 cores; keep every step tiny.
# What a copy of the repository leaves out: what git ignores, runs' outputs and the downloaded data.
LEFT_OUT = (".git", ".venv", "runs", "data", "output", "__pycache__", ".pytest_cache", ".ruff_cache", "build")
TINY_FLAGS = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--epochs", "1",
              "--workers", "0", "--device", "cpu", "--lr", "0.01"]


def write_image(path: Path, color: tuple[int, int, int], size: int = 24, mode: str = "RGB") -> Path:
    """A small image of one colour with a little noise, saved in whatever format the suffix says."""
    rng = np.random.default_rng(zlib.crc32(os.fsencode(path.name)))  # hash(): other images in every session
    pixels = np.clip(np.array(color) + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").convert(mode).save(path)
    return path


def make_image_folder(root: Path, per_class: dict[str, int], size: int = 24) -> Path:
    """Class folders of easily told-apart images: each class has its own colour."""
    palette = [(220, 40, 40), (40, 200, 60), (50, 60, 220), (230, 230, 40), (200, 60, 200)]
    for index, (name, count) in enumerate(per_class.items()):
        for i in range(count):
            colour = palette[index % len(palette)]
            write_image(root / name / f"{name}_{i:03d}.{'png' if i % 3 == 0 else 'jpg'}", colour, size)
    return root


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """Three classes of 10 images: 24 for training, 6 for validation."""
    return make_image_folder(tmp_path / "images", {"red": 10, "green": 10, "blue": 10})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a script under test: no inherited ranks, quiet warnings, bounded threads."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **extra)
    return env


def run(cmd: list[str], timeout: float = 180, cwd: Path | None = None, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess:
    """Run a command to completion, capturing its output. It runs in a session of its own, so that on a
    time-out the whole tree (launcher, workers, data-loader processes) is killed through its PID."""
    proc = subprocess.Popen(cmd, cwd=cwd or REPO, env=env or script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s\n{stdout}\n{stderr}") from None
    except BaseException:  # pytest-timeout, Ctrl-C: the command's processes end with the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_single_in_this_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`python train_single_gpu.py ARGV` run here, through the same run_cli: its exit code and what it wrote,
    without the seconds a new Python spends importing torch and torchvision (for runs that end early)."""
    import train_single_gpu
    from multi_train_utils.cli import run_cli

    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            run_cli(train_single_gpu.main, "single", argv)
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else 1
        finally:
            errors._Ending.under_way = False  # a process ends once; a test may end several runs here
    return subprocess.CompletedProcess(["train_single_gpu.py", *argv], code, stdout.getvalue(), stderr.getvalue())


def copy_of_the_repository(folder: Path) -> Path:
    """A copy of the repository's own files in `folder`, to change as a user would (tests/test_change_it.py,
    tests/test_hangs.py)."""
    shutil.copytree(REPO, folder, ignore=shutil.ignore_patterns(*LEFT_OUT))
    return folder


def python() -> str:
    return sys.executable


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(autouse=True)
def ends_of_runs_are_undone() -> Iterator[None]:
    """Tests that run the scripts in this process (run_cli, end_run) change what a process changes once, at its
    end: the signal handlers, and that its end is under way. Each test starts from pytest's own."""
    handlers = {signum: signal.getsignal(signum) for signum in errors.STOP_SIGNALS}
    unraisablehook = sys.unraisablehook
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.unraisablehook = unraisablehook
    errors._Ending.under_way = errors._Ending.store_gone = False
    errors._Ending.launcher = None
    errors.hold_back_ctrl_c(False)


def config_in(folder: Path, **changes: object) -> RunConfig:
    """A fresh run's configuration with default flags, writing into `folder`, with `changes`."""
    return default_config(output_dir=str(folder), **changes)


@contextlib.contextmanager
def checkpointer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                 options: StepOptions | None = None, batches: int = 4,
                 loader: torch.utils.data.DataLoader | None = None, **changes: object) -> Iterator[Checkpointer]:
    """A Checkpointer writing into `folder`, as fit makes one: with a recorder (rank 0 of one process), a
    cosine schedule over 2 epochs, and `loader` or a loader of `batches` batches of 2."""
    split = {"class_names": ["a", "b", "c"], "train": [], "val": []}
    loader = loader or torch.utils.data.DataLoader(range(2 * batches), batch_size=2)
    batches = len(loader)
    scheduler = build_scheduler(optimizer, epochs=2, steps_per_epoch=batches)
    with RunRecorder(config_in(folder, model="small", **changes), single_process("cpu"), split) as recorder:
        yield Checkpointer(model, optimizer, scheduler, options or StepOptions(), recorder, loader)


def spawned_by(pid: int) -> list[int]:
    """The processes that torch.multiprocessing started from `pid`, its resource tracker among them."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if parent == pid and "multiprocessing" in command:
                found.append(int(entry.name))
    return found


def signal_once_ready(cmd: list[str], env: dict[str, str], log_path: Path,
                      ready: Callable[[subprocess.Popen], bool], signum: int, settle_s: float = 0.0,
                      ready_within_s: float = 60.0) -> tuple[int, str]:
    """Start `cmd` in a session of its own, send it `signum` once `ready(job)` holds (and `settle_s` later),
    wait for it to end; return its exit code and its output. Killed through its PID if it overstays."""
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_within_s
        while not ready(job):
            assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(settle_s)
        job.send_signal(signum)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, log_path.read_text()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
