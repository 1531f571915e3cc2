"""The README's "Change it", done as a reader would: each recipe applied to a copy of the repository, then
its commands run there. A recipe whose diff no longer applies, or whose run fails, fails here."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, make_image_folder, run, script_env

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
CHANGE_IT = re.search(r"^## Change it\n(.*?)^## ", README, flags=re.DOTALL | re.MULTILINE).group(1)
RECIPES = dict(re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", CHANGE_IT, flags=re.DOTALL | re.MULTILINE))
# The recipes' runs made tiny; --model stays the recipe's own.
TINY = ["--image-size", "32", "--batch-size", "4", "--epochs", "2", "--workers", "0", "--device", "cpu"]
LEFT_OUT = (".git", ".venv", "runs", "data", "output", "__pycache__", ".pytest_cache", ".ruff_cache")


def blocks(recipe: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", RECIPES[recipe], flags=re.DOTALL | re.MULTILINE)


def commands(recipe: str) -> list[list[str]]:
    return [shlex.split(line) for block in blocks(recipe, "bash") for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("change_it") / "images", {"red": 10, "green": 10, "blue": 10})


def copy_of_the_repository(folder: Path) -> Path:
    shutil.copytree(REPO, folder, ignore=shutil.ignore_patterns(*LEFT_OUT))
    return folder


def apply(recipe: str, copy: Path) -> None:
    for diff in blocks(recipe, "diff"):
        patch = copy / "recipe.diff"
        patch.write_text(diff)
        applied = subprocess.run(["git", "apply", "--verbose", str(patch)], cwd=copy, capture_output=True, text=True)
        assert applied.returncode == 0, f"{recipe}: its diff no longer applies\n{applied.stderr}"


def run_recipe(recipe: str, copy: Path, images: Path) -> list[subprocess.CompletedProcess]:
    """Each command of the recipe, in the copy, on the small image folder, with tiny sizes."""
    results = []
    for words in commands(recipe):
        program = [sys.executable] if words[0] == "python" else [sys.executable, "-m", "torch.distributed.run"]
        data = [] if "--data-path" in words else ["--data-path", str(images)]
        result = run([*program, *words[1:], *data, *TINY], cwd=copy, env=script_env(), timeout=240)
        assert result.returncode == 0, f"{recipe}: {shlex.join(words)}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
        results.append(result)
    return results


def metrics(run_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]


def test_the_readme_has_each_recipe() -> None:
    assert list(RECIPES) == ["Your own model", "Your own data source", "The optimizer and the schedule",
                             "A metric of your own", "A minimal version to teach from"]


def test_your_own_model(tmp_path: Path, images: Path) -> None:
    copy = copy_of_the_repository(tmp_path / "repo")
    apply("Your own model", copy)
    run_recipe("Your own model", copy, images)
    weights = torch.load(copy / "runs" / "mycnn" / "weights" / "best.pth", weights_only=True)
    assert "classifier.weight" in weights and weights["classifier.weight"].shape == (3, 128)


def test_your_own_data_source(tmp_path: Path, images: Path) -> None:
    """Rows of a CSV instead of class folders; the split record and the resume keep working."""
    copy = copy_of_the_repository(tmp_path / "repo")
    apply("Your own data source", copy)
    (copy / "data").mkdir()
    with open(copy / "data" / "photos.csv", "w", newline="") as file:
        rows = csv.writer(file)
        rows.writerow(["image", "label"])
        for path in sorted(images.rglob("*.*")):
            rows.writerow([str(path), f"colour_{path.parent.name}"])
    _first, resumed = run_recipe("Your own data source", copy, images)
    out = copy / "runs" / "csv"
    split = json.loads((out / "split.json").read_text())
    assert split["class_names"] == ["colour_blue", "colour_green", "colour_red"]
    assert len(split["train"]) == 24 and len(split["val"]) == 6
    assert "Resuming from" in resumed.stdout
    assert [line["epoch"] for line in metrics(out)] == [0, 1]


def test_the_optimizer_and_the_schedule(tmp_path: Path, images: Path) -> None:
    copy = copy_of_the_repository(tmp_path / "repo")
    apply("The optimizer and the schedule", copy)
    run_recipe("The optimizer and the schedule", copy, images)
    adamw = torch.load(copy / "runs" / "adamw" / "checkpoint.pth", weights_only=True)
    assert [group["weight_decay"] for group in adamw["optimizer"]["param_groups"]] == [0.05, 0.0]
    assert "exp_avg" in next(iter(adamw["optimizer"]["state"].values())), "AdamW's own state"
    rmsprop = torch.load(copy / "runs" / "rmsprop" / "checkpoint.pth", weights_only=True)
    assert "square_avg" in next(iter(rmsprop["optimizer"]["state"].values()))


def test_a_metric_of_your_own(tmp_path: Path, images: Path) -> None:
    """Top-5 accuracy: in metrics.jsonl and TensorBoard after two processes trained, and in --eval-only's JSON
    the same on two processes as on one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    copy = copy_of_the_repository(tmp_path / "repo")
    apply("A metric of your own", copy)
    run_recipe("A metric of your own", copy, images)
    out = copy / "runs" / "top5"
    line = metrics(out)[-1]
    assert line["world_size"] == 2 and line["val_top5_acc"] == 1.0, "3 classes: the true one is always in the top 5"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "val_top5_acc" in events.Tags()["scalars"]
    launch = [str(copy / "train_multi_gpu_using_launch.py"), "--data-path", str(images), "--output-dir", str(out),
              *TINY, "--eval-only"]
    one = run([sys.executable, *launch], cwd=copy, timeout=240)
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *launch],
              cwd=copy, timeout=240)
    figures = [json.loads(result.stdout.strip().splitlines()[-1]) for result in (one, two)]
    assert figures[0]["val_top5_acc"] == figures[1]["val_top5_acc"] == 1.0
    assert figures[0]["val_correct"] == figures[1]["val_correct"]


