"""Resume means one thing: a resumed run is the run its checkpoint saved. Each flag given again with another value
is refused, applied from the resumed step on (and said, and recorded), or this command's alone, by one table
(config.ON_RESUME); a folder holds one run, and a rewind sets the later timeline aside; every figure written is a
number."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

import predict
import train_single_gpu
from conftest import TINY_FLAGS, make_image_folder, run_single_in_this_process
from multi_train_utils.cli import get_args_parser, parse_args
from multi_train_utils.config import (
    APPLIED,
    BOUND,
    THIS_COMMAND,
    applied_changes,
    field_names,
    flag_name,
    rule_of,
    shown,
)
from multi_train_utils.errors import UserInputError
from multi_train_utils.optim import cosine
from multi_train_utils.train_eval_utils import EvalResult

FLAGS = [*TINY_FLAGS, "--epochs", "2", "--lr", "0.001"]  # 24 training images in batches of 4: 6 steps an epoch
STEPS = 6

# Each flag's value in the saved run, and another given on resume (as typed, and as parsed).
CHANGED = {
    "data_path": ("old/images", "new/images", "new/images"), "num_classes": (None, "3", 3),
    "image_size": (32, "64", 64), "workers": (0, "1", 1), "decode_on": ("cpu", "gpu", "gpu"), "seed": (0, "1", 1),
    "epochs": (16, "20", 20), "batch_size": (32, "16", 16), "lr": (0.002, "0.05", 0.05),
    "opt": ("sgd", "adamw", "adamw"), "weight_decay": (None, "0.5", 0.5), "sched": ("cosine", "step", "step"),
    "lrf": (0.1, "0.2", 0.2), "warmup_epochs": (0, "1", 1), "model": ("resnet18", "resnet34", "resnet34"),
    "weights": ("", "start.pth", "start.pth"), "freeze_layers": (False, "true", True),
    "unfreeze_epoch": (None, "2", 2), "device": ("auto", "cpu", "cpu"), "label_smoothing": (0.0, "0.1", 0.1),
    "mixup_alpha": (0.0, "0.2", 0.2), "cutmix_alpha": (0.0, "1.0", 1.0), "clip_grad_norm": (None, "1.0", 1.0),
    "model_ema": (False, "true", True), "model_ema_decay": (0.999, "0.99", 0.99), "amp": ("off", "bf16", "bf16"),
    "channels_last": (False, "true", True), "compile": (False, "true", True), "accum_steps": (1, "2", 2),
    "output_dir": ("old/run", "new/run", "new/run"), "save_every": (1, "2", 2),
    "keep_epoch_weights": (True, "false", False), "best_metric": ("val_acc", "val_loss", "val_loss"),
    "checkpoint_every_steps": (None, "5", 5), "checkpoint_every_minutes": (None, "2", 2.0),
    "stop_grace": (20.0, "5", 5.0), "keep_checkpoints": (1, "3", 3), "resume": ("old/run/checkpoint.pth", None, None),
    "eval_only": (False, "true", True), "syncBN": (False, "true", True), "bucket_cap_mb": (25.0, "50", 50.0),
    "comm_hook": ("none", "bf16", "bf16"), "dist_url": ("env://", "tcp://127.0.0.1:29500", "tcp://127.0.0.1:29500"),
    "dist_timeout": (900.0, "60", 60.0), "world_size": (2, "3", 3), "local_rank": (None, "1", 1),
    "check_collectives": (False, "true", True),
}
LAUNCHER = {"world_size": "spawn", "local_rank": "launch", "syncBN": "launch", "bucket_cap_mb": "launch",
            "comm_hook": "launch", "dist_url": "launch", "dist_timeout": "launch",
            "check_collectives": "launch"}
SAVED_WITH = {"unfreeze_epoch": {"freeze_layers": True}}  # what the saved run needs for the value to be valid


def saved_run(tmp_path: Path, name: str) -> tuple[Path, dict]:
    """A checkpoint whose run trained with `name` at its saved value in CHANGED."""
    launcher = LAUNCHER.get(name, "single")
    flags = parse_args(launcher, ["--data-path", "old/images", "--output-dir", "old/run"]).as_saved()
    flags |= {name: CHANGED[name][0], **SAVED_WITH.get(name, {})}
    path = tmp_path / "checkpoint.pth"
    torch.save({"epoch": 0, "args": flags}, path)
    return path, flags


def test_every_flag_has_its_rule_its_name_and_a_case_here() -> None:
    assert set(CHANGED) == set(field_names())
    assert {rule_of(name)[0] for name in field_names()} == {BOUND, APPLIED, THIS_COMMAND}
    parser = get_args_parser("every")
    assert {action.dest: action.option_strings[0] for action in parser._actions if action.dest != "help"} == {
        name: flag_name(name) for name in field_names()}


@pytest.mark.parametrize("name", field_names())
def test_a_flag_given_again_is_refused_applied_or_this_commands_by_its_rule(name: str, tmp_path: Path) -> None:
    path, saved = saved_run(tmp_path, name)
    _, text, value = CHANGED[name]
    argv = ["--resume", str(path)] + ([flag_name(name), text] if text is not None else [])
    rule = rule_of(name)[0]
    if rule == BOUND:
        with pytest.raises(UserInputError) as refused:
            parse_args(LAUNCHER.get(name, "single"), argv)
        assert str(refused.value).startswith(f"{flag_name(name)} {shown(value)}: the run trained with "
                                             f"{flag_name(name)} {shown(saved[name])}, and a run keeps it (")
        return
    config = parse_args(LAUNCHER.get(name, "single"), argv)
    assert getattr(config, name) == (str(path) if name == "resume" else value)
    changes = applied_changes(config, saved)
    assert changes == ([f"{flag_name(name)} {shown(saved[name])} -> {shown(value)}"] if rule == APPLIED else [])


@pytest.mark.parametrize("name", [name for name in field_names() if name != "resume"])
def test_a_flag_not_given_again_keeps_the_runs_value_unless_it_is_this_commands(name: str, tmp_path: Path) -> None:
    path, saved = saved_run(tmp_path, name)
    launcher = LAUNCHER.get(name, "single")
    config = parse_args(launcher, ["--resume", str(path)])
    fresh = parse_args(launcher, ["--data-path", "old/images"])  # the defaults, on a data folder as the run's
    expected = fresh if rule_of(name)[0] == THIS_COMMAND else dataclasses.replace(fresh, **{name: saved[name]})
    assert getattr(config, name) == getattr(expected, name)
    assert applied_changes(config, saved) == []


# ---- the changes, really applied --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("rules") / "images", {"red": 10, "green": 10, "blue": 10})


def train(data: Path, out: Path, *extra: str) -> None:
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *FLAGS, *extra]))


def resume(out: Path, *extra: str) -> None:
    """A resume as a user types it: the folder and what changes, nothing else."""
    train_single_gpu.main(parse_args("single", ["--output-dir", str(out), "--resume", "auto", *extra]))


def strict_lines(path: Path) -> list[dict]:
    """metrics.jsonl read by a strict parser: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_epochs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 2 epochs at lr 0.001, with a checkpoint at every third step (the last of each epoch too)."""
    out = tmp_path_factory.mktemp("two_epochs") / "run"
    train(data, out, "--checkpoint-every-steps", "3", "--keep-checkpoints", "10")
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run", copy_function=shutil.copy2)
    (tmp_path / "run" / ".lock").unlink()
    return tmp_path / "run"


def test_a_new_lr_weight_decay_and_epochs_are_applied_from_the_resumed_step_and_recorded(
        two_epochs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = copy_of(two_epochs, tmp_path)
    resume(out, "--lr", "0.05", "--weight-decay", "0.5", "--epochs", "3")
    said = capsys.readouterr().out
    assert ("Changed on resume, applied from here on and kept in the checkpoints: --epochs 2 -> 3, --lr 0.001 -> "
            "0.05, --weight-decay unset -> 0.5\n") in said
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (saved["args"]["lr"], saved["args"]["weight_decay"], saved["args"]["epochs"]) == (0.05, 0.5, 3)
    decayed, plain = saved["optimizer"]["param_groups"]
    assert (decayed["initial_lr"], decayed["weight_decay"], plain["weight_decay"]) == (0.05, 0.5, 0.0)
    # The first resumed step trained at the new schedule's lr: 3 epochs of 6 steps, at step 12 of 18.
    lines = strict_lines(out / "metrics.jsonl")
    assert [line["epoch"] for line in lines] == [0, 1, 2]
    assert lines[2]["lr"] == pytest.approx(0.05 * cosine(12 / 18, 0.1))
    assert decayed["lr"] == pytest.approx(0.05 * cosine(1.0, 0.1))


def test_a_larger_epochs_alone_stretches_the_schedule_from_the_first_resumed_step(two_epochs: Path,
                                                                                 tmp_path: Path) -> None:
    out = copy_of(two_epochs, tmp_path)
    resume(out, "--epochs", "3")
    lines = strict_lines(out / "metrics.jsonl")
    assert lines[2]["lr"] == pytest.approx(0.001 * cosine(12 / 18, 0.1)), "not 1e-4, the 2-epoch schedule's end"
    assert lines[1]["lr"] == pytest.approx(0.001 * cosine(6 / 12, 0.1)), "the epochs before are the run's"


def test_the_same_command_again_changes_nothing_and_says_nothing(two_epochs: Path, data: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = copy_of(two_epochs, tmp_path)
    train(data, out, "--resume", "auto")
    said = capsys.readouterr().out
    assert "Changed on resume" not in said
    assert "Nothing to train: 2 epoch(s) trained already; a larger --epochs than 2 goes on" in said


def data_of(run: Path) -> Path:
    return Path(torch.load(run / "checkpoint.pth", weights_only=True)["args"]["data_path"])


# ---- a folder holds one run -------------------------------------------------------------------------------------

def test_another_runs_checkpoint_is_refused_in_a_folder_that_holds_a_run(two_epochs: Path, data: Path,
                                                                         tmp_path: Path) -> None:
    other_data = make_image_folder(tmp_path / "two_classes", {"a": 10, "b": 10})
    train(other_data, tmp_path / "other", "--epochs", "1")
    out = copy_of(two_epochs, tmp_path)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    result = run_single_in_this_process(["--resume", str(tmp_path / "other" / "checkpoint.pth"),
                                         "--output-dir", str(out)])
    assert result.returncode == 2
    assert result.stderr.startswith("error: --resume ") and len(result.stderr.splitlines()) == 1
    assert result.stderr.endswith(" holds a run of its own, which goes on only from its own checkpoints; resume "
                                  "into another --output-dir, or continue that run with --resume auto\n")
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and path.name != ".lock"} == before


def test_another_runs_checkpoint_goes_on_in_a_new_folder_with_its_history(two_epochs: Path, tmp_path: Path) -> None:
    resume_into = tmp_path / "new"
    train_single_gpu.main(parse_args("single", ["--resume", str(two_epochs / "checkpoints" / "epoch-0-end.pth"),
                                                "--output-dir", str(resume_into)]))
    lines = strict_lines(resume_into / "metrics.jsonl")
    assert lines[0] == strict_lines(two_epochs / "metrics.jsonl")[0] and [m["epoch"] for m in lines] == [0, 1]


def test_a_rewind_keeps_its_point_and_sets_the_later_timeline_aside(two_epochs: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = copy_of(two_epochs, tmp_path)
    later = torch.load(out / "checkpoint.pth", weights_only=True)
    rewind_point = out / "checkpoints" / "epoch-0-end.pth"
    train_single_gpu.main(parse_args("single", ["--output-dir", str(out), "--resume", str(rewind_point),
                                                "--label-smoothing", "0.2", "--checkpoint-every-steps", "3",
                                                "--keep-checkpoints", "10"]))
    aside = out / "abandoned" / "after-epoch-0-end"
    assert (f"Rewound the run to epoch-0-end: what it wrote after (checkpoint.pth, checkpoints/epoch-1-step-3.pth, "
            "checkpoints/epoch-1-step-6.pth, weights/best.pth, weights/model-1.pth, 1 line(s) of metrics.jsonl) is "
            f"set aside in {aside}; it goes on from there\n") in capsys.readouterr().out
    assert rewind_point.is_file(), "the point rewound to is kept"
    # The abandoned timeline, whole: its checkpoints (by their flags), its weights, its epochs.
    assert torch.equal(torch.load(aside / "checkpoint.pth", weights_only=True)["model"]["fc.weight"],
                       later["model"]["fc.weight"])
    old = torch.load(aside / "checkpoints" / "epoch-1-step-3.pth", weights_only=True)
    assert old["args"]["label_smoothing"] == 0.0 and (aside / "weights" / "model-1.pth").is_file()
    assert [line["epoch"] for line in strict_lines(aside / "metrics.jsonl")] == [1]
    # The new timeline wrote the same names, which never met the old one's files; metrics.jsonl holds one timeline.
    new = torch.load(out / "checkpoints" / "epoch-1-step-3.pth", weights_only=True)
    assert new["args"]["label_smoothing"] == 0.2
    assert [line["epoch"] for line in strict_lines(out / "metrics.jsonl")] == [0, 1]


def test_a_point_after_the_folders_own_is_refused_there(two_epochs: Path, tmp_path: Path) -> None:
    out = copy_of(two_epochs, tmp_path)
    rewind_point = out / "checkpoints" / "epoch-0-end.pth"
    train_single_gpu.main(parse_args("single", ["--output-dir", str(out), "--resume", str(rewind_point)]))
    result = run_single_in_this_process(["--output-dir", str(out), "--resume",
                                         str(out / "abandoned" / "after-epoch-0-end" / "checkpoint.pth")])
    assert result.returncode == 2 and "holds a run of its own, which goes on only from its own" in result.stderr


# ---- every figure is a number -----------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["at the epoch's last step", "with a batch larger than what is left"])
def test_a_resumed_epoch_with_no_batch_left_reports_the_saved_loss(two_epochs: Path, tmp_path: Path, how: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    point, extra = (("epoch-1-step-6", []) if how.startswith("at") else ("epoch-1-step-3", ["--batch-size", "16"]))
    saved = torch.load(two_epochs / "checkpoints" / f"{point}.pth", weights_only=True)["progress"]
    train_single_gpu.main(parse_args("single", ["--resume", str(two_epochs / "checkpoints" / f"{point}.pth"),
                                                "--output-dir", str(tmp_path / "run"), *extra]))
    line = strict_lines(tmp_path / "run" / "metrics.jsonl")[1]
    assert line["train_loss"] == pytest.approx(saved["loss_sum"] / saved["samples_seen"])
    if how.startswith("at"):  # the whole epoch, as the unbroken run counted it
        assert line["train_loss"] == pytest.approx(strict_lines(two_epochs / "metrics.jsonl")[1]["train_loss"])
    assert "nan" not in capsys.readouterr().out


def test_weights_with_a_validation_loss_that_is_not_finite_are_never_written(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train(data, tmp_path / "run", "--epochs", "1")
    monkeypatch.setattr(EvalResult, "loss", property(lambda self: math.nan))
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    result = run_single_in_this_process(["--output-dir", str(tmp_path / "run"), "--resume", "auto", "--epochs", "2"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: epoch 1: val_loss became nan: the weights have diverged, so training "
                                    "stopped without writing them; the last checkpoint written is kept")
    after = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    assert {path: after[path] for path in before if path.parent.name != "tensorboard"} == {
        path: content for path, content in before.items() if path.parent.name != "tensorboard"}


def test_diverged_weights_are_named_by_eval_only_and_predict(data: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    train(data, tmp_path / "run", "--epochs", "1")
    best = tmp_path / "run" / "weights" / "best.pth"
    torch.save({name: torch.full_like(value, math.nan) if value.is_floating_point() else value
                for name, value in torch.load(best, weights_only=True).items()}, best)
    result = run_single_in_this_process(["--output-dir", str(tmp_path / "run"), "--eval-only"])
    assert result.returncode == 2 and result.stderr.startswith("error: --eval-only: the validation loss of these "
                                                               "weights is nan: they have diverged")
    for as_json in ([], ["--json"]):
        with pytest.raises(UserInputError, match=rf"^--weights {re.escape(str(best))}: gives NaN for .*: these "
                                                 "weights have diverged"):
            predict.main(["--run", str(tmp_path / "run"), str(data / "red"), *as_json])
    assert "nan" not in capsys.readouterr().out.lower()


# ---- what a resume says ----------------------------------------------------------------------------------------

def test_a_resume_finds_the_runs_data_and_says_what_is_there_to_train(two_epochs: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = copy_of(two_epochs, tmp_path)
    resume(out, "--epochs", "1")
    said = capsys.readouterr().out
    assert "built-in demo data" not in said and f"{data_of(out)}: 3 classes" in said
    assert "Nothing to train: 2 epoch(s) trained already; a larger --epochs than 1 goes on" in said
    result = run_single_in_this_process(["--output-dir", str(out), "--eval-only"])
    assert result.returncode == 0 and "built-in demo data" not in result.stdout


def test_unfreezing_after_the_last_epoch_is_refused() -> None:
    with pytest.raises(UserInputError, match=r"^--unfreeze-epoch 5: must be below --epochs 1"):
        parse_args("single", ["--freeze-layers", "--unfreeze-epoch", "5", "--epochs", "1"])


@pytest.mark.parametrize(("key", "said"), [
    ("rng", "holds no random states (an older or hand-made checkpoint): the random augmentations are drawn anew"),
    ("split", "holds no split (an older or hand-made checkpoint): the validation images are drawn again from "
              "--data-path with --seed 0"),
    ("args", "holds no flags (an older or hand-made checkpoint): this command's flags and their defaults are "
             "taken as the run's"),
])
def test_a_checkpoint_without_a_part_resumes_and_says_what_that_costs(two_epochs: Path, data: Path, tmp_path: Path,
                                                                       key: str, said: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = copy_of(two_epochs, tmp_path)
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    del checkpoint[key]
    torch.save(checkpoint, out / "checkpoint.pth")
    resume(out, "--data-path", str(data), *FLAGS, "--epochs", "3")  # the run's flags: without args, nothing says them
    assert said in capsys.readouterr().out
    assert len(strict_lines(out / "metrics.jsonl")) == 3


def test_metrics_without_world_size_are_drawn_and_said(two_epochs: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    plot_runs = pytest.importorskip("plot_runs", reason="plot_runs.py draws with matplotlib (requirements-plot.txt)")
    out = tmp_path / "older"
    out.mkdir()
    lines = [{key: value for key, value in line.items() if key != "world_size"}
             for line in strict_lines(two_epochs / "metrics.jsonl")]
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    written = plot_runs.main([str(out), "--out-dir", str(tmp_path / "pictures")])
    assert len(written) == 4
    assert "its lines hold no world_size (written before they did): older is drawn without its number of " \
           "processes" in capsys.readouterr().err
