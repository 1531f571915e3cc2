"""docs/clusters.md's two-machine torchrun recipe, run as written (but for the addresses, the counts and the
training flags) across two hosts: two network namespaces on one cable, each with its own host name,
/etc/hosts and core (tests/two_hosts.py). It must end with the weights of the same job on one machine,
also where each machine's name resolves to 127.0.1.1, as many cloud images have it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_FLAGS, free_port, make_image_folder, script_env, torchrun
from two_hosts import two_hosts

pytestmark = [pytest.mark.schedulers, pytest.mark.slow]

CLUSTERS = (REPO / "docs" / "clusters.md").read_text()
JOB_TIMEOUT_S = 240


def the_recipe() -> list[str]:
    """The two-machine command of docs/clusters.md, as words."""
    (command,) = [block for block in re.findall(r"^```bash\n(.*?)^```", CLUSTERS, flags=re.DOTALL | re.MULTILINE)
                  if "--node-rank=0" in block]
    lines = [line for line in command.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    (line,) = lines
    return shlex.split(line)


def on_host(recipe: list[str], node_rank: int, master: str, port: int, data: Path, out: Path) -> list[str]:
    """The recipe for one machine: its node rank, the first host's address, one process per machine (a core
    each), the test's data and a tiny training."""
    swaps = {"--node-rank=0": f"--node-rank={node_rank}", "--master-addr=10.0.0.1": f"--master-addr={master}",
             "--master-port=29500": f"--master-port={port}", "--nproc_per_node=8": "--nproc_per_node=1",
             "/shared/flower_photos": str(data), "/shared/runs/flowers": str(out)}
    words = [swaps.get(word, word) for word in recipe]
    assert words[0] == "torchrun", recipe
    return [*torchrun(), *words[1:], *TINY_FLAGS, "--epochs", "2", "--dist-timeout", "60"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("two_hosts") / "images", {"a": 12, "b": 12, "c": 12})


