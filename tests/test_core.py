"""A core you can see: the step a few calls from main(), the loop that runs without any feature attached, and
the engine's modules each of one concern."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

import multi_train_utils
import train_multi_gpu_using_launch
import train_single_gpu
from conftest import REPO, TINY_FLAGS
from multi_train_utils import features
from multi_train_utils.cli import parse_args
from multi_train_utils.train_eval_utils import train_one_epoch

MAX_OWN_FRAMES = 4  # from the entry script's own function down to the one that calls optimizer.step()
MAX_LOOP_LINES = 60


def own_frames_at_the_first_step(script: object, launcher: str, data: Path, out: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The repository's functions on the stack when the first optimizer step runs, from the entry script's
    own function down, as "file:function"."""
    stacks: list[list[str]] = []

    def record(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not stacks:
            frames = [frame for frame in inspect.stack() if Path(frame.filename).is_relative_to(REPO)
                      and Path(frame.filename).relative_to(REPO).parts[0] not in (".venv", "tests")]
            stacks.append([f"{Path(frame.filename).relative_to(REPO)}:{frame.function}"
                           for frame in reversed(frames)])

    handle = register_optimizer_step_pre_hook(record)
    try:
        script.main(parse_args(launcher, ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS]))
    finally:
        handle.remove()
    entry = Path(script.__file__).name
    first = next(i for i, frame in enumerate(stacks[0]) if frame.startswith(f"{entry}:"))
    return stacks[0][first:]


def test_the_first_optimizer_step_is_a_few_calls_from_main(image_folder: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    single = own_frames_at_the_first_step(train_single_gpu, "single", image_folder, tmp_path / "single", monkeypatch)
    assert single == ["train_single_gpu.py:main", "multi_train_utils/fit.py:fit",
                      "multi_train_utils/train_eval_utils.py:train_one_epoch"]
    launch = own_frames_at_the_first_step(train_multi_gpu_using_launch, "launch", image_folder, tmp_path / "launch",
                                          monkeypatch)
    assert launch == ["train_multi_gpu_using_launch.py:main", "train_multi_gpu_using_launch.py:train",
                      "multi_train_utils/fit.py:fit", "multi_train_utils/train_eval_utils.py:train_one_epoch"]
    assert max(len(single), len(launch)) <= MAX_OWN_FRAMES


def test_the_loop_with_its_step_fits_on_one_screen() -> None:
    assert len(inspect.getsource(train_one_epoch).splitlines()) <= MAX_LOOP_LINES


def test_the_loop_runs_with_no_hook_attached() -> None:
    """The tutorial's call, nothing else: a model, an optimizer, a loader, the device, the epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    before = model[1].weight.detach().clone()
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 2, 2), torch.randint(0, 3, (8,))), batch_size=4)
    loss = train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, torch.device("cpu"), 0)
    assert loss > 0 and not torch.equal(before, model[1].weight)


def test_a_run_trains_with_no_feature_attached(image_folder: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With features.py's list empty, a run trains, validates and writes its metrics, weights and checkpoint;
    what the features wrote (TensorBoard) is not there."""
    monkeypatch.setattr(features, "FEATURES", ())
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(image_folder), "--output-dir", str(out),
                                                *TINY_FLAGS, "--epochs", "2"]))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1] and lines[-1]["val_total"] == 6
    assert (out / "weights" / "best.pth").is_file() and (out / "checkpoint.pth").is_file()
    assert not (out / "tensorboard").exists()


def test_each_module_of_the_engine_is_listed_with_its_concern() -> None:
    """The package's docstring names every module once, with the concern it holds."""
    listed = multi_train_utils.__doc__
    modules = sorted(path.stem for path in Path(multi_train_utils.__file__).parent.glob("*.py")
                     if path.stem != "__init__")
    assert [module for module in modules if not re.search(rf"\b{module}\b", listed)] == []
