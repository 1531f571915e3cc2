"""Everything a run writes, written by rank 0 alone, all under --output-dir: the class list and the split,
metrics.jsonl, the weights, the checkpoint files and TensorBoard's events; and the folder's lock, so that two
runs never write into one folder."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import socket
from dataclasses import dataclass
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

from .distributed_utils import DistContext, unwrap_model
from .errors import UserInputError
from .files import PARTIAL_SUFFIX, load_file, save_atomic, to_cpu
from .train_eval_utils import Hook, StepEnd

CHECKPOINT_NAME = "checkpoint.pth"
KEPT_CHECKPOINTS = "checkpoints"  # the older checkpoints that --keep-checkpoints keeps
LOCK_NAME = ".lock"
CONFUSION_NAME = "confusion.pt"  # the last epoch's whole confusion matrix, past confusion.MAX_LINE_CLASSES classes
# What a run writes besides its checkpoint: if any of it is there, the folder holds a run's results.
RESULTS = ("metrics.jsonl", "weights/*.pth", f"{KEPT_CHECKPOINTS}/*.pth")
# What a run writes, by kind: a file must not be a folder there, nor a folder a file.
FILES_WRITTEN = ("class_indices.json", "split.json", "metrics.jsonl", CHECKPOINT_NAME, CONFUSION_NAME,
                 "weights/best.pth", "weights/best_ema.pth")
FOLDERS_WRITTEN = ("weights", KEPT_CHECKPOINTS, "tensorboard")
STEP_LOG_EVERY = 10  # optimizer steps between TensorBoard's per-step points (reading them waits for the device)


@dataclass(frozen=True)
class SavedRun:
    """The checkpoint a run continues from: its path and contents; both None for a fresh start."""

    path: str | None = None
    state: dict[str, Any] | None = None

    @property
    def split(self) -> dict[str, Any] | None:
        """How the run's classes and split were made, and its split.json (None before runs saved them)."""
        if not self.state or "split" not in self.state:
            return None
        folder = Path(self.path).parent
        run = folder.parent if folder.name == KEPT_CHECKPOINTS else folder
        return {"file": str(run / "split.json"), **self.state["split"]}

    @property
    def start_epoch(self) -> int:  # the first epoch it trains: a checkpoint inside an epoch names the one before
        return self.state["epoch"] + 1 if self.state else 0


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights on the CPU: no `module.` or `_orig_mod.` prefix, loadable anywhere."""
    return to_cpu(unwrap_model(model).state_dict())


class RunRecorder(Hook):
    """Writes class_indices.json, split.json, metrics.jsonl, weights/model-{epoch}.pth, weights/best.pth, the
    checkpoint that --resume continues from (with --keep-checkpoints K, the K-1 before it in checkpoints/), and
    TensorBoard's events: the figures of every epoch and, every STEP_LOG_EVERY optimizer steps, the step's own
    (loss, lr), all counted in optimizer steps, so that a resumed run goes on drawing where the checkpoint was.

    On ranks other than 0 every method does nothing, so the training loop never checks the rank. `split`: what
    the run trains on, a utils.SplitData (its class_names, its record, which checkpoints keep, and its
    files_record(), which split.json holds) or one dict for both; `args`: the run's flags, kept in its
    checkpoints; `saved`: the run it continues, if any.
    """

    def __init__(self, output_dir: str | os.PathLike, ctx: DistContext, split: Any, args: dict[str, Any],
                 saved: SavedRun | None = None) -> None:
        self.enabled, self.args, self.saved, self.split_data = ctx.is_main, args, saved or SavedRun(), split
        self.class_names: list[str] = split["class_names"] if isinstance(split, dict) else split.class_names
        self.output_dir = Path(output_dir)
        self.weights_dir = self.output_dir / "weights"
        self.checkpoint_path = self.output_dir / CHECKPOINT_NAME
        self.checkpoint_position: str | None = None  # of the file at checkpoint_path, once this run wrote it
        self.writer: Any = None  # TensorBoard's, opened at the first figure
        self.first_batch: tuple[Any, torch.Tensor] | None = None
        if not self.enabled:
            return
        try:
            self.lock = claim_folder(self.output_dir, fresh=self.saved.state is None)
            self.weights_dir.mkdir(exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(self.class_names)), indent=4) + "\n")
            files = self.split_data if isinstance(self.split_data, dict) else self.split_data.files_record()
            (self.output_dir / "split.json").write_text(json.dumps(files) + "\n")
            self.metrics_file = self.open_metrics(self.saved.start_epoch)
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        print(f"Writing to {self.output_dir} (TensorBoard: tensorboard --logdir {shlex.quote(str(self.output_dir))})",
              flush=True)

    @functools.cached_property
    def split(self) -> dict[str, Any]:
        """The split as checkpoints keep it (made when the first checkpoint is)."""
        return self.split_data if isinstance(self.split_data, dict) else self.split_data.record

    def open_metrics(self, start_epoch: int) -> TextIO:
        """metrics.jsonl, keeping the lines of the epochs a resumed run does not repeat."""
        path = self.output_dir / "metrics.jsonl"
        kept = []
        if start_epoch and path.is_file():
            kept = [line for line in path.read_text().splitlines() if epoch_of(line) < start_epoch]
        metrics_file = open(path, "w")  # noqa: SIM115 - closed in close()
        metrics_file.write("".join(f"{line}\n" for line in kept) if kept else "")
        return metrics_file

    def checkpoint_due(self, epoch: int, last_epoch: int) -> bool:
        """Whether a checkpoint is written after `epoch`: every --save-every epochs and after the last one.
        Every rank gets the same answer, since every rank takes part in building a checkpoint."""
        return (epoch + 1) % self.args.get("save_every", 1) == 0 or epoch == last_epoch

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any], confusion: torch.Tensor | None,
                  improved: bool, run_step: int) -> None:
        """Append the epoch's figures to metrics.jsonl and TensorBoard (at optimizer step `run_step`), and save
        the weights (model-{epoch}.pth unless --keep-epoch-weights false; best.pth when `improved`), each
        replaced in one step, so that a crash leaves the previous one whole."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        self.draw_epoch(metrics, confusion, run_step)
        if confusion is not None and "confusion_matrix" not in metrics:  # too large for a line: a file of its own
            save_atomic({"epoch": epoch, "class_names": self.class_names, "confusion": confusion.int().cpu()},
                        self.output_dir / CONFUSION_NAME)
        keep_epoch_weights = self.args.get("keep_epoch_weights", True)
        if not (keep_epoch_weights or improved):
            return
        weights = model_weights(model)  # copied off the GPU once, for both files
        if keep_epoch_weights:
            save_atomic(weights, self.weights_dir / f"model-{epoch}.pth")
        if improved:
            save_atomic(weights, self.weights_dir / "best.pth")

    def save_weights(self, model: nn.Module, name: str) -> None:
        """Save the plain model's weights as weights/`name`."""
        if self.enabled:
            save_atomic(model_weights(model), self.weights_dir / name)

    def write_checkpoint(self, checkpoint: dict[str, Any], position: str) -> None:
        """Replace the checkpoint, keeping the one it replaces if --keep-checkpoints asks for it; `position`
        names where it stands (epoch-3-step-120, epoch-3-end)."""
        if not self.enabled:
            return
        self.keep_previous_checkpoint()
        save_atomic(checkpoint, self.checkpoint_path)
        self.checkpoint_position = position

    def keep_previous_checkpoint(self) -> None:
        """With --keep-checkpoints K above 1, give the checkpoint about to be replaced a second name in
        checkpoints/, after its position (a hard link: nothing is copied), and delete what K no longer keeps."""
        keep = self.args.get("keep_checkpoints", 1)
        if keep < 2 or not self.checkpoint_path.is_file():
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
        for old in sorted(kept.glob("*.pth"), key=lambda path: path.stat().st_mtime)[:-(keep - 1)]:
            old.unlink()

    # TensorBoard, under --output-dir/tensorboard. Opened at the first figure, after the first step: importing
    # it takes a second. purge_step: a resumed run drops what the stopped one drew after its checkpoint.
    def tensorboard(self, purge_step: int) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge_step or None)
            self.writer.add_text("args", args_table(self.args))
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


