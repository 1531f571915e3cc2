"""A run's folder (its --output-dir) and what the run writes there, by rank 0 alone: which file is where, the lock
that keeps two runs from writing into one folder, the checkpoint to continue from (found, read and sent to every
rank: find_saved_run) and the older ones kept beside it, and RunRecorder, which writes the class list, the
split, metrics.jsonl, the weights and TensorBoard's events (checkpoint.py: what a checkpoint holds).

A folder holds one run, which goes on only from the folder's own checkpoints: resuming a checkpoint from
elsewhere (another run's, or one of this run's abandoned timelines) into a folder that holds a run is refused.
Resuming one of the folder's earlier checkpoints (a rewind) starts a new timeline there: what the run wrote
after that checkpoint is set aside in abandoned/, so that no file of the new timeline meets one of the old.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shlex
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import numpy as np
import torch
from torch import nn

from .config import RunConfig
from .distributed_utils import DistContext, read_on_main, unwrap_model
from .errors import UserInputError
from .files import PARTIAL_SUFFIX, cannot_write, load_file, save_atomic, to_cpu
from .optim import Hook, StepEnd

CHECKPOINT_NAME = "checkpoint.pth"
KEPT_CHECKPOINTS = "checkpoints"  # the older checkpoints that --keep-checkpoints keeps
ABANDONED = "abandoned"  # what a rewind set aside: the later part of the run's earlier timelines
LOCK_NAME = ".lock"
CONFUSION_NAME = "confusion.pt"  # the last epoch's whole confusion matrix, past confusion.MAX_LINE_CLASSES classes
METRICS_NAME = "metrics.jsonl"
# What a run writes besides its checkpoint: if any of it is there, the folder holds a run's results.
RESULTS = (METRICS_NAME, "weights/*.pth", f"{KEPT_CHECKPOINTS}/*.pth")
# What a run writes, by kind: a file must not be a folder there, nor a folder a file.
FILES_WRITTEN = ("class_indices.json", "split.json", METRICS_NAME, CHECKPOINT_NAME, CONFUSION_NAME,
                 "weights/best.pth", "weights/best_ema.pth")
FOLDERS_WRITTEN = ("weights", KEPT_CHECKPOINTS, "tensorboard", ABANDONED)
STEP_LOG_EVERY = 10  # optimizer steps between TensorBoard's per-step points (reading them waits for the device)
# Each best file of weights/, by the checkpoint's record of its best (checkpoint.Best; --model-ema's under "ema").
BEST_RECORDS = {"best.pth": "best", "best_ema.pth": "ema"}


@dataclass(frozen=True)
class SavedRun:
    """The checkpoint a run continues from: its path and contents (both None for a fresh start), and whether it
    rewinds the run in --output-dir to an earlier point of it."""

    path: str | None = None
    state: dict[str, Any] | None = None
    rewinds: bool = False

    @property
    def split(self) -> dict[str, Any] | None:
        """How the run's classes and split were made, and its split.json (None before runs saved them)."""
        if not self.state or "split" not in self.state:
            return None
        return {"file": str(run_folder_of(Path(self.path)) / "split.json"), **self.state["split"]}

    @property
    def start_epoch(self) -> int:  # the first epoch it trains: a checkpoint inside an epoch names the one before
        return self.state["epoch"] + 1 if self.state else 0


def run_folder_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint file belongs to: its own, or the one whose checkpoints/ it is in."""
    return checkpoint.parent.parent if checkpoint.parent.name == KEPT_CHECKPOINTS else checkpoint.parent


def position_name(checkpoint: dict[str, Any]) -> str:
    """Where a checkpoint stands, as its kept copy is named: epoch-3-step-120, or epoch-3-end."""
    progress = checkpoint.get("progress")
    return f"epoch-{progress['epoch']}-step-{progress['step']}" if progress else f"epoch-{checkpoint['epoch']}-end"


def position_key(checkpoint: dict[str, Any]) -> tuple[int, int]:
    """Where a checkpoint stands, in an order: (the epoch it goes on in, the samples of that epoch trained)."""
    progress = checkpoint.get("progress")
    return (progress["epoch"], progress.get("samples_seen", 0)) if progress else (checkpoint["epoch"] + 1, 0)


def peek(path: Path) -> dict[str, Any] | None:
    """A checkpoint's contents without reading its tensors (mmap), or None where it does not load."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return checkpoint if isinstance(checkpoint, dict) and "epoch" in checkpoint else None


