"""A whole single-process run on small image files: it learns, and writes everything it should."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest
import torch

import train_single_gpu
import utils
from conftest import REPO, TINY_FLAGS, make_image_folder, python, run, run_single_in_this_process, write_image
from model import create_model
from multi_train_utils.cli import parse_args
from multi_train_utils.errors import UserInputError

METRIC_KEYS = {"epoch", "train_loss", "val_loss", "val_acc", "val_correct", "val_total", "lr", "images_per_s",
               "epoch_time_s", "world_size", "confusion_matrix", "per_class"}


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_learns_and_writes_every_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = make_image_folder(tmp_path / "images", {"red": 20, "green": 20, "blue": 20})
    out = tmp_path / "run"
    args = parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                 "--epochs", "4", "--lr", "0.002", "--batch-size", "8"])
    train_single_gpu.main(args)
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1, 2, 3]
    assert all(set(m) >= METRIC_KEYS for m in metrics), "every figure the SPEC names (and any added)"
    assert metrics[-1]["train_loss"] < 0.7 * metrics[0]["train_loss"]
    assert metrics[-1]["val_total"] == 12 and metrics[-1]["world_size"] == 1
    assert metrics[-1]["val_acc"] == metrics[-1]["val_correct"] / 12
    assert metrics[0]["lr"] == 0.002 and metrics[1]["lr"] < 0.002, "the lr used in each epoch, not the next one's"
    assert json.loads((out / "class_indices.json").read_text()) == {"0": "blue", "1": "green", "2": "red"}
    state = torch.load(out / "weights" / "model-3.pth", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    create_model("resnet18", 3).load_state_dict(state)
    assert (out / "weights" / "best.pth").is_file() and (out / "checkpoint.pth").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    best = max(metrics, key=lambda m: (m["val_acc"], m["epoch"]))  # a tie goes to the later epoch
    said = capsys.readouterr().out.splitlines()[-2:]  # the run ends by saying what it left and what to run next
    assert said[0] == (f"Finished: the best epoch by val_acc was {best['epoch']} ({best['val_acc']:.4g}); its "
                       f"weights are {out / 'weights' / 'best.pth'}")
    assert said[1].startswith("Next: the same command with --eval-only evaluates them again; python predict.py "
                              f"--run {out} IMAGE... classifies images; tensorboard --logdir {out} draws the curves")


def test_the_demo_data_is_written_and_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(utils, "DEMO_ROOT", tmp_path / "demo")
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--output-dir", str(out), *TINY_FLAGS, "--batch-size", "32"]))
    assert "built-in demo data" in capsys.readouterr().out
    assert read_metrics(out)[0]["val_total"] > 0
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == ["checks", "dots", "grid", "rings", "stripes"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--num_classes", "5"], "--num_classes 5: the data in"),
    (["--batch-size", "64"], "--batch-size 64: larger than the 24 training images"),
    (["--model", "resnet35"], "--model 'resnet35'"),
])
def test_bad_input_is_one_line_naming_the_flag(image_folder: Path, tmp_path: Path, extra: list[str],
                                               message: str) -> None:
    result = run_single_in_this_process(["--data-path", str(image_folder), "--output-dir", str(tmp_path / "run"),
                                         *TINY_FLAGS, *extra])
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: {message}"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing is written before the input is known to be good"


def test_scripts_run_from_any_working_directory(image_folder: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run([python(), str(REPO / "train_single_gpu.py"), "--data-path", str(image_folder),
                  "--output-dir", "relative_out", *TINY_FLAGS], cwd=elsewhere, timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_metrics(elsewhere / "relative_out")[0]["epoch"] == 0


def test_a_messy_folder_trains(tmp_path: Path) -> None:
    """What real folders hold: grayscale files, every extension case, stray files, a licence at the top."""
    root = make_image_folder(tmp_path / "messy", {"cat": 8, "dog": 8})
    for i, name in enumerate(["a.PNG", "b.jpeg", "c.JPG", "d.Jpeg"]):
        write_image(root / ("cat" if i % 2 else "dog") / name, (120, 120, 120), mode="L")
    (root / "cat" / "notes.txt").write_text("taken in the garden")
    (root / "dog" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "LICENSE").write_text("CC-BY 4.0")
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(root), "--output-dir", str(out), *TINY_FLAGS]))
    metrics = read_metrics(out)[0]
    assert metrics["val_total"] == 2 * 2  # every class of 10 images gives 2 to validation
    assert len(torch.load(out / "weights" / "model-0.pth", weights_only=True)) > 0


def code_of(script: str) -> list[str]:
    """A script's functions (its docstring says how to start it; its imports follow from its code)."""
    lines = (REPO / script).read_text().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("def ")):]


def test_the_two_multi_process_scripts_differ_only_in_how_they_start() -> None:
    launch, spawn = code_of("train_multi_gpu_using_launch.py"), code_of("train_multi_gpu_using_spawn.py")
    changed = [line for line in difflib.unified_diff(launch, spawn, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 20, "\n".join(changed)
    train = slice(launch.index("def train(args: RunConfig, ctx: DistContext) -> None:"), None)
    assert launch[train][:-3] == spawn[spawn.index(launch[train][0]):][:-3], "train() must be the same"


def test_a_read_only_checkout_keeps_the_demo_data_in_the_users_cache(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    real_mkdtemp = utils.tempfile.mkdtemp

    def read_only_checkout(prefix: str, dir: Path) -> str:
        if checkout in Path(dir).parents or Path(dir) == checkout / "data":
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkdtemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(utils.tempfile, "mkdtemp", read_only_checkout)
    monkeypatch.setattr(utils, "DEMO_ROOT", checkout / "data" / "demo_patterns")
    monkeypatch.setattr(utils, "DEMO_CACHE_ROOT", tmp_path / "cache" / "demo_patterns")
    assert utils.ensure_demo_data() == tmp_path / "cache" / "demo_patterns"
    monkeypatch.setattr(utils, "DEMO_CACHE_ROOT", checkout / "data" / "cache")
    with pytest.raises(UserInputError, match=r"^the demo data can be written neither to .* train on a folder of "
                                             r"your images with --data-path$"):
        utils.ensure_demo_data()
