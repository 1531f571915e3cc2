"""Elastic torchrun, for real: docs/clusters.md's elastic command, each machine one real torchrun agent on
127.0.0.1, meeting at a c10d rendezvous as machines of a cluster do (tests/test_two_hosts.py runs the page's
fixed two-machine command across two hosts).

The elastic test starts a run on one agent, lets a second one join in the middle of the epoch and then
stops that one with SIGTERM, and checks what the page promises: every sample of the epoch trained once, a
whole metrics.jsonl, and no process left behind. Each image load is slowed down (tests/slow_samples) so
that the epoch lasts long enough for an agent to join and leave.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, script_env
from slurm_cluster import processes_of

pytestmark = [pytest.mark.schedulers, pytest.mark.slow]

PAGE = REPO / "docs" / "clusters.md"
DATA_PATH, OUTPUT_DIR = "/shared/flower_photos", "/shared/runs/flowers"  # the page's paths
FLAGS = [*TINY_FLAGS, "--batch-size", "3", "--lr", "0.002"]
# After a change, the agents wait this long for more machines (30 s by default) before they start again.
# (Shorter heartbeats would save the wait for the machine that left, but on 2 busy cores an agent then
# takes a late heartbeat of the other for a departure.)
RDZV_CONF = "--rdzv-conf=last_call_timeout=1"


def page_command(marker: str) -> str:
    """The torchrun command of the page's ```bash blocks that contains `marker`, continuation lines joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), flags=re.DOTALL | re.MULTILINE)
    commands = [" ".join(line.split()) for block in blocks for line in block.replace("\\\n", " ").splitlines()
                if "torchrun " in line and marker in line and not line.lstrip().startswith(("#", "srun"))]
    assert len(commands) == 1, f"expected one torchrun command with {marker} on {PAGE.name}, found {commands}"
    return commands[0]


def as_agent(command: str, endpoint: str, data: Path, out: Path, **env: str) -> tuple[list[str], dict[str, str]]:
    """The page's command as one agent here: our Python's torchrun, one process per agent, the rendezvous on
    127.0.0.1, our paths, tiny sizes; the environment the command sets, and `env`."""
    assert DATA_PATH in command and OUTPUT_DIR in command, f"the command no longer trains on {DATA_PATH}: {command}"
    words = shlex.split(command.replace(DATA_PATH, str(data)).replace(OUTPUT_DIR, str(out)))
    variables = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        variables[name] = value
    assert words[0] == "torchrun", command
    args = [re.sub(r"^--rdzv-endpoint=.*", f"--rdzv-endpoint={endpoint}",
                   re.sub(r"^--nproc_per_node=\d+", "--nproc_per_node=1", word)) for word in words[1:]]
    script = next(i for i, word in enumerate(args) if word.endswith(".py"))
    args[script] = str(REPO / args[script])
    torchrun_flags = [RDZV_CONF] if "--nnodes=1:" in command else []
    return ([sys.executable, "-m", "torch.distributed.run", *torchrun_flags, *args, *FLAGS],
            script_env(**variables, **env))


class Agents:
    """Agents started in sessions of their own, with their output in files; whatever of the run is left
    at the end (agents, and the training processes torchrun starts in sessions of their own) is killed by
    PID."""

    def __init__(self, folder: Path, out: Path) -> None:
        self.folder, self.out, self.started = folder, out, []

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.folder / f"agent{len(self.started)}.log", "w") as log:
            agent = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started.append(agent)
        return agent

    def log(self, index: int) -> str:
        return (self.folder / f"agent{index}.log").read_text()

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for index, agent in enumerate(self.started):
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {index} ran past {timeout} s\n{self.log(index)[-3000:]}") from None
        return [agent.returncode for agent in self.started]

    def kill_what_is_left(self) -> None:
        for pid in processes_of(self.out):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    started = Agents(tmp_path, tmp_path / "run")
    try:
        yield started
    finally:
        started.kill_what_is_left()


