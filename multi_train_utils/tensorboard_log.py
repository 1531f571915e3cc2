"""TensorBoard, written by rank 0 under --output-dir/tensorboard: every number of each epoch's metrics.jsonl line
as a curve, the confusion matrix as a picture, the first training batch as the model sees it, and the run's
arguments as a table."""

from __future__ import annotations

import shlex
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer, SavedRun
from .confusion import confusion_image
from .hooks import Hook
from .pictures import batch_grid
from .recorder import RunRecorder


def args_table(args: dict[str, Any]) -> str:
    """The run's arguments as a Markdown table, which TensorBoard's Text tab shows as a table."""
    rows = [f"| {name} | {value} |" for name, value in sorted(args.items())]
    return "\n".join(["| argument | value |", "| --- | --- |", *rows])


def curves(metrics: dict[str, Any]) -> dict[str, float]:
    """The figures of an epoch drawn as curves: every float of its metrics (losses, accuracies, the lr, the
    speed); whole numbers are counts and positions, not curves. A new metric is drawn without a word here."""
    return {name: value for name, value in metrics.items() if isinstance(value, float)}


class TensorBoardLog(Hook):
    def __init__(self, recorder: RunRecorder, start_epoch: int = 0) -> None:
        self.recorder, self.epoch = recorder, start_epoch
        self.writer = None
        if not recorder.enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only rank 0 needs it

        folder = recorder.output_dir / "tensorboard"
        # purge_step: a resumed run drops what the stopped one logged after its last checkpoint.
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=start_epoch or None)
        self.writer.add_text("args", args_table(recorder.args))
        print(f"TensorBoard: tensorboard --logdir {shlex.quote(str(recorder.output_dir))}", flush=True)

    @classmethod
    def from_args(cls, args: dict[str, Any], checkpoints: Checkpointer, saved: SavedRun,
                  val_loader: DataLoader) -> TensorBoardLog:
        return cls(checkpoints.recorder, saved.start_epoch)

    def on_epoch_start(self, epoch: int) -> None:
        self.epoch = epoch

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        """The first training batch, un-normalised and captioned with its classes: what the model really sees
        after cropping and flipping, which is rarely what one imagines."""
        if self.writer is None or self.epoch != 0:
            return
        grid = batch_grid(images, labels, self.recorder.class_names)
        self.writer.add_image("first_training_batch", np.asarray(grid), 0, dataformats="HWC")
        self.writer.flush()

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name, value in curves(metrics).items():
            self.writer.add_scalar(name, value, epoch)
        if metrics.get("confusion_matrix"):  # with a slider over the epochs, under Images
            picture = confusion_image(metrics["confusion_matrix"], self.recorder.class_names,
                                      f"Confusion matrix, epoch {epoch}")
            self.writer.add_image("confusion_matrix", np.asarray(picture), epoch, dataformats="HWC")
        self.writer.flush()

    def on_fit_end(self) -> None:
        if self.writer is not None:
            self.writer.close()
