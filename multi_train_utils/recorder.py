"""Everything a run writes, written by rank 0 alone, all under --output-dir: the class list and the split,
metrics.jsonl, the weights, and the checkpoint files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch
from torch import nn

from .checkpoint import (
    CHECKPOINT_NAME,
    KEPT_CHECKPOINTS,
    SavedRun,
    model_weights,
    position_name,
    refuse_results_without_a_checkpoint,
)
from .distributed_utils import DistContext
from .errors import UserInputError
from .files import claim_folder, remove_partial_files, save_atomic

# What a run writes, by kind: a file must not be a folder there, nor a folder a file.
FILES_WRITTEN = ("class_indices.json", "split.json", "metrics.jsonl", CHECKPOINT_NAME, "weights/best.pth",
                 "weights/best_ema.pth")
FOLDERS_WRITTEN = ("weights", KEPT_CHECKPOINTS, "tensorboard")


def epoch_of(line: str) -> float:
    """The epoch a metrics.jsonl line is about; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def check_paths_to_write(folder: Path) -> None:
    """That nothing is in the way of a file or folder the run will write: found now, not after training."""
    for name in FILES_WRITTEN:
        if (folder / name).is_dir():
            raise UserInputError(f"--output-dir {folder}: {folder / name} is a folder, where the run writes a file; "
                                 "move it away, or choose another --output-dir")
    for name in FOLDERS_WRITTEN:
        if (folder / name).exists() and not (folder / name).is_dir():
            raise UserInputError(f"--output-dir {folder}: {folder / name} is a file, where the run writes a folder; "
                                 "move it away, or choose another --output-dir")


class RunRecorder:
    """Writes class_indices.json, split.json, metrics.jsonl, weights/model-{epoch}.pth, weights/best.pth and
    the checkpoint that --resume continues from (with --keep-checkpoints K, the K-1 before it in checkpoints/).

    On ranks other than 0 every method does nothing, so the training loop never checks the rank.
    """

    def __init__(self, output_dir: str | os.PathLike, ctx: DistContext, split: dict[str, list[str]],
                 args: dict[str, Any], saved: SavedRun | None = None) -> None:
        self.enabled = ctx.is_main
        self.args = args
        self.save_every = args.get("save_every", 1)
        self.keep_epoch_weights = args.get("keep_epoch_weights", True)
        self.keep_checkpoints = args.get("keep_checkpoints", 1)
        self.split = split
        self.class_names = split["class_names"]
        self.output_dir = Path(output_dir)
        self.weights_dir = self.output_dir / "weights"
        self.checkpoint_path = self.output_dir / CHECKPOINT_NAME
        self.checkpoint_position: str | None = None  # of the file at checkpoint_path, once this run wrote it
        if not self.enabled:
            return
        try:
            self.lock = claim_folder(self.output_dir)
            if saved is None or saved.state is None:  # a fresh run: not over the results of another
                refuse_results_without_a_checkpoint(self.output_dir)
            remove_partial_files(self.output_dir)  # of a run that was killed while it wrote
            check_paths_to_write(self.output_dir)
            self.weights_dir.mkdir(exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(self.class_names)), indent=4) + "\n")
            (self.output_dir / "split.json").write_text(json.dumps(split) + "\n")
            self.metrics_file = self.open_metrics(saved.start_epoch if saved else 0)
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        print(f"Writing to {self.output_dir}", flush=True)

    def open_metrics(self, start_epoch: int) -> TextIO:
        """metrics.jsonl, keeping the lines of the epochs a resumed run does not repeat."""
        path = self.output_dir / "metrics.jsonl"
        kept = []
        if start_epoch and path.is_file():
            kept = [line for line in path.read_text().splitlines() if epoch_of(line) < start_epoch]
        metrics_file = open(path, "w")  # noqa: SIM115 - closed in close()
        metrics_file.writelines(line + "\n" for line in kept)
        return metrics_file

    def checkpoint_due(self, epoch: int, last_epoch: int) -> bool:
        """Whether a checkpoint is written after `epoch`: every --save-every epochs and after the last one.
        Every rank gets the same answer, since every rank takes part in building a checkpoint."""
        return (epoch + 1) % self.save_every == 0 or epoch == last_epoch

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any], improved: bool) -> None:
        """Print the epoch's one-line summary, append it to metrics.jsonl, and save the weights
        (model-{epoch}.pth unless --keep-epoch-weights false; best.pth when `improved`), each replaced in one
        step, so that a crash leaves the previous one whole."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        ema = f"  ema_acc {metrics['ema_val_acc']:.3f}" if "ema_val_acc" in metrics else ""
        print(f"[epoch {epoch}] train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
              f"val_acc {metrics['val_acc']:.3f} ({metrics['val_correct']}/{metrics['val_total']}){ema}  "
              f"lr {metrics['lr']:.2e}  {metrics['images_per_s']:.1f} img/s  {metrics['epoch_time_s']:.1f} s",
              flush=True)
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        if not (self.keep_epoch_weights or improved):
            return
        weights = model_weights(model)  # copied off the GPU once, for both files
        if self.keep_epoch_weights:
            save_atomic(weights, self.weights_dir / f"model-{epoch}.pth")
        if improved:
            save_atomic(weights, self.weights_dir / "best.pth")

    def save_weights(self, model: nn.Module, name: str) -> None:
        """Save the plain model's weights as weights/`name`."""
        if self.enabled:
            save_atomic(model_weights(model), self.weights_dir / name)

    def write_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Replace the checkpoint, keeping the one it replaces if --keep-checkpoints asks for it."""
        if not self.enabled:
            return
        self.keep_previous_checkpoint()
        save_atomic(checkpoint, self.checkpoint_path)
        self.checkpoint_position = position_name(checkpoint)

    def keep_previous_checkpoint(self) -> None:
        """With --keep-checkpoints K above 1, give the checkpoint about to be replaced a second name in
        checkpoints/, after its position (a hard link: nothing is copied), and delete what K no longer keeps."""
        if self.keep_checkpoints < 2 or not self.checkpoint_path.is_file():
            return
        kept = self.output_dir / KEPT_CHECKPOINTS
        kept.mkdir(exist_ok=True)
        name = self.checkpoint_position or position_of(self.checkpoint_path)
        target = kept / f"{name}.pth"
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        try:
            os.link(self.checkpoint_path, target)
        except OSError:  # a file system without hard links
            shutil.copy2(self.checkpoint_path, target)
        for old in sorted(kept.glob("*.pth"), key=lambda path: path.stat().st_mtime)[:-(self.keep_checkpoints - 1)]:
            old.unlink()

    def close(self) -> None:
        if self.enabled:
            self.metrics_file.close()
            self.lock.close()  # lets the next run into this folder start

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def position_of(path: Path) -> str:
    """The position of a checkpoint this run did not write (the one it resumed from), read without loading
    its tensors."""
    try:
        return position_name(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # not readable as a checkpoint: still kept, under the time it was written
        return f"checkpoint-{int(path.stat().st_mtime)}"