def wait_until(condition: Callable[[], bool], what: str, running: Agents | None = None, timeout: float = 120) -> None:
    """Wait for `condition`, for at most `timeout` s, while every agent of `running` keeps running."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [i for i, agent in enumerate(running.started) if agent.poll() is not None] if running else []
        assert not ended and time.monotonic() < deadline, (
            f"waiting for {what}: " + (f"agent {ended[0]} ended\n{running.log(ended[0])[-3000:]}" if ended
                                      else f"not within {timeout} s"))
        time.sleep(0.05)


def loaded(record: Path, world_size: int | None = None) -> list[str]:
    """The images loaded so far (tests/fault_injection's record: one file per process), by processes of
    `world_size` if given."""
    return [path for log in record.iterdir() if world_size is None or log.name.startswith(f"{world_size}-")
            for path in log.read_text().splitlines()]


def test_a_machine_joins_and_another_leaves_in_the_middle_of_an_epoch(agents: Agents, tmp_path: Path) -> None:
    """One agent trains; a second joins: both save the step they are at and go on as two processes. Then
    the second gets SIGTERM: every rank stops at one step, rank 0 saves it, the first agent goes on alone."""
    # 120 images: 96 to train, 32 steps of one process; slowed down to at least 0.2 s each.
    data = make_image_folder(tmp_path / "images", {"a": 40, "b": 40, "c": 40})
    record = tmp_path / "samples"
    record.mkdir()
    command = as_agent(page_command("--nnodes=1:2"), f"127.0.0.1:{free_port()}", data, agents.out,
                       PYTHONPATH=f"{REPO / 'tests' / 'slow_samples'}:{REPO}", RECORD_SAMPLES=str(record),
                       SLOW_SAMPLE_S="0.2")
    agents.start(*command)
    wait_until(lambda: len(loaded(record)) >= 9, "the first agent's process to train", agents)
    second = agents.start(*command)
    wait_until(lambda: len(loaded(record, world_size=2)) >= 6, "two processes to train", agents)
    second.send_signal(signal.SIGTERM)
    codes = agents.wait(timeout=240)
    assert codes == [0, 1], f"exit codes {codes}\n{agents.log(0)[-3000:]}\n{agents.log(1)[-3000:]}"
    steps = re.findall(r"Stopped by .*? at epoch 0, step (\d+); its checkpoint is", agents.log(0))
    resumed = re.findall(r"Resuming from .*checkpoint.pth at epoch 0, step (\d+)", agents.log(0))
    # Each resume names the step in its own processes' steps (3 images a process): 1 process stopped, 2 went on
    # from the samples trained so far, a half step dropped from the count only; then the reverse.
    assert len(steps) == len(resumed) == 2, agents.log(0)[-4000:]
    alone = int(steps[0]) * 3
    together = alone + (int(steps[1]) - int(resumed[0])) * 6
    assert [int(r) for r in resumed] == [alone // 6, together // 3], agents.log(0)[-4000:]
    train = {str(data / path) for path in json.loads((agents.out / "split.json").read_text())["train"]}
    trained = [path for path in loaded(record) if path in train]
    assert len(trained) == len(set(trained)), "a sample trained twice in one epoch"
    assert len(train) - len(trained) < 3, "every sample, but what fills no batch of 3 at the end"
    (metrics,) = [json.loads(line) for line in (agents.out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["epoch"] == 0 and metrics["world_size"] == 1 and metrics["val_total"] == 24
    assert processes_of(agents.out) == [], "processes of the run are left"


def test_sigusr1_kills_the_torchrun_agent_and_its_process_ends_without_saving(agents: Agents, tmp_path: Path) -> None:
    """docs/clusters.md's launcher table: torchrun passes SIGTERM on, but dies of SIGUSR1 at once; its
    process, left alone, ends without a checkpoint of its step, in one line that says why."""
    data = make_image_folder(tmp_path / "images", {"a": 10, "b": 10, "c": 10})
    record = tmp_path / "samples"
    record.mkdir()
    agent = agents.start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data),
                          "--output-dir", str(agents.out), *FLAGS],
                         script_env(PYTHONPATH=f"{REPO / 'tests' / 'slow_samples'}:{REPO}",
                                    RECORD_SAMPLES=str(record), SLOW_SAMPLE_S="0.2"))
    wait_until(lambda: len(loaded(record)) >= 3, "the process to train", agents)
    agent.send_signal(signal.SIGUSR1)
    assert agents.wait(timeout=10) == [-signal.SIGUSR1]
    wait_until(lambda: not processes_of(agents.out), "the process to end", timeout=60)
    assert not (agents.out / "checkpoint.pth").exists(), "no step could be saved"
    said = [line for line in agents.log(0).split("\n") if "Stopped by" in line]
    assert said == ["Stopped by the end of the launcher that started this run before any checkpoint was written"], said