def checkpoint_to_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """--resume PATH, or --resume auto's (and a torchrun restart's) checkpoint in --output-dir, or None."""
    existing = Path(output_dir) / CHECKPOINT_NAME
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and existing.is_file():
        return existing  # a restarted attempt goes on from where the failed one got to, whatever --resume says
    if resume not in (None, "auto") and Path(resume).is_dir():
        raise UserInputError(f"--resume {resume}: is a folder; name its {CHECKPOINT_NAME}, or use --resume auto "
                             "with --output-dir set to that folder")
    if resume is None and existing.exists():
        raise UserInputError(f"--output-dir {output_dir}: holds a run already ({existing}); continue it with "
                             "--resume auto, or choose another --output-dir")
    return Path(resume) if resume not in (None, "auto") else existing if existing.exists() else None


def trained_flags(resume: str | None, output_dir: str | os.PathLike) -> dict[str, Any]:
    """The flags of the run to resume (or validate), {} if there is none, read before the processes meet."""
    with contextlib.suppress(UserInputError, OSError):  # find_saved_run (or check_before_start) says what is wrong
        path = checkpoint_to_resume(resume, output_dir)
        return (peek(path) or {}).get("args") or {} if path else {}
    return {}


def rewinds_here(path: Path, checkpoint: dict[str, Any], output_dir: Path) -> bool:
    """Whether resuming `checkpoint` (read from `path`) into `output_dir` rewinds the run there to an earlier
    point. A folder holds one run, and goes on only from its own checkpoints: one from elsewhere (another run,
    or this run's abandoned timeline) into a folder that holds a run is refused, in one line."""
    own = output_dir / CHECKPOINT_NAME
    with contextlib.suppress(OSError):
        if own.samefile(path):
            return False
    if run_folder_of(path).resolve() != output_dir.resolve():
        if own.is_file() or results_in(output_dir):
            raise UserInputError(f"--resume {path}: --output-dir {output_dir} holds a run of its own, which goes on "
                                 "only from its own checkpoints; resume into another --output-dir, or continue that "
                                 "run with --resume auto")
        return False  # a new folder for a run to go on in
    current = peek(own)
    if current is not None and position_key(checkpoint) > position_key(current):
        raise UserInputError(f"--resume {path}: stands after {own} ({position_name(current)}), the point this "
                             "folder's run is at; resume it into another --output-dir")
    return current is None or position_key(checkpoint) < position_key(current)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at `path`; if it cannot be read, the error names the newest older one that can."""
    try:
        checkpoint = load_file(path, "--resume")
    except UserInputError as err:
        older = newest_readable(path.parent, but=path)
        if older is None:
            raise
        raise UserInputError(f"{err}; the newest older checkpoint that loads is {older}: go on from it with "
                             f"--resume {older}") from None
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "scheduler", "epoch"} <= set(checkpoint):
        raise UserInputError(f"--resume {path}: not a checkpoint of this project (a plain weights file? "
                             "start from it with --weights instead)")
    return checkpoint


def find_saved_run(resume_flag: str | None, output_dir: str | os.PathLike) -> SavedRun:
    """The checkpoint to continue from (--resume), read by rank 0 and sent to every rank."""
    return read_on_main(lambda: saved_checkpoint(resume_flag, Path(output_dir)))


def saved_checkpoint(resume_flag: str | None, output_dir: Path) -> SavedRun:
    with contextlib.suppress(OSError), open(output_dir / LOCK_NAME) as lock:  # no lock file: no run in it
        refuse_a_folder_in_use(output_dir, lock)  # before anything else
    path = checkpoint_to_resume(resume_flag, output_dir)
    checkpoint = read_checkpoint(path) if path else None
    return SavedRun(str(path), checkpoint, rewinds_here(path, checkpoint, output_dir)) if path else SavedRun()


def results_in(folder: Path) -> list[str]:
    """What a run wrote into `folder` besides its checkpoint, relative to it."""
    return [str(path.relative_to(folder)) for pattern in RESULTS for path in sorted(folder.glob(pattern))
            if path.is_file() and (path.name != METRICS_NAME or path.stat().st_size)]


def refuse_results_without_a_checkpoint(folder: Path) -> None:
    """Stop a fresh run before it mixes its own with the metrics and weights of a run whose checkpoint is
    missing (--save-every and a crash, files deleted by hand)."""
    results = results_in(folder)
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


def write_checkpoint(folder: Path, checkpoint: dict[str, Any], keep: int = 1) -> None:
    """Replace `folder`'s checkpoint, in one step (a crash leaves the previous one whole); with `keep` above 1,
    the one it replaces stays in checkpoints/ under its position (a hard link: nothing is copied), and the
    oldest go that `keep` no longer keeps."""
    path = folder / CHECKPOINT_NAME
    if keep > 1 and path.is_file():
        kept = folder / KEPT_CHECKPOINTS
        kept.mkdir(exist_ok=True)
        previous = peek(path)
        link(path, kept / f"{position_name(previous) if previous else f'checkpoint-{int(path.stat().st_mtime)}'}.pth")
        for old in sorted(kept.glob("*.pth"), key=lambda path: path.stat().st_mtime)[:-(keep - 1)]:
            old.unlink()
    save_atomic(checkpoint, path)


def link(source: Path, target: Path) -> None:
    """`target` as a second name of `source` (a copy on a file system without hard links), replacing it."""
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def set_aside_a_later_timeline(folder: Path, rewound_to: SavedRun) -> str:
    """Rewinding `folder`'s run to `rewound_to`, one of its earlier checkpoints: move what the run wrote after it
    to abandoned/after-POSITION/, make that checkpoint the folder's own, and best.pth the weights of the best
    epoch before it; return the line that says what moved."""
    checkpoint, current = rewound_to.state, peek(folder / CHECKPOINT_NAME) or {}
    aside = folder / ABANDONED / f"after-{position_name(checkpoint)}"
    for number in range(2, 1000):
        if not aside.exists():
            break
        aside = folder / ABANDONED / f"after-{position_name(checkpoint)}-{number}"
    later = [folder / CHECKPOINT_NAME] if current else []
    later += [path for path in (folder / KEPT_CHECKPOINTS).glob("*.pth")
              if position_key(peek(path) or {"epoch": math.inf}) > position_key(checkpoint)]
    later += [path for path in (folder / "weights").glob("model-*.pth")
              if path.stem[6:].isdigit() and int(path.stem[6:]) >= rewound_to.start_epoch]
    later += [folder / "weights" / name for name, key in BEST_RECORDS.items()
              if (folder / "weights" / name).is_file() and best_of(current, key) != best_of(checkpoint, key)]
    moved = sorted(str(path.relative_to(folder)) for path in later)
    for relative in moved:
        (aside / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).replace(aside / relative)
    lines_moved = set_aside_later_epochs(folder / METRICS_NAME, aside / METRICS_NAME, rewound_to.start_epoch)
    link(Path(rewound_to.path), folder / CHECKPOINT_NAME)
    best_epoch = best_of(checkpoint, "best").get("epoch")
    if "weights/best.pth" in moved and (folder / "weights" / f"model-{best_epoch}.pth").is_file():
        link(folder / "weights" / f"model-{best_epoch}.pth", folder / "weights" / "best.pth")
    what = moved[:6] + ([f"{len(moved) - 6} more"] if len(moved) > 6 else [])
    what += [f"{lines_moved} line(s) of {METRICS_NAME}"] if lines_moved else []
    after = f"what it wrote after ({', '.join(what)}) is set aside in {aside}" if what else "nothing it wrote was later"
    return f"Rewound the run to {position_name(checkpoint)}: {after}; it goes on from there"


def best_of(checkpoint: dict[str, Any], key: str) -> dict[str, Any]:
    """The record of the best weights (best.pth's: "best"; --model-ema's: "ema") in a checkpoint."""
    record = checkpoint.get(key) or {}
    return record.get("best", record) if key != "best" else record


def set_aside_later_epochs(metrics: Path, aside: Path, start_epoch: int) -> int:
    """Move the lines of epochs from `start_epoch` on to `aside`; return how many moved."""
    if not metrics.is_file():
        return 0
    lines = metrics.read_text().splitlines()
    later = [line for line in lines if epoch_of(line) >= start_epoch]
    if later:
        aside.write_text("".join(f"{line}\n" for line in later))
        metrics.write_text("".join(f"{line}\n" for line in lines if epoch_of(line) < start_epoch))
    return len(later)


def epoch_of(line: str) -> float:
    """The epoch a metrics.jsonl line is about; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights on the CPU: no `module.` or `_orig_mod.` prefix, loadable anywhere."""
    return to_cpu(unwrap_model(model).state_dict())


class RunRecorder(Hook, contextlib.AbstractContextManager["RunRecorder"]):
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
        self.weights_dir, self.checkpoint_path = self.output_dir / "weights", self.output_dir / CHECKPOINT_NAME
        self.writer: Any = None  # TensorBoard's, opened at the first figure
        self.first_batch: tuple[Any, torch.Tensor] | None = None
        if self.enabled:
            self.start_folder()

    def start_folder(self) -> None:
        """Claim the folder (one run at a time), set aside what a rewound run wrote after the checkpoint it goes on
        from, write the run's classes and split, and open metrics.jsonl."""
        try:
            self.lock = claim_folder(self.output_dir, fresh=self.saved.state is None)
            if self.saved.rewinds:
                print(set_aside_a_later_timeline(self.output_dir, self.saved), flush=True)
            self.weights_dir.mkdir(exist_ok=True)
            (self.output_dir / "class_indices.json").write_text(
                json.dumps(dict(enumerate(self.class_names)), indent=4) + "\n")
            files = self.split_data if isinstance(self.split_data, dict) else self.split_data.files_record()
            (self.output_dir / "split.json").write_text(json.dumps(files) + "\n")
            self.metrics_file = self.open_metrics(self.saved)
        except OSError as err:
            raise UserInputError(f"--output-dir {self.output_dir}: cannot write there ({err.strerror})") from None
        print(f"Writing to {self.output_dir} (TensorBoard: tensorboard --logdir {shlex.quote(str(self.output_dir))})",
              flush=True)

    @functools.cached_property
    def split(self) -> dict[str, Any]:
        """The split as checkpoints keep it (made when the first checkpoint is)."""
        return self.split_data if isinstance(self.split_data, dict) else self.split_data.record

    def open_metrics(self, saved: SavedRun) -> TextIO:
        """metrics.jsonl, starting with the lines of the epochs before the `saved` run's start that its folder's holds
        (this one, or another for a run that goes on in a new folder)."""
        kept = []
        if saved.path and (earlier := run_folder_of(Path(saved.path)) / METRICS_NAME).is_file():
            kept = [line for line in earlier.read_text().splitlines() if epoch_of(line) < saved.start_epoch]
        metrics_file = open(self.output_dir / METRICS_NAME, "w")  # noqa: SIM115 - closed in close()
        metrics_file.write("".join(f"{line}\n" for line in kept) if kept else "")
        return metrics_file

    def checkpoint_due(self, epoch: int, last_epoch: int) -> bool:
        """Whether a checkpoint is written after `epoch`: every --save-every epochs and after the last one.
        Every rank gets the same answer, since every rank takes part in building a checkpoint."""
        return (epoch + 1) % self.config.save_every == 0 or epoch == last_epoch

    def end_epoch(self, model: nn.Module, metrics: dict[str, Any], confusion: torch.Tensor | None,
                  improved: bool, run_step: int, best_epoch: int | None = None) -> None:
        """Append the epoch's figures to metrics.jsonl and TensorBoard (at optimizer step `run_step`), and save
        the weights (model-{epoch}.pth, the newest --keep-epoch-weights and `best_epoch`'s kept; best.pth when
        `improved`), each replaced in one step, so that a crash leaves the previous one whole."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        self.metrics_file.write(json.dumps(metrics, allow_nan=False) + "\n")  # figures are numbers (fit checks)
        self.metrics_file.flush()
        self.draw_epoch(metrics, confusion, run_step)
        if confusion is not None and "confusion_matrix" not in metrics:  # too large for a line: a file of its own
            save_atomic({"epoch": epoch, "class_names": self.class_names, "confusion": confusion.int().cpu()},
                        self.output_dir / CONFUSION_NAME)
        kept = self.config.keep_epoch_weights
        if not (kept != 0 or improved):
            return
        weights = model_weights(model)  # copied off the GPU once, for both files
        if kept != 0:
            save_atomic(weights, self.weights_dir / f"model-{epoch}.pth")
        if improved:
            save_atomic(weights, self.weights_dir / "best.pth")
        if kept:  # the newest `kept`, and the best epoch's: a rewind to before a later best restores best.pth from it
            for older in range(epoch - kept, -1, -1):
                if older != best_epoch:
                    (self.weights_dir / f"model-{older}.pth").unlink(missing_ok=True)

    def save_weights(self, model: nn.Module, name: str) -> None:
        """Save the plain model's weights as weights/`name`."""
        if self.enabled:
            save_atomic(model_weights(model), self.weights_dir / name)

    # TensorBoard, under --output-dir/tensorboard. Opened at the first figure, after the first step: importing
    # it takes a second. purge_step: a resumed run drops what the stopped one drew after its checkpoint.
    # Its writes fail in a thread of its own, which passes the error on to the writer's next call: that is where
    # a write that failed (the folder deleted while the run wrote to it, a full disk) ends the run in one line.
    @contextlib.contextmanager
    def curves(self, purge_step: int) -> Iterator[Any]:
        folder = self.output_dir / "tensorboard"
        try:
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter

                if getattr(threading.excepthook, "func", None) is not quiet_writer_thread:  # once a process
                    threading.excepthook = functools.partial(quiet_writer_thread, threading.excepthook)
                self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step or None)
                self.writer.add_text("args", args_table(self.config.as_saved()))
            yield self.writer
        except OSError as err:
            raise cannot_write(folder, err) from None

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        if self.enabled and self.writer is None and not self.saved.state:  # the run's very first batch
            self.first_batch = (images, labels)

    def on_step_end(self, step: StepEnd) -> None:
        """Every STEP_LOG_EVERY optimizer steps, the step's own figures, as curves over the run's steps; after the
        first step, the first training batch, as the model sees it after cropping and flipping (which is
        rarely what one imagines)."""
        if not self.enabled or (step.run_step % STEP_LOG_EVERY and self.first_batch is None):
            return
        with self.curves(step.run_step) as writer:
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
        with self.curves(run_step) as writer:
            for name, value in metrics.items():
                if isinstance(value, float):
                    writer.add_scalar(name, value, run_step)
            if confusion is not None:
                from .confusion import confusion_image

                title = f"Confusion matrix, epoch {metrics['epoch']}"
                picture = confusion_image(confusion.cpu(), self.class_names, title)
                writer.add_image("confusion_matrix", np.asarray(picture), run_step, dataformats="HWC")
            writer.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            if self.writer is not None:
                with self.curves(0):
                    self.writer.close()
        finally:
            self.metrics_file.close()
            self.lock.close()  # lets the next run into this folder start

    def __exit__(self, *raised: object) -> None:  # after an error, closing's own would only hide it
        with contextlib.suppress(UserInputError) if raised[0] else contextlib.nullcontext():
            self.close()


def args_table(args: dict[str, Any]) -> str:
    """The run's arguments as a Markdown table, which TensorBoard's Text tab shows as a table."""
    rows = [f"| {name} | {value} |" for name, value in sorted(args.items())]
    return "\n".join(["| argument | value |", "| --- | --- |", *rows])


def quiet_writer_thread(previous: Callable[[threading.ExceptHookArgs], Any], args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: TensorBoard's writer thread passes its error on to the run (RunRecorder.curves),
    which says it in one line; its page of traceback would only come first."""
    if not type(args.thread).__module__.startswith("tensorboard."):
        previous(args)
