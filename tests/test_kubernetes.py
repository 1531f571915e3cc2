"""Kubernetes' PyTorchJob: what its operator puts in each pod, what of it we read, and the example manifest.

The Kubeflow training operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK in every pod (one process
per pod), and, in recent versions, PET_* variables that only torchrun reads. No cluster is needed to test
that: launch detection is a pure function of the environment, torchrun's flags come from an argparse
parser, and the manifest is text. Nothing here starts a process or opens a socket.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any

import pytest
import torch.distributed.run

from conftest import REPO
from multi_train_utils.cli import parse_args
from multi_train_utils.errors import UserInputError
from multi_train_utils.launch import Launch, check_one_gpu_per_process, detect_launch

MANIFEST = REPO / "examples" / "pytorchjob.yaml"
JOB = "flowers"  # the manifest's metadata.name: the master's Service is "<name>-master-0"
OPERATOR_PORT = "23456"  # the operator's default port, given to MASTER_PORT

# What every pod has besides the operator's variables: the kubelet's service links (one of them ends in
# _PORT and holds a URL), the GPU device plugin's, the image's. None of them may count.
POD_NOISE = {
    "HOSTNAME": f"{JOB}-worker-0",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "FLOWERS_MASTER_0_SERVICE_HOST": "10.96.12.34",
    "FLOWERS_MASTER_0_PORT": f"tcp://10.96.12.34:{OPERATOR_PORT}",
    "NVIDIA_VISIBLE_DEVICES": "GPU-5f3c2a10-0000-0000-0000-000000000000",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/root",
    "PYTHONUNBUFFERED": "1",  # the operator's too, so that logs arrive as they are written
}


def operator_env(rank: int, pods: int) -> dict[str, str]:
    """One pod's environment as the operator writes it, without spec.nprocPerNode (one process per pod):
    the master is RANK 0, the workers 1, 2, ...; PET_NPROC_PER_NODE is then the operator's default, auto."""
    master = f"{JOB}-master-0"
    return {
        "MASTER_ADDR": master, "MASTER_PORT": OPERATOR_PORT, "WORLD_SIZE": str(pods), "RANK": str(rank),
        "PET_MASTER_ADDR": master, "PET_MASTER_PORT": OPERATOR_PORT, "PET_NNODES": str(pods),
        "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto",
        **POD_NOISE,
    }


# --- What launch detection reads -----------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_pod_of_a_pytorchjob_is_one_process(rank: int) -> None:
    """RANK and WORLD_SIZE alone (no LOCAL_*) mean one process per pod: local rank 0 of 1, so the pod's one
    GPU is enough and its CPUs are not divided by the world size."""
    env = operator_env(rank, pods=3)
    launch = detect_launch(env)
    assert launch == Launch(rank=rank, local_rank=0, world_size=3, local_world_size=1, source="torchrun")
    check_one_gpu_per_process(launch, 1, env)  # one GPU per pod suffices; raises if it did not


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE"])
def test_a_pod_with_half_of_rank_and_world_size_is_refused_in_one_line(missing: str) -> None:
    """Both are needed: with half of them, a pod must neither wait for a process group that never forms nor
    train alone, as each of the job's pods would, all into one folder."""
    env = operator_env(1, pods=2)
    del env[missing]
    with pytest.raises(UserInputError, match=f"is set but {missing} is not"):
        detect_launch(env)


def test_the_pet_variables_are_torchruns_not_ours() -> None:
    """PET_* are the defaults of torchrun's flags. Without torchrun they describe nothing that runs, so
    other values in them must change nothing, and they alone are one process."""
    env = operator_env(1, pods=2)
    other = {**env, "PET_NNODES": "9", "PET_NODE_RANK": "7", "PET_NPROC_PER_NODE": "8",
             "PET_MASTER_ADDR": "elsewhere", "PET_MASTER_PORT": "1"}
    assert detect_launch(other) == detect_launch(env)
    pet_only = {name: value for name, value in env.items() if name.startswith("PET_") or name in POD_NOISE}
    assert detect_launch(pet_only) == Launch(0, 0, 1, 1, "single")


def test_master_addr_and_port_are_left_to_the_process_group() -> None:
    """detect_launch reads no master: init_process_group's env:// does (next test). A master of our own
    choosing, as under srun (join_process_group sets srun's alone), would override the operator's Service name."""
    env = operator_env(1, pods=2)
    moved = {**env, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    assert detect_launch(moved) == detect_launch(env)
    assert detect_launch(env).source != "slurm"


def test_env_rendezvous_meets_at_the_operators_master(monkeypatch: pytest.MonkeyPatch) -> None:
    """What init_process_group does with the operator's MASTER_ADDR and MASTER_PORT under env://: it makes
    its store there. The store itself is replaced, so that no socket is opened to a host that is not here."""
    env = operator_env(1, pods=2)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function
    stores: list[tuple[Any, ...]] = []
    monkeypatch.setattr(rendezvous, "_create_c10d_store", lambda *args, **kwargs: stores.append(args) or "store")
    launch = detect_launch(env)
    store, rank, world_size = next(rendezvous.rendezvous("env://", rank=launch.rank, world_size=launch.world_size))
    assert (store, rank, world_size) == ("store", 1, 2)
    assert stores[0][:4] == (f"{JOB}-master-0", int(OPERATOR_PORT), 1, 2)


def test_under_torchrun_its_variables_replace_the_operators() -> None:
    """torchrun as the pod's command starts its processes with its own RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE in place of the operator's: those are what a process must read."""
    env = {**operator_env(1, pods=2), "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert detect_launch(env) == Launch(6, 2, 8, 4, "torchrun")


# --- What torchrun reads ---------------------------------------------------------------------------------

PET = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": f"{JOB}-master-0",
       "PET_MASTER_PORT": OPERATOR_PORT, "PET_NPROC_PER_NODE": "4"}


def torchrun_args(argv: list[str]) -> Any:
    """torchrun's flags for `argv`. Its parser reads the PET_* defaults when it is built, so build it here,
    after the test has set the environment."""
    return torch.distributed.run.get_args_parser().parse_args(argv)


def without_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("PET_")]:
        monkeypatch.delenv(name)


