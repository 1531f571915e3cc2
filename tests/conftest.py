"""Fixtures shared by the tests: small image folders and a way to run the scripts as a user would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
# The multi-process tests start several Python processes on 2 cores; keep every step tiny.
TINY_FLAGS = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--epochs", "1",
              "--workers", "0", "--device", "cpu", "--lr", "0.01"]


def write_image(path: Path, color: tuple[int, int, int], size: int = 24, mode: str = "RGB") -> Path:
    """A small image of one colour with a little noise, saved in whatever format the suffix says."""
    rng = np.random.default_rng(abs(hash(path.name)) % 2**32)
    pixels = np.clip(np.array(color) + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").convert(mode).save(path)
    return path


def make_image_folder(root: Path, per_class: dict[str, int], size: int = 24) -> Path:
    """Class folders of easily told-apart images: each class has its own colour."""
    palette = [(220, 40, 40), (40, 200, 60), (50, 60, 220), (230, 230, 40), (200, 60, 200)]
    for index, (name, count) in enumerate(per_class.items()):
        for i in range(count):
            write_image(root / name / f"{name}_{i:03d}.{'png' if i % 3 == 0 else 'jpg'}", palette[index], size)
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
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def python() -> str:
    return sys.executable


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
