"""docs/clusters.md's two-machine torchrun recipe, run as written (but for the addresses, the counts and the
training flags) across two hosts: two network namespaces on one cable, each with its own host name,
/etc/hosts and core (tests/two_hosts.py). It must end with the weights of the same job on one machine,
also where each machine's name resolves to 127.0.1.1, as many cloud images have it.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
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
