"""Draw finished runs side by side from their metrics.jsonl: accuracy, loss and time per epoch, as PNG files,
and the first run's confusion matrix of its last epoch.

    python plot_runs.py runs/single runs/ddp2 --out-dir plots
    python plot_runs.py runs/ddp2 runs/ddp2_syncbn --labels "2 processes" "2 processes, SyncBN" \\
        --prefix syncbn_ --out-dir plots

Needs matplotlib (pip install -r requirements-plot.txt); training does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    import matplotlib
except ImportError:
    sys.exit("error: plot_runs.py needs matplotlib: pip install -r requirements-plot.txt")

matplotlib.use("Agg")  # files only: no window, no display needed
import torch
from matplotlib import pyplot as plt  # after use(): the backend is chosen first
from matplotlib.figure import Figure

from multi_train_utils.cli import OneLineErrorParser
from multi_train_utils.confusion import confusion_image
from multi_train_utils.errors import UserInputError, one_line, report, system_reason


class RunFolderError(UserInputError):
    """A run folder without readable metrics, or an --out-dir that cannot be written: reported as one line."""


@dataclass(frozen=True)
class Run:
    label: str
    metrics: list[dict]  # one dict per finished epoch, in epoch order

    def series(self, key: str) -> tuple[list[int], list[float]]:
        return [m["epoch"] for m in self.metrics], [m[key] for m in self.metrics]

    @property
    def world_size(self) -> int | None:  # None: a run written before metrics.jsonl said it
        return self.metrics[-1].get("world_size")


def read_run(folder: str | Path, label: str | None = None) -> Run:
    """The epochs a run finished; the last line is skipped if a killed run left it half-written."""
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise RunFolderError(f"{folder}: no metrics.jsonl (give the --output-dir of a training run)")
    metrics = []
    for line in path.read_text().splitlines():
        try:
            metrics.append(json.loads(line))
        except ValueError:
            continue
    if not metrics:
        raise RunFolderError(f"{path}: no finished epoch yet")
    by_epoch = {m["epoch"]: m for m in metrics}  # a resumed run may have rewritten an epoch
    run = Run(label or Path(folder).name, [by_epoch[e] for e in sorted(by_epoch)])
    if run.world_size is None:
        report(f"{path}: its lines hold no world_size (written before they did): {run.label} is drawn without its "
               "number of processes")
        return run
    return Run(label or f"{run.label} ({run.world_size} process{'es' if run.world_size > 1 else ''})", run.metrics)


def plot_accuracy(runs: Sequence[Run]) -> Figure:
    """Validation accuracy per epoch, one line per run (the tutorial's accuracy.png)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for run in runs:
        ax.plot(*run.series("val_acc"), marker="o", markersize=3, label=run.label)
    ax.set(xlabel="epoch", ylabel="validation accuracy", ylim=(0, 1.02), title="Validation accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def plot_loss(runs: Sequence[Run]) -> Figure:
    """Training loss (solid) and validation loss (dashed) per epoch, one colour per run."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for i, run in enumerate(runs):
        colour = f"C{i}"
        ax.plot(*run.series("train_loss"), color=colour, marker="o", markersize=3, label=f"{run.label}, train")
        ax.plot(*run.series("val_loss"), color=colour, linestyle="--", label=f"{run.label}, validation")
    ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def plot_epoch_time(runs: Sequence[Run]) -> Figure:
    """Median seconds per epoch (training and validation) of each run, by process count, with the
    median training throughput written on each bar. The median, because the first epoch carries
    one-time costs (memory allocation, caches) that later epochs do not."""
    ordered = sorted(runs, key=lambda run: run.world_size or 0)
    seconds = [statistics.median(run.series("epoch_time_s")[1]) for run in ordered]
    throughput = [statistics.median(run.series("images_per_s")[1]) for run in ordered]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    bars = ax.bar([run.label for run in ordered], seconds, color=[f"C{runs.index(run)}" for run in ordered])
    ax.bar_label(bars, labels=[f"{s:.1f} s\n{ips:.0f} img/s" for s, ips in zip(seconds, throughput, strict=True)])
    ax.set(ylabel="seconds per epoch (median)", title="Time per epoch by process count")
    ax.set_ylim(0, max(seconds) * 1.3)
    ax.grid(axis="y", alpha=0.3)
    return fig


def save_confusion_matrix(run: Run, path: Path) -> Path:
    """The last epoch's confusion matrix of `run`, with its class names (per_class lists them in index order)."""
    last = run.metrics[-1]
    title = f"{run.label}, epoch {last['epoch']}: rows true class, columns predicted class"
    confusion_image(torch.tensor(last["confusion_matrix"]), list(last["per_class"]), title).save(path)
    print(f"Wrote {path}")
    return path


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"Wrote {path}")
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="--output-dir folders of finished (or running) training runs")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="one legend label per run (default: folder name and process count)")
    parser.add_argument("--out-dir", default="plots", help="folder for the PNG files")
    parser.add_argument("--prefix", default="", help="prefix of the file names, such as syncbn_")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} label(s) for {len(args.runs)} run(s)")
    return args


def main(argv: Sequence[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    labels = args.labels or [None] * len(args.runs)
    runs = [read_run(folder, label) for folder, label in zip(args.runs, labels, strict=True)]
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = [
            save(plot_accuracy(runs), out_dir / f"{args.prefix}accuracy.png"),
            save(plot_loss(runs), out_dir / f"{args.prefix}loss.png"),
            save(plot_epoch_time(runs), out_dir / f"{args.prefix}epoch_time.png"),
        ]
        if "confusion_matrix" in runs[0].metrics[-1]:  # absent from runs written before it was counted
            written.append(save_confusion_matrix(runs[0], out_dir / f"{args.prefix}confusion_matrix.png"))
    except OSError as err:
        raise RunFolderError(f"--out-dir {out_dir}: cannot write there ({system_reason(err)})") from None
    return written


if __name__ == "__main__":
    try:
        main()
    except UserInputError as stop:  # a flag, a run folder, the --out-dir
        report(f"error: {one_line(stop)}")
        sys.exit(2)