def epoch_of(line: str) -> float:
    """The epoch a metrics.jsonl line is about; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def position_of(path: Path) -> str:
    """The position of a checkpoint this run did not write (the one it resumed from), read without loading
    its tensors."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        progress = checkpoint.get("progress")
        if progress:
            return f"epoch-{progress['epoch']}-step-{progress['step']}"
        return f"epoch-{checkpoint['epoch']}-end"
    except Exception:  # not readable as a checkpoint: still kept, under the time it was written
        return f"checkpoint-{int(path.stat().st_mtime)}"


def refuse_results_without_a_checkpoint(folder: Path) -> None:
    """Stop a fresh run before it mixes its own with the metrics and weights of a run whose checkpoint is
    missing (--save-every and a crash, files deleted by hand)."""
    results = []
    for pattern in RESULTS:
        for path in sorted(folder.glob(pattern)):
            if path.is_file() and (path.name != "metrics.jsonl" or path.stat().st_size):
                results.append(str(path.relative_to(folder)))
    if results:
        older = newest_readable(folder)
        go_on = f"continue it with --resume {older}" if older else "choose another --output-dir"
        raise UserInputError(f"--output-dir {folder}: holds the results of a run ({', '.join(results[:4])}"
                             f"{', ...' if len(results) > 4 else ''}) but no {CHECKPOINT_NAME} to continue "
                             f"from; {go_on}, or move those files away")


