"""docs/change-it.md, done as a reader would: each recipe's diffs applied to a fresh copy of the repository, then
its commands run there exactly as written, on the built-in demo data unless the recipe names other data. A
recipe whose diff no longer applies fails in the test command of the README; the runs (each a training in a
copy, about 4 minutes together) are marked `recipes`, which .ci/run runs after it: `python -m pytest -m
recipes`."""

from __future__ import annotations

import ast
import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, copy_of_the_repository, make_image_folder, run, script_env

pytestmark = pytest.mark.docs

PAGE = (REPO / "docs" / "change-it.md").read_text()
RECIPES = dict(re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", PAGE, flags=re.DOTALL | re.MULTILINE))
# What a recipe's command may start with, as a user types it, and what runs it here.
PROGRAMS = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
# The one command not run here, and why.
NOT_RUN = {"pip install -e .": "tests/test_core.py builds the engine's wheel and trains the example with it"}


def blocks(recipe: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", RECIPES[recipe], flags=re.DOTALL | re.MULTILINE)


def commands(recipe: str) -> list[str]:
    return [line for block in blocks(recipe, "bash") for line in block.splitlines() if line.strip()]


def apply(recipe: str, copy: Path, check: bool = False) -> None:
    """The recipe's diffs, applied to `copy` (with `check`, only tried). One line of context each side is enough,
    as for a reader: a line of one's own added beside a changed line leaves the recipe as true as it was."""
    problem = diff_problem(recipe, copy, check)
    assert problem is None, problem


def diff_problem(recipe: str, copy: Path, check: bool = False) -> str | None:
    """Where the recipe's diffs no longer match the code, in a line and git's words, or None once applied."""
    for diff in blocks(recipe, "diff"):
        patch = copy.parent / "recipe.diff"
        patch.write_text(diff)
        applied = subprocess.run(["git", "apply", "-C1", "--check" if check else "--verbose", str(patch)], cwd=copy,
                                 capture_output=True, text=True)
        patch.unlink()
        if applied.returncode != 0:
            return (f"docs/change-it.md, {recipe!r}: its diff no longer matches the code; update the diff there\n"
                    f"{applied.stderr}")
    return None


def run_recipe(recipe: str, copy: Path) -> list[subprocess.CompletedProcess]:
    """The recipe's commands, in the copy, as written; the engine importable as `pip install -e .` makes it."""
    results = []
    for command in commands(recipe):
        if command in NOT_RUN:
            continue
        words = shlex.split(command)
        result = run([*PROGRAMS[words[0]], *words[1:]], cwd=copy, env=script_env(PYTHONPATH=str(copy)), timeout=240)
        assert result.returncode == 0, f"{recipe}: {command}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
        results.append(result)
    return results


def recipe_in_a_copy(recipe: str, tmp_path: Path) -> tuple[Path, list[subprocess.CompletedProcess]]:
    copy = copy_of_the_repository(tmp_path / "repo")
    apply(recipe, copy)
    return copy, run_recipe(recipe, copy)


def metrics(run_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]


def test_the_page_has_each_recipe_and_the_table_names_each() -> None:
    assert list(RECIPES) == ["Your own model", "A second head", "Your own data source", "A folder split already",
                             "A loss of your own", "MixUp and CutMix", "An augmentation of your own",
                             "Class-balanced sampling", "Freeze the body, then train it all",
                             "The best weights by another figure", "The optimizer and the schedule",
                             "Find the learning rate", "A figure of every step", "A metric of your own",
                             "The engine in a script of your own", "A minimal version to teach from"]
    for recipe in RECIPES:
        assert f"[{recipe.lower()}](#" in PAGE.lower(), f"the table of docs/change-it.md does not name {recipe!r}"


@pytest.mark.recipes
@pytest.mark.slow
def test_your_own_model(tmp_path: Path) -> None:
    copy, _ = recipe_in_a_copy("Your own model", tmp_path)
    weights = torch.load(copy / "runs" / "mycnn" / "weights" / "best.pth", weights_only=True)
    assert weights["classifier.weight"].shape == (5, 128), "the demo data's 5 classes"


@pytest.mark.recipes
@pytest.mark.slow
def test_a_second_head(tmp_path: Path) -> None:
    """Both heads train (under one process, and under DDP with MixUp's shared labels); validation, the confusion
    matrix and predict.py take the class logits."""
    copy, results = recipe_in_a_copy("A second head", tmp_path)
    for run_name, world_size in (("parity", 1), ("parity_mix", 2)):
        out = copy / "runs" / run_name
        line = metrics(out)[-1]
        assert line["world_size"] == world_size and line["val_total"] == 120
        assert sum(map(sum, line["confusion_matrix"])) == 120
        best = torch.load(out / "weights" / "best.pth", weights_only=True)
        assert best["parity.weight"].shape == (2, 512) and best["fc.weight"].shape == (5, 512)
    assert re.match(r"^data/demo_patterns/dots/dots_0000\.jpg +\w+ [01]\.\d{3} ", results[-1].stdout)


@pytest.mark.recipes
@pytest.mark.slow
def test_your_own_data_source(tmp_path: Path) -> None:
    """Rows of a CSV instead of class folders; the split record and the resume keep working, and the second
    command trains on from where the first ended."""
    copy = copy_of_the_repository(tmp_path / "repo")
    apply("Your own data source", copy)
    images = make_image_folder(copy / "data" / "images", {"red": 10, "green": 10, "blue": 10})
    with open(copy / "data" / "photos.csv", "w", newline="") as file:
        rows = csv.writer(file)
        rows.writerow(["image", "label"])
        for path in sorted(images.rglob("*.*")):
            rows.writerow([str(path.relative_to(copy / "data")), f"colour_{path.parent.name}"])
    _first, resumed = run_recipe("Your own data source", copy)
    out = copy / "runs" / "csv"
    split = json.loads((out / "split.json").read_text())
    assert split["class_names"] == ["colour_blue", "colour_green", "colour_red"]
    assert len(split["train"]) == 24 and len(split["val"]) == 6
    assert "Resuming from" in resumed.stdout
    assert [line["epoch"] for line in metrics(out)] == [0, 1, 2, 3]


@pytest.mark.recipes
@pytest.mark.slow
def test_a_folder_split_already(tmp_path: Path) -> None:
    """train/ and val/: the run validates on val/ alone and never trains on it."""
    copy = copy_of_the_repository(tmp_path / "repo")
    root = copy / "data" / "split_photos"
    make_image_folder(root / "train", {"cat": 12, "dog": 12})
    make_image_folder(root / "val", {"cat": 3, "dog": 4})
    (result,) = run_recipe("A folder split already", copy)
    assert "24 images for training, 7 for validation (its train/ and val/ folders)" in result.stdout
    split = json.loads((copy / "runs" / "presplit" / "split.json").read_text())
    assert all(path.startswith("val/") for path in split["val"]) and len(split["val"]) == 7
    assert all(path.startswith("train/") for path in split["train"])
    assert metrics(copy / "runs" / "presplit")[0]["val_total"] == 7


@pytest.mark.recipes
@pytest.mark.slow
def test_a_loss_of_your_own(tmp_path: Path) -> None:
    """The focal loss trains and validates: its val_loss is below the cross-entropy of the same weights on the
    same images (the focal weight is at most 1), which --eval-only of the unchanged script gives."""
    copy, _ = recipe_in_a_copy("A loss of your own", tmp_path)
    out = copy / "runs" / "focal"
    best = max(metrics(out), key=lambda line: (line["val_acc"], line["epoch"]))
    plain = run([sys.executable, str(REPO / "train_single_gpu.py"), "--output-dir", str(out), "--model", "resnet18",
                 "--eval-only", "--data-path", str(copy / "data" / "demo_patterns")], cwd=copy, timeout=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    cross_entropy = json.loads(plain.stdout.splitlines()[-1])
    assert cross_entropy["val_correct"] == best["val_correct"]
    assert best["val_loss"] < cross_entropy["val_loss"]


@pytest.mark.recipes
@pytest.mark.slow
def test_mixup_and_cutmix(tmp_path: Path) -> None:
    copy = copy_of_the_repository(tmp_path / "repo")
    _first, resumed = run_recipe("MixUp and CutMix", copy)
    assert "Resuming from" in resumed.stdout
    lines = metrics(copy / "runs" / "mix")
    assert [line["epoch"] for line in lines] == [0, 1] and lines[-1]["world_size"] == 2


@pytest.mark.recipes
@pytest.mark.slow
def test_an_augmentation_of_your_own(tmp_path: Path) -> None:
    copy, _ = recipe_in_a_copy("An augmentation of your own", tmp_path)
    assert "TrivialAugmentWide" in (copy / "my_dataset.py").read_text()
    assert [line["epoch"] for line in metrics(copy / "runs" / "augment")] == [0]


@pytest.mark.recipes
@pytest.mark.slow
def test_class_balanced_sampling(tmp_path: Path) -> None:
    """A plain DistributedSampler subclass, without skip(): the run resumed from inside an epoch ends with the
    unbroken run's weights, bit for bit, and the checkpoint names its sampler."""
    copy, _ = recipe_in_a_copy("Class-balanced sampling", tmp_path)
    first, again = copy / "runs" / "balanced", copy / "runs" / "balanced_again"
    assert torch.load(first / "checkpoint.pth", weights_only=True)["sampler"] == "ClassBalancedSampler"
    unbroken = torch.load(first / "weights" / "model-1.pth", weights_only=True)
    resumed = torch.load(again / "weights" / "model-1.pth", weights_only=True)
    assert all(torch.equal(unbroken[name], resumed[name]) for name in unbroken)


@pytest.mark.recipes
@pytest.mark.slow
def test_freeze_the_body_then_train_it_all(tmp_path: Path) -> None:
    """Under DDP: in epoch 0 only the classifier moved; from epoch 1 every layer does."""
    copy, _ = recipe_in_a_copy("Freeze the body, then train it all", tmp_path)
    base = torch.load(copy / "runs" / "base" / "weights" / "best.pth", weights_only=True)
    after = [torch.load(copy / "runs" / "finetune" / "weights" / f"model-{epoch}.pth", weights_only=True)
             for epoch in (0, 1)]
    assert torch.equal(after[0]["conv1.weight"], base["conv1.weight"]), "the body frozen in epoch 0"
    assert not torch.equal(after[0]["fc.weight"], base["fc.weight"]), "the classifier trained"
    assert not torch.equal(after[1]["conv1.weight"], base["conv1.weight"]), "every layer trains from epoch 1"
    assert metrics(copy / "runs" / "finetune")[0]["world_size"] == 2


@pytest.mark.recipes
@pytest.mark.slow
def test_the_best_weights_by_another_figure(tmp_path: Path) -> None:
    copy, _ = recipe_in_a_copy("The best weights by another figure", tmp_path)
    out = copy / "runs" / "by_loss"
    lowest = min(metrics(out), key=lambda line: (line["val_loss"], -line["epoch"]))["epoch"]
    best = torch.load(out / "weights" / "best.pth", weights_only=True)
    epoch = torch.load(out / "weights" / f"model-{lowest}.pth", weights_only=True)
    assert all(torch.equal(best[name], epoch[name]) for name in best)
    assert torch.load(out / "checkpoint.pth", weights_only=True)["best"]["metric"] == "val_loss"


@pytest.mark.recipes
@pytest.mark.slow
def test_the_optimizer_and_the_schedule(tmp_path: Path) -> None:
    copy, _ = recipe_in_a_copy("The optimizer and the schedule", tmp_path)
    adamw = torch.load(copy / "runs" / "adamw" / "checkpoint.pth", weights_only=True)
    assert [group["weight_decay"] for group in adamw["optimizer"]["param_groups"]] == [0.05, 0.0]
    assert "exp_avg" in next(iter(adamw["optimizer"]["state"].values())), "AdamW's own state"
    rmsprop = torch.load(copy / "runs" / "rmsprop" / "checkpoint.pth", weights_only=True)
    assert "square_avg" in next(iter(rmsprop["optimizer"]["state"].values()))


@pytest.mark.recipes
@pytest.mark.slow
def test_find_the_learning_rate(tmp_path: Path) -> None:
    """Per-process lrs from 1e-6, on one process and under torchrun with accumulation, the step's own scaled by
    2 processes x 2 batches; a suggestion inside the range tried; nothing written."""
    copy, (one, two) = recipe_in_a_copy("Find the learning rate", tmp_path)
    for result, scale in ((one, "1 times larger: 1 process(es) x 1"), (two, "4 times larger: 2 process(es) x 2")):
        tried = [float(lr) for lr in re.findall(r"^  --lr (\S+)  loss ", result.stdout, re.MULTILINE)]
        assert tried[0] == pytest.approx(1e-6) and tried == sorted(tried)
        said = rf"^Suggested: --lr (\S+) \(of one process's batch; the scripts take steps {re.escape(scale)}"
        (suggested,) = re.findall(said, result.stdout, re.MULTILINE)
        assert 1e-7 <= float(suggested) <= 0.1
    assert not (copy / "output").exists() and not (copy / "runs").exists()


@pytest.mark.recipes
@pytest.mark.slow
def test_a_figure_of_every_step(tmp_path: Path) -> None:
    copy, _ = recipe_in_a_copy("A figure of every step", tmp_path)
    events = EventAccumulator(str(copy / "runs" / "norms" / "tensorboard"))
    events.Reload()
    norms = events.Scalars("step/grad_norm")
    assert [point.step for point in norms] == [10] and norms[0].value > 0


@pytest.mark.recipes
@pytest.mark.slow
def test_a_metric_of_your_own(tmp_path: Path) -> None:
    """Top-5 accuracy: in metrics.jsonl and TensorBoard after two processes trained and validated, and in
    --eval-only's JSON on one process the same as the two processes' validation of the same weights."""
    copy, _ = recipe_in_a_copy("A metric of your own", tmp_path)
    out = copy / "runs" / "top5"
    assert metrics(out)[-1]["world_size"] == 2 and 0 < metrics(out)[-1]["val_top5_acc"] <= 1.0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "val_top5_acc" in events.Tags()["scalars"]
    one = run([sys.executable, str(copy / "train_multi_gpu_using_launch.py"), "--output-dir", str(out), "--model",
               "resnet18", "--eval-only"], cwd=copy, timeout=240)
    figures = json.loads(one.stdout.strip().splitlines()[-1])
    best = max(metrics(out), key=lambda line: (line["val_acc"], line["epoch"]))  # validated on two processes
    assert figures["val_top5_acc"] == best["val_top5_acc"] and figures["val_correct"] == best["val_correct"]


@pytest.mark.recipes
@pytest.mark.slow
def test_the_engine_in_a_script_of_your_own(tmp_path: Path) -> None:
    copy, results = recipe_in_a_copy("The engine in a script of your own", tmp_path)
    assert all(re.search(r"validation: \d+ of 128 right", result.stdout) for result in results)
    assert not (copy / "runs").exists() and not (copy / "output").exists(), "no run folder"


def minimal_copy(folder: Path) -> Path:
    """A copy with the optional features deleted as the recipe says: their modules, and the blocks importing them."""
    copy = copy_of_the_repository(folder)
    (removal,) = blocks("A minimal version to teach from", "bash")
    removed = [Path(word) for word in shlex.split(removal)[1:]]
    for module in removed:
        (copy / module).unlink()
    names = {module.stem for module in removed}
    for path in (copy / "multi_train_utils" / "features.py", copy / "utils.py"):
        remove_blocks_importing(path, names)
    leftovers = [f"{path.relative_to(copy)}: {line.strip()}" for path in copy.rglob("*.py")
                 if not {"tests", "bench"} & set(path.relative_to(copy).parts)
                 for line in path.read_text().splitlines()
                 if re.match(rf"^\s*(from|import) .*\b({'|'.join(names)})\b", line)]
    assert leftovers == [], "still wired"
    return copy


def test_every_recipe_applies_to_a_fresh_copy_and_the_minimal_version_leaves_nothing_wired(tmp_path: Path) -> None:
    """What the runs below need first, checked in seconds: each diff applies, and the deleted modules are
    imported nowhere."""
    copy = copy_of_the_repository(tmp_path / "repo")
    problems = [diff_problem(recipe, copy, check=True) for recipe in RECIPES]
    stale = [problem for problem in problems if problem]
    assert stale == [], f"{len(stale)} recipe(s) to update:\n" + "\n".join(stale)
    minimal_copy(tmp_path / "minimal")


def test_every_recipe_whose_diff_no_longer_matches_is_named(tmp_path: Path) -> None:
    """An edit that several recipes' diffs touch names each of them at once, not the first alone."""
    copy = copy_of_the_repository(tmp_path / "repo")
    (copy / "model.py").write_text('"""A model of my own."""\n')
    named = [recipe for recipe in RECIPES if diff_problem(recipe, copy, check=True)]
    touching = [recipe for recipe in RECIPES if any("+++ b/model.py" in diff for diff in blocks(recipe, "diff"))]
    assert len(touching) >= 2 and named == touching


@pytest.mark.recipes
@pytest.mark.slow
def test_a_minimal_version_to_teach_from_trains_under_every_launcher(tmp_path: Path) -> None:
    """The optional features deleted: each launcher still trains."""
    copy = minimal_copy(tmp_path / "repo")
    two = ["--standalone", "--nproc_per_node=2"]
    starts = {"single": [sys.executable, "train_single_gpu.py"],
              "torchrun": [*PROGRAMS["torchrun"], *two, "train_multi_gpu_using_launch.py"],
              "spawn": [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", "2"]}
    for launcher, start in starts.items():
        result = run([*start, "--model", "resnet18", "--epochs", "1", "--output-dir", f"runs/{launcher}"], cwd=copy,
                     timeout=240)
        assert result.returncode == 0, f"{launcher}\n{result.stderr[-3000:]}"
        assert [line["epoch"] for line in metrics(copy / "runs" / launcher)] == [0]


def remove_blocks_importing(path: Path, modules: set[str]) -> None:
    """Delete each `if` block of `path` whose body imports one of `modules` (what the recipe asks for)."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    doomed = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.If) and any(isinstance(inner, ast.ImportFrom) and inner.module.split(".")[-1] in modules
                                            for inner in ast.walk(node)):
            doomed |= set(range(node.lineno - 1, node.end_lineno))
    path.write_text("".join(line for index, line in enumerate(lines) if index not in doomed))