def test_a_minimal_version_to_teach_from_trains_under_every_launcher(tmp_path: Path, images: Path) -> None:
    """The features deleted, their modules and the lines that name them: each launcher still trains, and what
    the features wrote is not written."""
    copy = copy_of_the_repository(tmp_path / "repo")
    (removal,) = blocks("A minimal version to teach from", "bash")
    removed = [Path(word) for word in shlex.split(removal)[1:]]
    for module in removed:
        (copy / module).unlink()
    wiring = {"features.py": ["ModelEma", "StopAtStep", "PeriodicCheckpoints", "TensorBoardLog"],
              "data.py": ["gpu_training_set"]}
    for name, words in wiring.items():
        path = copy / "multi_train_utils" / name
        kept = [line for line in path.read_text().splitlines(True) if not any(word in line for word in words)]
        path.write_text("".join(kept))
    assert not any((copy / module).exists() for module in removed)
    imports = re.compile(r"^\s*(from|import) .*\b(ema|preemption|periodic_checkpoints|tensorboard_log|gpu_decode)\b")
    leftovers = [f"{path.relative_to(copy)}: {line.strip()}" for path in copy.rglob("*.py")
                 if "tests" not in path.parts and "bench" not in path.parts
                 for line in path.read_text().splitlines() if imports.match(line)]
    assert leftovers == [], "still wired"
    flags = ["--data-path", str(images), *TINY]
    starts = {"single": [sys.executable, "train_single_gpu.py"],
              "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train_multi_gpu_using_launch.py"],
              "spawn": [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", "2"]}
    for launcher, start in starts.items():
        result = run([*start, *flags, "--output-dir", f"runs/{launcher}"], cwd=copy, timeout=240)
        assert result.returncode == 0, f"{launcher}\n{result.stderr[-3000:]}"
        assert [line["epoch"] for line in metrics(copy / "runs" / launcher)] == [0, 1]
        assert not (copy / "runs" / launcher / "tensorboard").exists()
