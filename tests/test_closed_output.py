"""An output that is closed from the start (`1>&-`, a service) or whose reader goes away (`| head -1`, a closed
terminal) costs the run nothing: it trains to its end, and says nothing more there."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_FLAGS, make_image_folder, python, script_env
from multi_train_utils.errors import OutputThatMayClose

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def finished(proc: subprocess.Popen, stderr_path: Path) -> str:
    """`proc`'s stderr once it ended by itself within TIMEOUT_S (killed with its whole session otherwise)."""
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"ran past {TIMEOUT_S} s:\n{stderr_path.read_text()[-3000:]}")
    return stderr_path.read_text()


def assert_trained_to_the_end(proc: subprocess.Popen, out: Path, stderr: str) -> None:
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and not any(word in stderr for word in ("TCPStore", "recvValue", "sendBytes")), (
        stderr[-3000:])
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


# the spawn script's case (which once printed the C++ store's page) runs in CI's every_launcher group
SCRIPTS = ["train_single_gpu.py", pytest.param("train_multi_gpu_using_spawn.py", marks=pytest.mark.every_launcher)]


def one_epoch(script: str, tmp_path: Path) -> tuple[list[str], Path]:
    """The command of a run of one epoch on a small folder (its validation writes a progress bar, and its end a
    summary, long after the output closed), and its output folder."""
    data, out = make_image_folder(tmp_path / "images", {"a": 6, "b": 6}), tmp_path / "run"
    return [python(), str(REPO / script), "--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
            *(["--world-size", "2"] if "spawn" in script else [])], out


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_with_stdout_closed_trains_to_its_end(tmp_path: Path, script: str) -> None:
    cmd, out = one_epoch(script, tmp_path)
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(["bash", "-c", 'exec "$@" 1>&-', "bash", *cmd], cwd=REPO, env=script_env(),
                                stderr=stderr, start_new_session=True)
    assert_trained_to_the_end(proc, out, finished(proc, tmp_path / "stderr"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_whose_reader_goes_away_trains_to_its_end_and_says_nothing_more(tmp_path: Path, script: str) -> None:
    cmd, out = one_epoch(script, tmp_path)
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=stderr,
                                start_new_session=True)
    assert proc.stdout.readline()  # what `| head -1` reads, before it goes away
    proc.stdout.close()
    assert_trained_to_the_end(proc, out, finished(proc, tmp_path / "stderr"))


def test_writes_after_the_reader_went_away_go_nowhere() -> None:
    reader, writer = os.pipe()
    stream = OutputThatMayClose(open(writer, "w", buffering=1))  # noqa: SIM115 (closed below)
    stream.write("read\n")
    assert os.read(reader, 100) == b"read\n"
    os.close(reader)
    stream.write("a line nobody reads\n")
    stream.flush()
    stream.write("and another\n")
    assert os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
    stream.close()
