"""Using what a run trained: --eval-only gives the numbers of the epoch that saved the weights, on one process
or several; predict.py agrees with it on the same files; the averaged weights are saved and evaluated."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import predict
import train_single_gpu
from conftest import REPO, TINY_FLAGS, make_image_folder, python, run, torchrun
from multi_train_utils.cli import parse_args
from multi_train_utils.errors import UserInputError


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A two-epoch run with --model-ema, on 3 classes whose validation share is odd (5 images)."""
    root = tmp_path_factory.mktemp("trained")
    data = make_image_folder(root / "images", {"red": 12, "green": 12, "blue": 9})
    out = root / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                                "--epochs", "2", "--lr", "0.002", "--model-ema",
                                                "--model-ema-decay", "0.5"]))
    return data, out


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def eval_only(data: Path, out: Path, *extra: str, processes: int = 1) -> dict:
    flags = ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS, "--eval-only", *extra]
    script = str(REPO / ("train_single_gpu.py" if processes == 1 else "train_multi_gpu_using_launch.py"))
    launcher = [python()] if processes == 1 else [*torchrun(), "--standalone", f"--nproc_per_node={processes}"]
    result = run([*launcher, script, *flags], timeout=120)
    assert result.returncode == 0, result.stderr
    assert not re.search(r"[Tt]raining (in|on) ", result.stdout), "an evaluation does not say it trains"
    return json.loads(result.stdout.splitlines()[-1])


def test_every_epoch_records_a_confusion_matrix_summing_to_the_validation_count(trained: tuple[Path, Path]) -> None:
    split = json.loads((trained[1] / "split.json").read_text())
    counts = {name: sum(Path(relative).parts[0] == name for relative in split["val"]) for name in split["class_names"]}
    for line in metrics(trained[1]):
        assert line["val_total"] == 5 and sum(map(sum, line["confusion_matrix"])) == 5
        assert sum(line["confusion_matrix"][i][i] for i in range(3)) == line["val_correct"]
        assert {name: figures["count"] for name, figures in line["per_class"].items()} == counts
        assert "ema_val_acc" in line


@pytest.mark.parametrize("processes", [1, 2])
def test_eval_only_reproduces_the_epoch_that_saved_the_weights(trained: tuple[Path, Path], processes: int) -> None:
    data, out = trained
    lines = metrics(out)
    best = max(lines, key=lambda m: (m["val_acc"], m["epoch"]))  # best.pth: the last epoch of the best accuracy
    figures = eval_only(data, out, processes=processes)
    for key in ("val_correct", "val_total", "val_acc", "confusion_matrix", "per_class"):
        assert figures[key] == best[key], key
    assert figures["val_loss"] == pytest.approx(best["val_loss"], rel=1e-5)
    assert not (out / "metrics.jsonl").read_text().count("\n") > len(lines), "evaluating writes nothing"


def test_validating_or_resuming_keeps_the_model_and_image_size_the_run_trained_with(
        trained: tuple[Path, Path]) -> None:
    """Trained as resnet18 at 16 pixels, a run validated or resumed on data named with --data-path (whose
    defaults are resnet34 and 224) stays resnet18 at 16, as the same run validated without flags does; what is
    given is used."""
    data, out = trained
    common = ["--data-path", str(data), "--output-dir", str(out)]
    for args in (parse_args("single", [*common, "--eval-only"]), parse_args("launch", [*common, "--resume", "auto"])):
        assert (args.model, args.image_size) == ("resnet18", 16)
    given = parse_args("single", [*common, "--eval-only", "--image-size", "24", "--model", "resnet50"])
    assert (given.model, given.image_size) == ("resnet50", 24)
    new = parse_args("single", ["--data-path", str(data), "--output-dir", str(out / "new")])
    assert (new.model, new.image_size) == ("resnet34", 224)
    flags = [flag for flag in TINY_FLAGS if flag not in ("--image-size", "16", "--model", "resnet18")]
    result = run([python(), str(REPO / "train_single_gpu.py"), *common, *flags, "--eval-only"], timeout=120)
    assert result.returncode == 0, result.stderr
    best = max(metrics(out), key=lambda m: (m["val_acc"], m["epoch"]))
    assert json.loads(result.stdout.splitlines()[-1])["val_loss"] == pytest.approx(best["val_loss"], rel=1e-5)


