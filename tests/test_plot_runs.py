"""plot_runs.py draws the curves of several runs from their metrics.jsonl files."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("matplotlib", reason="plot_runs.py draws with matplotlib (requirements-plot.txt)")

import plot_runs
from conftest import REPO
from multi_train_utils.errors import UserInputError


def write_run(folder: Path, world_size: int, accuracies: list[float], torn_last_line: bool = False) -> Path:
    """A metrics.jsonl as a run writes it; optionally with the half line a killed run leaves."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"epoch": epoch, "train_loss": 1.0 - acc / 2, "val_loss": 1.1 - acc / 2, "val_acc": acc,
                         "val_correct": round(acc * 120), "val_total": 120, "lr": 0.002 * world_size,
                         "images_per_s": 40.0 * world_size ** 0.5, "epoch_time_s": 12.0 / world_size ** 0.5,
                         "world_size": world_size})
             for epoch, acc in enumerate(accuracies)]
    if torn_last_line:
        lines.append('{"epoch": 3, "train_lo')
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def two_runs(tmp_path: Path) -> list[str]:
    return [str(write_run(tmp_path / "single", 1, [0.3, 0.7, 0.9])),
            str(write_run(tmp_path / "ddp2", 2, [0.25, 0.65, 0.92], torn_last_line=True))]


def test_draws_accuracy_loss_and_epoch_time_of_every_run(two_runs: list[str], tmp_path: Path) -> None:
    written = plot_runs.main([*two_runs, "--out-dir", str(tmp_path / "docs"), "--prefix", "cpu_"])
    assert [p.name for p in written] == ["cpu_accuracy.png", "cpu_loss.png", "cpu_epoch_time.png"]
    for path in written:
        with Image.open(path) as picture:
            assert picture.format == "PNG" and picture.width > 400


def test_each_run_is_one_curve_with_its_process_count(two_runs: list[str]) -> None:
    runs = [plot_runs.read_run(folder) for folder in two_runs]
    assert [run.label for run in runs] == ["single (1 process)", "ddp2 (2 processes)"]
    assert len(runs[1].metrics) == 3, "the half-written last line is skipped"
    accuracy = plot_runs.plot_accuracy(runs).axes[0]
    assert [line.get_label() for line in accuracy.lines] == ["single (1 process)", "ddp2 (2 processes)"]
    assert list(accuracy.lines[1].get_ydata()) == [0.25, 0.65, 0.92]
    assert len(plot_runs.plot_loss(runs).axes[0].lines) == 4, "train and validation loss of each run"
    bars = plot_runs.plot_epoch_time(runs).axes[0].patches
    assert [round(bar.get_height(), 2) for bar in bars] == [12.0, round(12.0 / 2 ** 0.5, 2)]


def test_labels_name_the_runs(two_runs: list[str]) -> None:
    args = plot_runs.parse_args([*two_runs, "--labels", "one", "two"])
    assert plot_runs.read_run(args.runs[1], args.labels[1]).label == "two"
    with pytest.raises(UserInputError, match=r"^--labels: 1 label\(s\) for 2 run\(s\)"):
        plot_runs.parse_args([*two_runs, "--labels", "only one"])


def test_an_unknown_flag_is_one_line(two_runs: list[str]) -> None:
    """argparse's own way is its usage first, then the error: lines of which the last says what is wrong."""
    with pytest.raises(UserInputError, match=r"^unrecognized arguments: --output /tmp/x \(see .* --help\)$"):
        plot_runs.parse_args([*two_runs, "--output", "/tmp/x"])


def test_a_folder_without_metrics_is_named(tmp_path: Path) -> None:
    with pytest.raises(plot_runs.RunFolderError, match=r"no metrics\.jsonl"):
        plot_runs.read_run(tmp_path)


def test_an_out_dir_that_cannot_be_written_is_named(two_runs: list[str], tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    with pytest.raises(plot_runs.RunFolderError, match=rf"^--out-dir {tmp_path / 'a_file'}: cannot write there"):
        plot_runs.main([*two_runs, "--out-dir", str(tmp_path / "a_file")])


def test_the_first_runs_last_confusion_matrix_is_drawn_with_its_class_names(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", 1, [0.5])
    line = json.loads((folder / "metrics.jsonl").read_text())
    line.update(confusion_matrix=[[3, 1], [0, 4]], per_class={"cats": {}, "dogs": {}})
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    written = plot_runs.main([str(folder), "--out-dir", str(tmp_path / "docs")])
    assert written[-1].name == "confusion_matrix.png"
    with Image.open(written[-1]) as picture:
        assert picture.format == "PNG" and picture.width > 2 * 44


def test_the_pictures_of_the_docs_are_what_their_command_draws(tmp_path: Path) -> None:
    """docs/draw_pictures.py draws every picture README.md and docs/using-a-run.md show (docs/benchmark.png is
    docs/speed.md's, drawn by bench/plot_benchmark.py), with the commands a learner runs."""
    sys.path.insert(0, str(REPO / "docs"))
    import draw_pictures

    runs = []
    for name, world_size in (("single", 1), ("ddp2", 2)):
        folder = write_run(tmp_path / name, world_size, [0.5, 0.8])
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        for line in lines:
            line.update(confusion_matrix=[[3, 1], [0, 4]], per_class={"cats": {}, "dogs": {}})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        runs.append(str(folder))
    written = draw_pictures.main([*runs, "--out-dir", str(tmp_path / "docs")])
    shown = {name for page in (REPO / "README.md", REPO / "docs" / "using-a-run.md")
             for name in re.findall(r"\]\((?:docs/)?(\w+\.png)\)", page.read_text())}
    assert sorted(path.name for path in written) == sorted(shown)
    assert all(path.is_file() for path in written)