@pytest.fixture(scope="module")
def one_machine(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of the same job, two processes on this machine."""
    out = tmp_path_factory.mktemp("one_machine") / "run"
    script = REPO / "train_multi_gpu_using_launch.py"
    done = subprocess.run([*torchrun(), "--standalone", "--nproc_per_node=2", str(script), "--data-path", str(data),
                           "--output-dir", str(out), *TINY_FLAGS, "--epochs", "2"], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "checkpoint.pth", weights_only=True)["model"]


@pytest.mark.parametrize("loopback_names", [False, True], ids=["names-resolve", "names-are-loopback"])
def test_the_recipe_trains_across_two_hosts_to_the_weights_of_one(data: Path, tmp_path: Path,
                                                                 one_machine: dict[str, torch.Tensor],
                                                                 loopback_names: bool) -> None:
    out, port = tmp_path / "run", free_port()
    with two_hosts(loopback_names) as hosts:
        jobs = [host.start(on_host(the_recipe(), rank, hosts[0].address, port, data, out), tmp_path / f"host{rank}",
                           script_env(), REPO) for rank, host in enumerate(hosts)]
        for job in jobs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # two_hosts ends what still runs
                job.wait(timeout=JOB_TIMEOUT_S)
    logs = [(tmp_path / f"host{rank}").read_text() for rank in range(2)]
    assert [job.returncode for job in jobs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    trained = torch.load(out / "checkpoint.pth", weights_only=True)["model"]
    assert all(torch.equal(trained[name], one_machine[name]) for name in one_machine), "the weights of one machine"
    said = [line for log in logs for line in log.splitlines() if "resolves to a loopback address" in line]
    if loopback_names:  # each machine chose the interface of the cable, and said so
        assert [line.split(":")[0] for line in said] == ["| node-a resolves to a loopback address",
                                                          "| node-b resolves to a loopback address"], said
    else:
        assert said == []


def test_the_test_runs_the_recipe_of_the_page() -> None:
    """What the test changes in the recipe is only addresses, counts and paths: its torchrun flags are the
    page's."""
    recipe = the_recipe()
    assert {"--nnodes=2", "--node-rank=0", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(recipe)
    assert recipe[-4:] == ["--data-path", "/shared/flower_photos", "--output-dir", "/shared/runs/flowers"]


def test_the_benchmark_times_the_job_on_one_machine_and_across_two(data: Path) -> None:
    """bench/two_hosts_benchmark.py, one short round: both runs trained every epoch with two processes, and the
    ratios are those of its own figures."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "two_hosts_benchmark.py"), "--data-path", str(data),
                           "--rounds", "1", "--epochs", "1", "--image-size", "16", "--batch-size", "4"],
                          cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=2 * JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = (report["rounds"][name][0] for name in ("one_machine", "two_machines"))
    assert one["world_size"] == two["world_size"] == 2
    assert len(one["images_per_s"]) == len(two["images_per_s"]) == 1
    assert report["speed_ratio"] == pytest.approx(two["images_per_s"][-1] / one["images_per_s"][-1])
    assert report["wall_ratio"] == pytest.approx(two["wall_s"] / one["wall_s"])


CUT_DIST_TIMEOUT_S = 20
# Every process on both machines, torchrun's agents among them, ends within this after the cable is cut.
CUT_BOUND_S = CUT_DIST_TIMEOUT_S + 90


def test_a_cable_cut_for_good_ends_both_hosts_in_one_line_each_and_the_run_goes_on_once_it_is_back(
        data: Path, tmp_path: Path, one_machine: dict[str, torch.Tensor]) -> None:
    """The cable pulled out of both machines inside the second epoch, for good: no reset reaches either end,
    so each process learns of it only when --dist-timeout runs out. Each host then says in one line which
    rank lost which; the checkpoint of the first epoch is whole. Plugged in again, the same command with
    --resume auto ends with the weights of the unbroken job."""
    out = tmp_path / "run"
    slow = script_env(PYTHONPATH=f"{REPO / 'tests' / 'slow_samples'}:{REPO}", SLOW_SAMPLE_S="0.2")  # epochs of seconds
    with two_hosts(loopback_names=False) as hosts:
        port = free_port()
        jobs = [host.start([*on_host(the_recipe(), rank, hosts[0].address, port, data, out), "--dist-timeout",
                            str(CUT_DIST_TIMEOUT_S)], tmp_path / f"cut{rank}", slow, REPO)
                for rank, host in enumerate(hosts)]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (out / "metrics.jsonl").is_file() or not (out / "checkpoint.pth").is_file():
            assert all(job.poll() is None for job in jobs) and time.monotonic() < deadline, \
                (tmp_path / "cut0").read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # inside the second epoch
        for host in hosts:
            host.cable(connected=False)
        cut_at = time.monotonic()
        for job in jobs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=max(1.0, cut_at + CUT_BOUND_S - time.monotonic()))
        ended_within = time.monotonic() - cut_at
        left = {host.name: namespace_pids(host.namespace) for host in hosts}
        logs = [(tmp_path / f"cut{rank}").read_text() for rank in range(2)]
        assert left == {"node-a": [], "node-b": []} and ended_within <= CUT_BOUND_S, (
            f"still running {ended_within:.0f} s after the cut: {left}\n" + "\n\n".join(log[-2000:] for log in logs))
        assert all(job.returncode not in (0, None) for job in jobs), [job.returncode for job in jobs]
        said = [[line for line in log.splitlines() if line.startswith("error: rank ")] for log in logs]
        # The first machine keeps the store: rank 0 finds rank 1 silent. The second reaches neither.
        assert len(said[0]) == 1 and "rank 0 waited" in said[0][0] and "rank(s) 1 stopped" in said[0][0], logs[0]
        assert len(said[1]) == 1 and "rank 1 waited" in said[1][0], logs[1][-3000:]
        assert f"store at {hosts[0].address}:{port} does not answer" in said[1][0], said[1]
        saved = torch.load(out / "checkpoint.pth", weights_only=True)
        assert saved["epoch"] == 0, "the first epoch's checkpoint"
        for host in hosts:
            host.cable(connected=True)
        port = free_port()
        jobs = [host.start([*on_host(the_recipe(), rank, hosts[0].address, port, data, out), "--resume", "auto"],
                           tmp_path / f"resumed{rank}", script_env(), REPO) for rank, host in enumerate(hosts)]
        for job in jobs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=JOB_TIMEOUT_S)
    logs = [(tmp_path / f"resumed{rank}").read_text() for rank in range(2)]
    assert [job.returncode for job in jobs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    trained = torch.load(out / "checkpoint.pth", weights_only=True)["model"]
    assert all(torch.equal(trained[name], one_machine[name]) for name in one_machine), "the unbroken job's weights"


def namespace_pids(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split()]