def test_the_averaged_weights_are_saved_in_the_checkpoint_and_evaluated(trained: tuple[Path, Path]) -> None:
    data, out = trained
    lines = metrics(out)
    best_ema = max(lines, key=lambda m: (m["ema_val_acc"], m["epoch"]))
    saved = torch.load(out / "checkpoint.pth", weights_only=True)["ema"]
    assert saved["best"] == {"metric": "val_acc", "value": best_ema["ema_val_acc"], "epoch": best_ema["epoch"]}
    assert saved["averaged"]["n_averaged"] > 1
    figures = eval_only(data, out, "--weights", str(out / "weights" / "best_ema.pth"))
    assert figures["val_correct"] == best_ema["ema_val_correct"]


def test_predict_agrees_with_the_evaluation_on_the_same_files(trained: tuple[Path, Path], tmp_path: Path) -> None:
    data, out = trained
    split = json.loads((out / "split.json").read_text())  # the run's own validation images
    images = [str(data / relative) for relative in split["val"]]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a picture")
    result = run([python(), str(REPO / "predict.py"), "--run", str(out), "--json", "--top-k", "2",
                  *images, str(broken)], timeout=120)
    assert result.returncode == 1, "a file could not be read"
    assert result.stderr.strip() == (f"error: cannot read image {broken}: not an image (damaged, cut short, or "
                                     "another kind of file)"), "the file named once"
    predictions = [json.loads(line) for line in result.stdout.splitlines()]
    assert [p["image"] for p in predictions] == images, "every readable file, in order"
    assert all(len(p["top"]) == 2 and p["top"][0]["probability"] >= p["top"][1]["probability"] for p in predictions)
    correct = sum(p["top"][0]["class"] == Path(relative).parts[0]
                  for p, relative in zip(predictions, split["val"], strict=True))
    best = max(metrics(out), key=lambda m: (m["val_acc"], m["epoch"]))
    assert correct == best["val_correct"]


def test_predict_finds_the_run_of_its_weights_and_errs_in_one_line(trained: tuple[Path, Path]) -> None:
    data, out = trained
    image = str(next((data / "red").iterdir()))
    alone = run([python(), str(REPO / "predict.py"), "--weights", str(out / "weights" / "best_ema.pth"), image],
                timeout=120)
    assert alone.returncode == 0 and alone.stdout.startswith(image), alone.stderr
    best = out / "weights" / "best.pth"
    # How predict.py ends on a mistake, once as a user sees it: one line on stderr, and exit code 2.
    result = run([python(), str(REPO / "predict.py"), "--run", str(out), "--model", "resnet34", image], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: --weights {best}: does not fit resnet34 with 3 "), result.stderr
    assert len(result.stderr.splitlines()) == 1 and len(result.stderr) < 300, result.stderr
    empty = out.parent / "no_images"
    empty.mkdir()
    for argv, start in ([["--weights", "/nowhere/weights/best.pth", image],
                         "--weights /nowhere/weights/best.pth: the run it belongs to, /nowhere, has no"],
                        [["--run", str(out), str(empty)], f"no image in {empty} (nor in its sub-folders"],
                        [["--run", "", image], "argument --run: expected a path, got ''"],
                        [["--top-k", "0", image], "argument --top-k: must be at least 1"]):
        with pytest.raises(UserInputError, match=f"^{re.escape(start)}"):
            predict.main(argv)


def test_predict_writes_a_name_that_is_not_utf8_as_its_bytes(trained: tuple[Path, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where stdout refuses what is not UTF-8 (a UTF-8 locale), such a name would stop predict.py at its line."""
    data, out = trained
    latin1 = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.jpg"))
    shutil.copy(next((data / "red").iterdir()), latin1)
    written = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(written, encoding="utf-8", errors="strict"))
    assert predict.main(["--run", str(out), str(latin1)]) == 0
    sys.stdout.flush()
    assert written.getvalue().startswith(os.fsencode(latin1) + b"  ")
