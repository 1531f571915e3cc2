"""Everything a run writes, written by rank 0 alone, all under --output-dir."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import torch
from torch import nn

from utils import batch_grid

from .checkpoint import CHECKPOINT_NAME, model_weights, position_name, save_atomic
from .confusion import confusion_image
from .distributed_utils import DistContext
from .errors import UserInputError


def epoch_of(line: str) -> float:
    """The epoch a metrics.jsonl line is about; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def args_table(args: dict[str, Any]) -> str:
    """The run's arguments as a Markdown table, which TensorBoard's Text tab shows as a table."""
    rows = [f"| {name} | {value} |" for name, value in sorted(args.items())]
    return "\n".join(["| argument | value |", "| --- | --- |", *rows])


def position_of(path: Path) -> str:
    """The position of a checkpoint this run did not write (the one it resumed from), read without loading
    its tensors."""
    try:
        return position_name(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # not readable as a checkpoint: still kept, under the time it was written
        return f"checkpoint-{int(path.stat().st_mtime)}"


def claim_folder(folder: Path) -> TextIO:
    """Lock `folder` for this run's life: a second run into it stops at once, instead of both writing the
    same files. The system releases the lock when the returned file is closed or the process ends,
    however it ends. (No lock on Windows, which has no flock.)"""
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / ".lock", "a+")  # noqa: SIM115 - held open for the run's life
    if fcntl is None:
        return lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise UserInputError(f"--output-dir {folder}: another run is writing there (process {holder}); let it "
                             "finish, or choose another --output-dir") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


Checkpoint = Callable[[dict[str, torch.Tensor]], dict[str, Any]]  # builds a checkpoint from the model's weights


class RunRecorder:
    """Writes class_indices.json, split.json, metrics.jsonl, TensorBoard events, weights/model-{epoch}.pth,
    weights/best.pth and the checkpoint that --resume continues from (with --keep-checkpoints K, the K-1
    before it in checkpoints/).

    On ranks other than 0 every method does nothing, so the training loop never checks the rank.
    """

    def __init__(self, output_dir: str | os.PathLike, ctx: DistContext, split: dict[str, list[str]],
                 args: dict[str, Any], start_epoch: int = 0) -> None:
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
            self.weights_dir.mkdir(exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(self.class_names)), indent=4) + "\n")
            (self.output_dir / "split.json").write_text(json.dumps(split) + "\n")
            self.metrics_file = self.open_metrics(start_epoch)
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only rank 0 needs it

        # purge_step: a resumed run drops what the stopped one logged after its last checkpoint.
        self.tensorboard = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"),
                                         purge_step=start_epoch or None)
        self.tensorboard.add_text("args", args_table(args))
        print(f"Writing to {self.output_dir} (TensorBoard: tensorboard --logdir {shlex.quote(str(self.output_dir))})",
              flush=True)

    def open_metrics(self, start_epoch: int) -> TextIO:
        """metrics.jsonl, keeping the lines of the epochs a resumed run does not repeat."""
        path = self.output_dir / "metrics.jsonl"
        kept = []
        if start_epoch and path.is_file():
            kept = [line for line in path.read_text().splitlines() if epoch_of(line) < start_epoch]
        metrics_file = open(path, "w")  # noqa: SIM115 - closed in close()
        metrics_file.writelines(line + "\n" for line in kept)
        return metrics_file

    def add_batch_grid(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Show the first training batch in TensorBoard, un-normalised and captioned with its classes:
        what the model really sees after cropping and flipping, which is rarely what one imagines."""
        if not self.enabled:
            return
        grid = batch_grid(images, labels, self.class_names)
        self.tensorboard.add_image("first_training_batch", np.asarray(grid), 0, dataformats="HWC")
        self.tensorboard.flush()

    def checkpoint_due(self, epoch: int, last_epoch: int) -> bool:
        """Whether a checkpoint is written after `epoch`: every --save-every epochs and after the last one.
        Every rank gets the same answer, since every rank takes part in building a checkpoint."""
        return (epoch + 1) % self.save_every == 0 or epoch == last_epoch

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any], improved: bool,
                  checkpoint: Checkpoint | None = None, best_ema: nn.Module | None = None) -> None:
        """Print the epoch's one-line summary, append it to metrics.jsonl and TensorBoard, and save the
        weights (model-{epoch}.pth unless --keep-epoch-weights false; best.pth when `improved`; the averaged
        weights `best_ema` as best_ema.pth) and the checkpoint that `checkpoint(weights)` builds, each
        replaced in one step, so that a crash leaves the previous one whole."""
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
        self.add_to_tensorboard(metrics)
        if best_ema is not None:
            save_atomic(model_weights(best_ema), self.weights_dir / "best_ema.pth")
        if not (self.keep_epoch_weights or improved or checkpoint):
            return
        weights = model_weights(model)  # copied off the GPU once, for every file below
        if self.keep_epoch_weights:
            save_atomic(weights, self.weights_dir / f"model-{epoch}.pth")
        if improved:
            save_atomic(weights, self.weights_dir / "best.pth")
        if checkpoint:
            self.write_checkpoint(weights, checkpoint)

    def write_checkpoint(self, model: nn.Module | dict[str, torch.Tensor], checkpoint: Checkpoint) -> None:
        """Replace the checkpoint with the one `checkpoint` builds from the model's weights (or `model`, the
        weights already copied), keeping the one it replaces if --keep-checkpoints asks for it."""
        if not self.enabled:
            return
        state = checkpoint(model if isinstance(model, dict) else model_weights(model))
        self.keep_previous_checkpoint()
        save_atomic(state, self.checkpoint_path)
        self.checkpoint_position = position_name(state)

    def keep_previous_checkpoint(self) -> None:
        """With --keep-checkpoints K above 1, give the checkpoint about to be replaced a second name in
        checkpoints/, after its position (a hard link: nothing is copied), and delete what K no longer keeps."""
        if self.keep_checkpoints < 2 or not self.checkpoint_path.is_file():
            return
        kept = self.output_dir / "checkpoints"
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

    def add_to_tensorboard(self, metrics: dict[str, Any]) -> None:
        """The epoch's curves, and its confusion matrix as a picture (TensorBoard's Images tab, with a slider
        over the epochs)."""
        epoch = metrics["epoch"]
        for name in ("train_loss", "val_loss", "val_acc", "ema_val_acc", "lr", "images_per_s", "epoch_time_s"):
            if name in metrics:
                self.tensorboard.add_scalar(name, metrics[name], epoch)
        picture = confusion_image(metrics["confusion_matrix"], self.class_names, f"Confusion matrix, epoch {epoch}")
        self.tensorboard.add_image("confusion_matrix", np.asarray(picture), epoch, dataformats="HWC")
        self.tensorboard.flush()

    def close(self) -> None:
        if self.enabled:
            self.metrics_file.close()
            self.tensorboard.close()
            self.lock.close()  # lets the next run into this folder start

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
