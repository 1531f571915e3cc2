"""What a run writes as it trains, by rank 0 alone, under --output-dir: the class list and the split,
metrics.jsonl, the weights and TensorBoard's events (run_folder.py: which files are where, and the folder's lock;
checkpoint.py: the checkpoint)."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from .config import RunConfig
from .distributed_utils import DistContext, unwrap_model
from .errors import UserInputError
from .files import save_atomic, to_cpu
from .run_folder import (
    CHECKPOINT_NAME,
    CONFUSION_NAME,
    METRICS_NAME,
    SavedRun,
    claim_folder,
    epoch_of,
    set_aside_a_later_timeline,
)
from .train_eval_utils import Hook, StepEnd

STEP_LOG_EVERY = 10  # optimizer steps between TensorBoard's per-step points (reading them waits for the device)


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights on the CPU: no `module.` or `_orig_mod.` prefix, loadable anywhere."""
    return to_cpu(unwrap_model(model).state_dict())


class RunRecorder(Hook):
    """Writes class_indices.json, split.json, metrics.jsonl, weights/model-{epoch}.pth, weights/best.pth and
    TensorBoard's events: the figures of every epoch and, every STEP_LOG_EVERY optimizer steps, the step's own
    (loss, lr), all counted in optimizer steps, so that a resumed run goes on drawing where the checkpoint was.

    On ranks other than 0 every method does nothing, so the training loop never checks the rank. `config`: the
    run's; `split`: what the run trains on, a utils.SplitData (its class_names, its record, which checkpoints
    keep, and its files_record(), which split.json holds) or one dict for both; `saved`: the run it continues,
    if any (a rewind sets aside what the run wrote after it first).
    """

    def __init__(self, config: RunConfig, ctx: DistContext, split: Any, saved: SavedRun | None = None) -> None:
        self.enabled, self.config, self.saved, self.split_data = ctx.is_main, config, saved or SavedRun(), split
        self.class_names: list[str] = split["class_names"] if isinstance(split, dict) else split.class_names
        self.output_dir = Path(config.output_dir)
        self.weights_dir = self.output_dir / "weights"
        self.checkpoint_path = self.output_dir / CHECKPOINT_NAME
        self.writer: Any = None  # TensorBoard's, opened at the first figure
        self.first_batch: tuple[Any, torch.Tensor] | None = None
        if not self.enabled:
            return
        try:
            self.lock = claim_folder(self.output_dir, fresh=self.saved.state is None)
            if self.saved.rewinds:
                print(set_aside_a_later_timeline(self.output_dir, self.saved), flush=True)
            self.weights_dir.mkdir(exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(self.class_names)), indent=4) + "\n")
            files = self.split_data if isinstance(self.split_data, dict) else self.split_data.files_record()
            (self.output_dir / "split.json").write_text(json.dumps(files) + "\n")
            self.metrics_file = self.open_metrics(self.saved.start_epoch, self.saved.folder or self.output_dir)
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        print(f"Writing to {self.output_dir} (TensorBoard: tensorboard --logdir {shlex.quote(str(self.output_dir))})",
              flush=True)

    @functools.cached_property
    def split(self) -> dict[str, Any]:
        """The split as checkpoints keep it (made when the first checkpoint is)."""
        return self.split_data if isinstance(self.split_data, dict) else self.split_data.record

    def open_metrics(self, start_epoch: int, run_folder: Path) -> TextIO:
        """metrics.jsonl, starting with the lines of the epochs before `start_epoch` that `run_folder`'s holds (the
        folder of the checkpoint a run resumes, this one or another)."""
        earlier = run_folder / METRICS_NAME
        kept = []
        if start_epoch and earlier.is_file():
            kept = [line for line in earlier.read_text().splitlines() if epoch_of(line) < start_epoch]
        metrics_file = open(self.output_dir / METRICS_NAME, "w")  # noqa: SIM115 - closed in close()
        metrics_file.write("".join(f"{line}\n" for line in kept) if kept else "")
        return metrics_file

    def checkpoint_due(self, epoch: int, last_epoch: int) -> bool:
        """Whether a checkpoint is written after `epoch`: every --save-every epochs and after the last one.
        Every rank gets the same answer, since every rank takes part in building a checkpoint."""
        return (epoch + 1) % self.config.save_every == 0 or epoch == last_epoch

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any], confusion: torch.Tensor | None,
                  improved: bool, run_step: int) -> None:
        """Append the epoch's figures to metrics.jsonl and TensorBoard (at optimizer step `run_step`), and save
        the weights (model-{epoch}.pth unless --keep-epoch-weights false; best.pth when `improved`), each
        replaced in one step, so that a crash leaves the previous one whole."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        self.metrics_file.write(json.dumps(metrics, allow_nan=False) + "\n")  # figures are numbers (fit checks)
        self.metrics_file.flush()
        self.draw_epoch(metrics, confusion, run_step)
        if confusion is not None and "confusion_matrix" not in metrics:  # too large for a line: a file of its own
            save_atomic({"epoch": epoch, "class_names": self.class_names, "confusion": confusion.int().cpu()},
                        self.output_dir / CONFUSION_NAME)
        if not (self.config.keep_epoch_weights or improved):
            return
        weights = model_weights(model)  # copied off the GPU once, for both files
        if self.config.keep_epoch_weights:
            save_atomic(weights, self.weights_dir / f"model-{epoch}.pth")
        if improved:
            save_atomic(weights, self.weights_dir / "best.pth")

    def save_weights(self, model: nn.Module, name: str) -> None:
        """Save the plain model's weights as weights/`name`."""
        if self.enabled:
            save_atomic(model_weights(model), self.weights_dir / name)

    # TensorBoard, under --output-dir/tensorboard. Opened at the first figure, after the first step: importing
    # it takes a second. purge_step: a resumed run drops what the stopped one drew after its checkpoint.
    def tensorboard(self, purge_step: int) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge_step or None)
            self.writer.add_text("args", args_table(self.config.as_saved()))
        return self.writer

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        if self.enabled and self.writer is None and not self.saved.state:  # the run's very first batch
            self.first_batch = (images, labels)

    def on_step_end(self, step: StepEnd) -> None:
        """Every STEP_LOG_EVERY optimizer steps, the step's own figures, as curves over the run's steps; after the
        first step, the first training batch, as the model sees it after cropping and flipping (which is
        rarely what one imagines)."""
        if not self.enabled or (step.run_step % STEP_LOG_EVERY and self.first_batch is None):
            return
        writer = self.tensorboard(step.run_step)
        if self.first_batch is not None:
            from .pictures import batch_grid

            grid = batch_grid(*self.first_batch, self.class_names)
            writer.add_image("first_training_batch", np.asarray(grid), 0, dataformats="HWC")
            self.first_batch = None
        if step.run_step % STEP_LOG_EVERY == 0:
            for name, value in step.figures.items():
                writer.add_scalar(f"step/{name}", float(value), step.run_step)

    def draw_epoch(self, metrics: dict[str, Any], confusion: torch.Tensor | None, run_step: int) -> None:
        """Every float of the epoch's metrics as a curve (whole numbers are counts and positions), and the
        confusion matrix as a picture, with a slider over the epochs, under Images."""
        writer = self.tensorboard(run_step)
        for name, value in metrics.items():
            if isinstance(value, float):
                writer.add_scalar(name, value, run_step)
        if confusion is not None:
            from .confusion import confusion_image

            picture = confusion_image(confusion.cpu(), self.class_names, f"Confusion matrix, epoch {metrics['epoch']}")
            writer.add_image("confusion_matrix", np.asarray(picture), run_step, dataformats="HWC")
        writer.flush()

    def close(self) -> None:
        if self.enabled:
            if self.writer is not None:
                self.writer.close()
            self.metrics_file.close()
            self.lock.close()  # lets the next run into this folder start

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def args_table(args: dict[str, Any]) -> str:
    """The run's arguments as a Markdown table, which TensorBoard's Text tab shows as a table."""
    rows = [f"| {name} | {value} |" for name, value in sorted(args.items())]
    return "\n".join(["| argument | value |", "| --- | --- |", *rows])
