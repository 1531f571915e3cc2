"""Ctrl-C and SIGTERM end every process of a run, quickly, and keep what was written."""

from __future__ import annotations

import ast
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

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, python, script_env, spawned_by, torchrun

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
    running = []
    for pid in pids:
        if pid in table and table[pid][1] != "Z":
            with contextlib.suppress(OSError):  # it may end between the two reads
                running.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:100])
    return running


def stacks_of_a_hang(tree: set[int], log: Path) -> str:
    """The log's end after every process of `tree` wrote its threads' Python stacks (faulthandler, on SIGABRT):
    where a run that should have moved on waits."""
    for pid in sorted(tree, reverse=True):  # one at a time, so that their pages do not interleave
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(0.5)
    return log.read_text()[-20000:]


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
    ("single", "ctrl-c"), pytest.param("spawn", "ctrl-c", marks=pytest.mark.every_launcher),
    pytest.param("torchrun", "ctrl-c", marks=pytest.mark.every_launcher),
    # The agent passes SIGTERM to the workers' whole process groups, their loader workers too; every rank
    # stops at one step and saves it (test_preemption.py resumes from such checkpoints on every launcher).
    pytest.param("torchrun", "sigterm", marks=pytest.mark.every_launcher),
    # torchrun's agent killed outright (or by SIGUSR1, which it does not handle) cannot stop its workers: they
    # must notice by themselves, and not ask the store that went with it.
    pytest.param("torchrun", "sigkill", marks=pytest.mark.every_launcher),
    pytest.param("torchrun", "sigusr1", marks=pytest.mark.every_launcher),
    # A closed terminal or ssh session: a stop like SIGTERM, one step finished and saved (torchrun passes it on).
    pytest.param("spawn", "sighup", marks=pytest.mark.every_launcher),
        pytest.param("torchrun", "sighup", marks=pytest.mark.every_launcher)])
