"""A run's folder (its --output-dir): which files are where, the lock that keeps two runs from writing into one
folder, the checkpoint to continue from and the older ones kept beside it, and the rule that a folder holds
one run. All of it is done by rank 0 alone.

A folder holds one run, which goes on only from the folder's own checkpoints: resuming a checkpoint from
elsewhere (another run's, or one of this run's abandoned timelines) into a folder that holds a run is refused.
Resuming one of the folder's earlier checkpoints (a rewind) starts a new timeline there: what the run wrote
after that checkpoint is set aside in abandoned/, so that no file of the new timeline meets one of the old.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import torch

from .errors import UserInputError
from .files import PARTIAL_SUFFIX, load_file, save_atomic

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
    def folder(self) -> Path | None:
        return run_folder_of(Path(self.path)) if self.path else None

    @property
    def split(self) -> dict[str, Any] | None:
        """How the run's classes and split were made, and its split.json (None before runs saved them)."""
        if not self.state or "split" not in self.state:
            return None
        return {"file": str(self.folder / "split.json"), **self.state["split"]}

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
    folder = Path(output_dir)
    existing = folder / CHECKPOINT_NAME
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and existing.is_file():
        return existing  # a restarted attempt goes on from where the failed one got to, whatever --resume says
    if resume not in (None, "auto"):
        path = Path(resume)
        if path.is_dir():
            raise UserInputError(f"--resume {resume}: is a folder; name its {CHECKPOINT_NAME}, or use --resume auto "
                                 "with --output-dir set to that folder")
        return path
    if existing.exists() and resume == "auto":
        return existing
    if existing.exists():
        raise UserInputError(f"--output-dir {output_dir}: holds a run already ({existing}); continue it with "
                             "--resume auto, or choose another --output-dir")
    return None


def trained_flags(resume: str | None, output_dir: str | os.PathLike) -> dict[str, Any]:
    """The flags of the run to resume (or validate), {} if there is none, read before the processes meet."""
    try:
        path = checkpoint_to_resume(resume, output_dir)
    except (UserInputError, OSError):
        return {}  # find_saved_run (or check_before_start) says what is wrong
    flags = (peek(path) or {}).get("args") if path else None
    return flags if isinstance(flags, dict) else {}


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


def results_in(folder: Path) -> list[str]:
    """What a run wrote into `folder` besides its checkpoint, relative to it."""
    found = []
    for pattern in RESULTS:
        for path in sorted(folder.glob(pattern)):
            if path.is_file() and (path.name != METRICS_NAME or path.stat().st_size):
                found.append(str(path.relative_to(folder)))
    return found


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
