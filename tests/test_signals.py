"""Ctrl-C and SIGTERM end every process of a run, quickly, and keep what was written."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, python, script_env, torchrun

pytestmark = pytest.mark.slow


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process (a zombie, state Z, holds nothing but its PID)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def process_tree(root: int) -> set[int]:
    """`root` and all its descendants: the launcher, the training processes, their data-loader workers."""
    table = process_table()
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, (parent, _) in table.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def still_running(pids: set[int]) -> list[str]:
    table = process_table()
    return [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:100]
            for pid in pids if pid in table and table[pid][1] != "Z"]


def port_is_free(port: int) -> bool:
    """Whether the next job can meet on `port`: a new store can listen there (connections of the old
    one may linger in TIME_WAIT, which the store, like every server, is allowed to listen over)."""
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5))
    except RuntimeError:
        return False
    del store
    return True


@pytest.mark.parametrize(("launcher", "stop"), [
    *((launcher, "ctrl-c") for launcher in ("single", "torchrun", "spawn")),
    # The agent passes SIGTERM to the workers' whole process groups, their loader workers too; every rank
    # stops at one step and saves it (test_preemption.py resumes from such checkpoints on every launcher).
    ("torchrun", "sigterm"),
    # torchrun's agent killed outright cannot stop its workers: they must notice by themselves.
    ("torchrun", "sigkill")])
def test_stopping_a_run_ends_every_process(tmp_path: Path, launcher: str, stop: str) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    out, port = tmp_path / "run", free_port()
    flags = ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS, "--epochs", "500", "--workers", "1"]
    cmd = {"single": [python(), str(REPO / "train_single_gpu.py")],
           "torchrun": [*torchrun(), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                        str(REPO / "train_multi_gpu_using_launch.py")],
           "spawn": [python(), str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2"]}[launcher]
    with open(tmp_path / "log", "w") as log:
        run = subprocess.Popen([*cmd, *flags], cwd=REPO, env=script_env(MASTER_PORT=str(port)), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pth").exists():
            assert run.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no epoch finished in time"
            time.sleep(0.2)
        time.sleep(0.5)  # now in the middle of a later epoch
        tree = process_tree(run.pid)
        # launcher and its data-loader worker; or launcher, 2 ranks and their 2 data-loader workers
        assert len(still_running(tree)) >= (2 if launcher == "single" else 5), still_running(tree)
        started = time.monotonic()
        if stop == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # what the terminal sends to the whole foreground group
        else:  # what a scheduler sends, to the launcher alone; or the out-of-memory killer
            os.kill(run.pid, signal.SIGTERM if stop == "sigterm" else signal.SIGKILL)
        run.wait(timeout=30)
        elapsed = time.monotonic() - started
        while still_running(tree) and time.monotonic() - started < 15:
            time.sleep(0.2)
        left = still_running(tree)
    finally:
        for pid in process_tree(run.pid) | (tree if "tree" in locals() else set()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = (tmp_path / "log").read_text()
    assert run.returncode != 0, output[-3000:]
    # A stop is one line, not every process's traceback. (torchrun prints a traceback of its own agent.)
    our_frames = [line for line in output.splitlines()
                  if line.startswith('  File "') and str(REPO) in line and "site-packages" not in line]
    assert our_frames == [] and ("Traceback" not in output or launcher == "torchrun"), output[-3000:]
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to end"
    assert left == [], f"still running: {left}"
    assert port_is_free(port) or launcher == "single"
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] >= 0
    assert not list(out.glob(".*.partial"))
    if stop == "sigterm":  # the step (or the epoch, if it came during validation) where every rank stopped
        assert re.search(r"Stopped by SIGTERM (at epoch \d+, step \d+|after epoch \d+); its checkpoint is ",
                         output, re.MULTILINE), output[-3000:]


class SlowDataset(torch.utils.data.Dataset):
    """Each item takes a while, as a large JPEG does: Ctrl-C finds the worker in the middle of one."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        Path(os.environ["WORKER_PID_FILE"]).write_text(str(os.getpid()))
        time.sleep(1.5)
        return index


def test_ctrl_c_in_a_loader_worker_is_left_to_the_training_process(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C reaches the loader workers too; one busy with an item would raise KeyboardInterrupt, which the
    loader re-raises in the training process with the worker's traceback, once per worker."""
    from multi_train_utils.data import leave_signals_to_the_trainer, loader_start_method

    monkeypatch.setenv("WORKER_PID_FILE", str(tmp_path / "worker"))
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=1, num_workers=1,
                                         worker_init_fn=leave_signals_to_the_trainer,
                                         multiprocessing_context=loader_start_method(1))
    batches = iter(loader)
    deadline = time.monotonic() + 10
    while not (tmp_path / "worker").exists():
        assert time.monotonic() < deadline, "the worker never started an item"
        time.sleep(0.05)
    os.kill(int((tmp_path / "worker").read_text()), signal.SIGINT)  # while it sleeps inside the item
    assert next(batches).tolist() == [0]