def test_stopping_a_run_ends_every_process(tmp_path: Path, launcher: str, stop: str) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    out, port = tmp_path / "run", free_port()
    flags = ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS, "--epochs", "500", "--workers", "1"]
    cmd = {"single": [python(), str(REPO / "train_single_gpu.py")],
           "torchrun": [*torchrun(), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                        str(REPO / "train_multi_gpu_using_launch.py")],
           "spawn": [python(), str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2"]}[launcher]
    with open(tmp_path / "log", "w") as log:
        run = subprocess.Popen([*cmd, *flags], cwd=REPO, env=script_env(MASTER_PORT=str(port), PYTHONFAULTHANDLER="1"),
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint.pth").exists():
            assert run.poll() is None, (tmp_path / "log").read_text()[-3000:]
            if time.monotonic() > deadline:
                pytest.fail("no epoch finished in time:\n" + stacks_of_a_hang(process_tree(run.pid), tmp_path / "log"))
            time.sleep(0.2)
        time.sleep(0.5)  # now in the middle of a later epoch
        tree = process_tree(run.pid)
        # launcher and its data-loader worker; or launcher, 2 ranks and their 2 data-loader workers
        assert len(still_running(tree)) >= (2 if launcher == "single" else 5), still_running(tree)
        started = time.monotonic()
        if stop == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # what the terminal sends to the whole foreground group
        else:  # what a scheduler sends, to the launcher alone; or the out-of-memory killer
            os.kill(run.pid, getattr(signal, stop.upper()))
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
    if stop == "ctrl-c" and launcher != "torchrun":  # torchrun's agent exits with a code of its own
        assert run.returncode == 130, output[-3000:]
    # A stop is one line, not every process's traceback. (torchrun prints a traceback of its own agent.)
    our_frames = [line for line in output.splitlines()
                  if line.startswith('  File "') and str(REPO) in line and "site-packages" not in line]
    assert our_frames == [] and ("Traceback" not in output or launcher == "torchrun"), output[-3000:]
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to end"
    assert left == [], f"still running: {left}"
    assert not re.search(r"TCPStore|sendBytes|recvValue", output), "no page of C++ frames from a store that is gone"
    said = [line for line in output.split("\n") if "Stopped by" in line]
    assert len(said) == 1 and said[0].startswith("Stopped by "), f"one line of ours on a line of its own: {said}\n" + (
        output[-3000:])

    assert port_is_free(port) or launcher == "single"
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] >= 0
    assert not list(out.glob(".*.partial"))
    if stop in ("sigterm", "sighup"):  # the step (or the epoch, if it came during validation) where every rank stopped
        assert re.search(rf"Stopped by {stop.upper()} (at epoch \d+, step \d+|after epoch \d+); its checkpoint is ",
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


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("signals") / "images", {"a": 10, "b": 10, "c": 10})


def logged(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# Moments of a spawn run, from its start to its first epoch, by what the run has shown.
MOMENTS = {
    "processes starting": lambda job, out, log: bool(spawned_by(job.pid)),
    "processes joining": lambda job, out, log: "distributed init" in logged(log),
}  # in training: test_stopping_a_run_ends_every_process


# The spawn script's processes at each moment, in CI's every_launcher group: the README command's Ctrl-C while the
# processes meet is test_failures.py's, under the launch script.
@pytest.mark.every_launcher
@pytest.mark.parametrize("moment", MOMENTS)
def test_ctrl_c_is_never_lost_whenever_it_comes(small_data: Path, tmp_path: Path, moment: str) -> None:
    """Ctrl-C reaches the spawn script, its processes and their loader workers at once: at any moment of the
    start-up or of training, the job ends with 130, says so once, and leaves no process; nothing trains on."""
    out, log = tmp_path / "run", tmp_path / "log"
    cmd = [python(), str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2", "--data-path",
           str(small_data), "--output-dir", str(out), *TINY_FLAGS, "--epochs", "40", "--workers", "1"]
    with open(log, "w") as sink:
        job = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not MOMENTS[moment](job, out, log):
            assert job.poll() is None and time.monotonic() < deadline, logged(log)[-3000:]
            time.sleep(0.02)
        tree = process_tree(job.pid)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=40)
        while still_running(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = still_running(tree)
    finally:
        for pid in process_tree(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = logged(log)
    assert job.returncode == 130, output[-3000:]
    assert len(re.findall(r"^Stopped by Ctrl-C", output, re.MULTILINE)) == 1, output[-3000:]
    assert left == [], f"still running: {left}"
    trained = (out / "metrics.jsonl").read_text().count("\n") if (out / "metrics.jsonl").exists() else 0
    assert trained < 40, "the run trained on"
    assert "Traceback" not in output, output[-3000:]  # the children are still importing torch at the first


@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_multi_gpu_using_launch.py",
                                    "train_multi_gpu_using_spawn.py"])
def test_ctrl_c_is_caught_by_each_scripts_first_statement_which_imports_nothing_slow(script: str) -> None:
    """What no timing can test: Ctrl-C is caught from the scripts' first statement, whose import loads the
    standard library alone (torch's takes seconds)."""
    module = ast.parse((REPO / script).read_text())
    first, second = [node for node in module.body if not isinstance(node, ast.Expr) or
                     not isinstance(node.value, ast.Constant)][:2]
    assert ast.unparse(first) == "from multi_train_utils.errors import quiet_ctrl_c_while_starting"
    assert ast.unparse(second) == "quiet_ctrl_c_while_starting()"
    loaded = subprocess.run([python(), "-c", "import sys, multi_train_utils.errors; print(sorted(sys.modules))"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "'torch'" not in loaded.stdout and "'numpy'" not in loaded.stdout, loaded.stdout + loaded.stderr


def importing_torch(pid: int) -> bool:
    """Whether process `pid` has begun to import torch (its first shared library is mapped): the script's own
    first line, which catches Ctrl-C, has run by then, however slowly the machine started Python."""
    with contextlib.suppress(OSError):
        return f"{os.sep}torch{os.sep}lib{os.sep}" in Path(f"/proc/{pid}/maps").read_text()
    return False


@pytest.mark.parametrize("after_s", [0.0, 0.5, 2.0])
def test_ctrl_c_in_the_first_seconds_of_one_process_is_one_line(small_data: Path, tmp_path: Path,
                                                                 after_s: float) -> None:
    """While Python imports torch, and after: the scripts catch Ctrl-C from their first line (before it, while
    Python itself starts, nothing of ours runs yet; test_core.py checks that the line comes before anything slow).
    The Ctrl-C comes `after_s` after torch's import began."""
    cmd = [python(), str(REPO / "train_single_gpu.py"), "--data-path", str(small_data), "--output-dir",
           str(tmp_path / "run"), *TINY_FLAGS, "--epochs", "40"]
    job = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not importing_torch(job.pid) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(after_s)
        os.killpg(job.pid, signal.SIGINT)
        output, _ = job.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, output[-3000:]
    assert "Traceback" not in output and output.count("Stopped by Ctrl-C") == 1, output[-3000:]


def test_a_stop_signalled_again_and_again_ends_once_and_quietly(small_data: Path, tmp_path: Path) -> None:
    """Schedulers and impatient people signal twice: the later signals change nothing, and say nothing."""
    out, log = tmp_path / "run", tmp_path / "log"
    cmd = [python(), str(REPO / "train_single_gpu.py"), "--data-path", str(small_data), "--output-dir", str(out),
           *TINY_FLAGS, "--epochs", "40"]
    with open(log, "w") as sink:
        job = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pth").exists():
            assert job.poll() is None and time.monotonic() < deadline, logged(log)[-3000:]
            time.sleep(0.02)
        for _ in range(12):
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGTERM)
            time.sleep(0.15)
        job.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    output = logged(log)
    assert job.returncode == 143, output[-3000:]
    assert len(re.findall(r"^Stopped by SIGTERM", output, re.MULTILINE)) == 1, output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]


DROPPED_IN_A_FINALIZER = """
import signal, time
from multi_train_utils.errors import Terminated
from multi_train_utils.errors import listen_for_stop_signals

class Progress:  # like tqdm's bar, whose generator the garbage collector closes
    def __del__(self):
        signal.raise_signal(signal.{name})  # the signal lands while Python runs the finalizer

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, even where pytest started without
listen_for_stop_signals()
try:
    Progress()
    time.sleep(10)
    print("went on training")
except {caught} as stop:
    print("stopped by", type(stop).__name__)
"""


@pytest.mark.parametrize(("name", "caught"), [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_stop_that_lands_in_a_finalizer_is_not_dropped(name: str, caught: str) -> None:
    """Python drops an exception raised inside a finalizer, with an "Exception ignored" page; the stop of a
    signal that arrives there is raised again outside it (it was lost once torchrun's agent was killed)."""
    result = subprocess.run([python(), "-c", DROPPED_IN_A_FINALIZER.format(name=name, caught=caught)], cwd=REPO,
                            env=script_env(), capture_output=True, text=True, timeout=60)
    assert (result.stdout, result.stderr) == (f"stopped by {caught}\n", "")
