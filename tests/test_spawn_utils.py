"""The spawn script's own process management: how many processes, which port, what a failure does."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TINY_FLAGS
from multi_train_utils import spawn_utils
from multi_train_utils.cli import run_cli
from multi_train_utils.errors import UserInputError


@pytest.fixture
def no_preset_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on for the length of the test."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_world_size_defaults_to_two_on_a_cpu() -> None:
    assert spawn_utils.processes_to_start(None, "auto") == 2
    assert spawn_utils.processes_to_start(5, "cpu") == 5
    cores = os.cpu_count() if not hasattr(os, "sched_getaffinity") else len(os.sched_getaffinity(0))
    with pytest.raises(UserInputError, match=f"--world-size 10000: more processes than this machine's {cores} CPU"):
        spawn_utils.processes_to_start(10_000, "cpu")


def test_more_processes_than_gpus_is_a_clear_error() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="no CUDA GPU is visible"):
            spawn_utils.processes_to_start(2, "cuda")
        return
    gpus = torch.cuda.device_count()
    with pytest.raises(UserInputError, match=f"--world-size {gpus + 1}: only {gpus} GPU"):
        spawn_utils.processes_to_start(gpus + 1, "cuda")


def spawn_job(argv: list[str]) -> int:
    """The spawn script run here, through run_cli, as `python train_multi_gpu_using_spawn.py ARGV`: its exit code."""
    import train_multi_gpu_using_spawn

    with pytest.raises(SystemExit) as ended:
        run_cli(train_multi_gpu_using_spawn.main, "spawn", argv)
    return ended.value.code


def test_a_master_addr_that_is_not_this_machines_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                            no_preset_port: None) -> None:
    """The spawned processes all run on this machine, which cannot listen on another's address (TEST-NET-1's)."""
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")
    with pytest.raises(UserInputError, match=r"^MASTER_ADDR 192\.0\.2\.1: this machine cannot listen there"), \
            spawn_utils.meeting_on_a_free_port():
        pytest.fail("no port was chosen")


def test_a_dist_url_host_that_is_not_this_machines_is_one_line() -> None:
    """The same for --dist-url tcp://: rank 0 would never start where the others look for it."""
    with pytest.raises(UserInputError, match=r"^--dist-url tcp://192\.0\.2\.1:29500: this machine cannot listen "
                                             r"there \(.+\); the spawned processes all run here: give an address of "
                                             r"this machine, such as tcp://127\.0\.0\.1:29500$"), \
            spawn_utils.meeting_on_a_free_port("tcp://192.0.2.1:29500"):
        pytest.fail("the processes were let start")


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_ipv6_loopback_is_this_machines(monkeypatch: pytest.MonkeyPatch, no_preset_port: None) -> None:
    with spawn_utils.meeting_on_a_free_port("tcp://[::1]:29500"):
        pass
    monkeypatch.setenv("MASTER_ADDR", "::1")
    with spawn_utils.meeting_on_a_free_port():
        assert 0 < int(os.environ["MASTER_PORT"]) < 65536


@pytest.mark.slow
def test_a_port_taken_after_the_script_chose_it_is_one_line(monkeypatch: pytest.MonkeyPatch, no_preset_port: None,
                                                             taken_port: int, tmp_path: Path,
                                                             capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(spawn_utils, "find_free_port", lambda host: taken_port)
    assert spawn_job(["--world-size", "2", "--output-dir", str(tmp_path / "run"), *TINY_FLAGS]) == 2
    printed = capfd.readouterr()
    assert "distributed init" not in printed.out, "a process said it had joined a group that never formed"
    errors = printed.err.strip().splitlines()
    assert errors == [f"error: port {taken_port}, free when the spawn script chose it, was taken by another program "
                      "before the processes met there; start the job again"], errors


@pytest.mark.slow
def test_a_preset_master_port_is_used_and_not_replaced(monkeypatch: pytest.MonkeyPatch, no_preset_port: None,
                                                        taken_port: int, tmp_path: Path,
                                                        capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MASTER_PORT", str(taken_port))
    assert spawn_job(["--world-size", "2", "--output-dir", str(tmp_path / "run"), *TINY_FLAGS]) == 2
    errors = capfd.readouterr().err.strip().splitlines()
    assert errors == [f"error: MASTER_PORT {taken_port}: another program listens on that port; choose a "
                      "free one, or unset MASTER_PORT for the spawn script to pick one"], errors


class EndedProcess:
    """A process that has ended with `exitcode`, as stop_processes and exit_on_lost_process see it."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_user_error_on_any_rank_is_the_jobs_exit_code() -> None:
    """Rank 1 ends first (exit 1, its collective failed when rank 0 stopped); rank 0 had the user error."""
    lost = mp.ProcessExitedException("process 1 ended", error_index=1, error_pid=0, exit_code=1)
    with pytest.raises(SystemExit) as stop:
        spawn_utils.exit_on_lost_process(lost, [EndedProcess(2), EndedProcess(1)])
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        spawn_utils.exit_on_lost_process(lost, [EndedProcess(0), EndedProcess(1)])
    assert stop.value.code == 1


def sleep_in(holds_ctrl_c_back: bool) -> None:
    if holds_ctrl_c_back:  # as a spawned process does until cli.ends_in_one_line lets Ctrl-C in
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    time.sleep(60)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's signal mask in /proc")
def test_after_ctrl_c_the_clock_starts_once_every_process_can_stop() -> None:
    """A process still importing torch (it holds Ctrl-C back until it can stop cleanly) is not killed for being
    slow to start, however loaded the machine; once every process can stop, it has CTRL_C_GRACE_S * 2."""
    fork = mp.get_context("fork")
    starting, started = (fork.Process(target=sleep_in, args=(holds,), daemon=True) for holds in (True, False))
    starting.start()
    started.start()
    try:
        deadline = time.monotonic() + 30
        while not spawn_utils.holds_ctrl_c_back(starting):
            assert time.monotonic() < deadline, "the process never held Ctrl-C back"
            time.sleep(0.05)
        assert not spawn_utils.holds_ctrl_c_back(started)
        passer = spawn_utils.StopSignalPasser()
        long_ago = time.monotonic() - 10 * spawn_utils.CTRL_C_GRACE_S
        passer.received = [(long_ago, signal.SIGINT)]
        spawn_utils.hurry([starting, started], passer, stop_deadline_s=30.0)  # one still starting: no kill
        assert starting.is_alive() and started.is_alive() and passer.first()[0] > long_ago
        passer.received = [(long_ago, signal.SIGINT)]
        with pytest.raises(SystemExit) as ended:
            spawn_utils.hurry([started], passer, stop_deadline_s=30.0)  # every one can stop, and did not
        assert ended.value.code == 130 and not started.is_alive()
    finally:
        for process in (starting, started):
            process.kill()
            process.join()