def newest_readable(folder: Path, but: Path | None = None) -> Path | None:
    """The newest checkpoint in `folder`'s checkpoints/ that loads, other than `but`."""
    kept = sorted((folder / KEPT_CHECKPOINTS).glob("*.pth"), key=lambda path: path.stat().st_mtime, reverse=True)
    for path in kept:
        if path != but:
            try:
                load_file(path, "--resume")
                return path
            except UserInputError:
                continue
    return None


def refuse_a_folder_in_use(folder: Path, lock: TextIO) -> None:
    """Stop at once if another run holds `lock`, `folder`'s lock (it wrote its process and host there)."""
    if fcntl is None:  # Windows has no flock
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise UserInputError(f"--output-dir {folder}: another run is writing there (process "
                             f"{lock.read().strip() or 'unknown'}); let it finish, or choose another --output-dir"
                             ) from None


def claim_folder(folder: Path, fresh: bool = True) -> TextIO:
    """Lock `folder` for this run's life (the system releases it however the process ends; Windows has no flock)
    and check that what the run writes may be written there, found now rather than after training."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the run's life
    try:
        refuse_a_folder_in_use(folder, lock)
        lock.truncate(0)
        lock.write(f"{os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        if fresh:
            refuse_results_without_a_checkpoint(folder)
        # The temporary files of writes a killed run left unfinished, each perhaps a checkpoint's size; none in use.
        for partial in [*folder.glob(f".*{PARTIAL_SUFFIX}"), *folder.glob(f"*/.*{PARTIAL_SUFFIX}")]:
            with contextlib.suppress(OSError):
                partial.unlink()
        for name in (*FILES_WRITTEN, *FOLDERS_WRITTEN):
            wanted, path = "folder" if name in FOLDERS_WRITTEN else "file", folder / name
            if path.exists() and path.is_dir() != (wanted == "folder"):
                raise UserInputError(f"--output-dir {folder}: {path} is a {'folder' if path.is_dir() else 'file'}, "
                                     f"where the run writes a {wanted}; move it away, or choose another --output-dir")
    except BaseException:
        lock.close()  # the next try, in this process too, finds the folder free
        raise
    return lock