def test_torchrun_takes_its_flags_from_the_operators_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    without_pet(monkeypatch)
    for name, value in PET.items():
        monkeypatch.setenv(name, value)
    args = torchrun_args(["train_multi_gpu_using_launch.py"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc_per_node) == (
        "2", 1, f"{JOB}-master-0", int(OPERATOR_PORT), "4")


def test_without_pet_variables_torchrun_has_its_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other half of the test above: its values came from the environment, not from torchrun."""
    without_pet(monkeypatch)
    args = torchrun_args(["train_multi_gpu_using_launch.py"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.nproc_per_node) == ("1:1", 0, "127.0.0.1", "1")


def test_a_torchrun_flag_wins_over_its_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator sets PET_NPROC_PER_NODE=auto unless spec.nprocPerNode says otherwise; the manifest's
    --nproc_per_node is what counts."""
    without_pet(monkeypatch)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "auto")
    assert torchrun_args(["--nproc_per_node=4", "train_multi_gpu_using_launch.py"]).nproc_per_node == "4"


# --- The example manifest --------------------------------------------------------------------------------

# Its commands are written as JSON arrays (a subset of YAML), so that they are read here without PyYAML.
COMMAND = re.compile(r"command:\s*(\[[^\]]*\])")


def manifest_commands(commented: bool) -> list[list[str]]:
    """The `command: [...]` lists of the manifest itself, or (commented) of the alternative in its comments."""
    lines = MANIFEST.read_text().splitlines()
    if commented:
        text = "\n".join(line.lstrip()[1:] for line in lines if line.lstrip().startswith("#"))
    else:
        text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    return [json.loads(found) for found in COMMAND.findall(text)]


def test_the_manifest_runs_the_launch_script_with_flags_it_accepts() -> None:
    commands = manifest_commands(commented=False)
    assert len(commands) == 2 and commands[0] == commands[1], "the Master and the Worker run the same command"
    python, script, *argv = commands[0]
    assert python == "python" and script == "train_multi_gpu_using_launch.py"
    assert (REPO / script).is_file()
    args = parse_args("launch", argv)  # exits (SystemExit) on a flag it does not know or a bad combination
    assert args.resume == "auto", "a restarted pod must continue from the checkpoint"
    assert args.output_dir.startswith("/output/") and args.data_path.startswith("/data/"), "the mounted volume"
    assert args.checkpoint_every_minutes == 30


def test_the_manifests_torchrun_alternative_is_one_torchrun_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commented form for pods with several GPUs: torchrun's flags, then our script and its flags, and as
    many GPUs asked for as processes started."""
    without_pet(monkeypatch)
    for name, value in {**PET, "PET_NPROC_PER_NODE": "auto"}.items():
        monkeypatch.setenv(name, value)
    (command,) = manifest_commands(commented=True)
    assert command[0] == "torchrun"
    args = torchrun_args(command[1:])
    assert (REPO / args.training_script).is_file() and args.training_script == "train_multi_gpu_using_launch.py"
    assert parse_args("launch", args.training_script_args).resume == "auto"
    assert (args.nnodes, args.node_rank, args.master_addr) == ("2", 1, f"{JOB}-master-0"), "from PET_*"
    comments = "\n".join(line for line in MANIFEST.read_text().splitlines() if line.lstrip().startswith("#"))
    gpus = re.findall(r"nvidia\.com/gpu:\s*(\d+)", comments)
    assert gpus == [args.nproc_per_node]
    assert re.findall(r'nprocPerNode:\s*"(\d+)"', comments) == [args.nproc_per_node]


def test_the_manifest_is_the_pytorchjob_its_comments_describe() -> None:
    yaml = pytest.importorskip("yaml")
    (job,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", JOB)
    # A number here would make the operator's WORLD_SIZE pods x N while each pod runs one process.
    assert "nprocPerNode" not in job["spec"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    commands = []
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > 30, "more than Kubernetes' default, to write the checkpoint"
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the name the operator looks for
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for path in ("/data", "/output"):
            assert "persistentVolumeClaim" in volumes[mounts[path]["name"]], f"{path} must outlive the pod"
        assert not mounts["/output"].get("readOnly")
        commands.append(container["command"])
    assert commands == manifest_commands(commented=False), "YAML reads the commands as the JSON reading does"
