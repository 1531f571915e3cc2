"""Checkpoints that let a stopped run continue exactly where it was, and finding the one to resume."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .ddp import unwrap_model
from .distributed_utils import DistContext, is_dist_avail_and_initialized, print_main
from .ema import ModelEma
from .errors import UserInputError
from .step_options import StepOptions

CHECKPOINT_NAME = "checkpoint.pth"


def save_atomic(obj: object, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a file, and
    two processes writing the same name never share a temporary file. A write that fails (a full disk)
    removes its temporary file, so that it does not keep the disk full, and ends in one line."""
    handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.chmod(scratch, 0o666 & ~current_umask())  # mkstemp's file is private; a saved file is not
        with os.fdopen(handle, "wb") as file:
            torch.save(obj, file)
        os.replace(scratch, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        if isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise UserInputError(f"cannot write {path}: {why_a_write_failed(err, path.parent)}; the files "
                                 "written before it are kept") from None
        raise


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


LOW_DISK_BYTES = 64 * 2**20


def why_a_write_failed(err: BaseException, folder: Path) -> str:
    """A full disk in words: torch.save says "basic_ios::clear: iostream error", which nobody reads as that."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full (or the disk quota used up)"
    free = shutil.disk_usage(folder).free
    if free < LOW_DISK_BYTES:
        return f"the disk is full ({free / 2**20:.1f} MB free)"
    return err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]


def rng_state() -> dict[str, Any]:
    """Every random state the next epoch's augmentation draws from, in types `weights_only` loads."""
    version, mt_state, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "torch": torch.get_rng_state(),
        # Only this process's own GPU: a resumed run may see fewer GPUs (one per task under SLURM).
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's random state, in rank order (each rank draws its own augmentations)."""
    if not is_dist_avail_and_initialized():
        return [rng_state()]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def to_cpu(tree: Any) -> Any:
    """`tree` (a state dict, nested dicts and lists) with every tensor copied to the CPU, so that a file
    saved on a GPU loads with a plain torch.load on a machine without one."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {key: to_cpu(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(value) for value in tree)
    return tree


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights on the CPU: no `module.` or `_orig_mod.` prefix, loadable anywhere."""
    return to_cpu(unwrap_model(model).state_dict())


@dataclass
class EpochProgress:
    """How far training has got inside an epoch: what a checkpoint written in the middle of an epoch keeps,
    and where a run resumed from it goes on."""

    epoch: int
    step: int = 0  # optimizer steps done in the epoch
    # How many of the epoch's shuffled samples all processes together have trained on: the position that
    # still means the same with another number of processes.
    samples_seen: int = 0
    loss_sum: float = 0.0  # their summed training loss, as of the last checkpoint (for the epoch's train_loss)


def make_checkpoint(weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, epoch: int, best_acc: float,
                    rng_states: list[dict[str, Any]], args: dict[str, Any],
                    scaler: torch.amp.GradScaler, split: dict[str, list[str]] | None = None,
                    ema: ModelEma | None = None, progress: EpochProgress | None = None) -> dict[str, Any]:
    """All it takes to continue after `epoch` (the last finished one), or from `progress` inside the next:
    weights, optimizer and schedule, the fp16 loss scale, the best accuracy so far, the random states of
    every rank, the arguments (to check that a resumed run is the same run), the classes and split it
    trains on, and with --model-ema the averaged weights and their best accuracy."""
    return {
        "model": weights, "optimizer": to_cpu(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
        "epoch": epoch, "progress": asdict(progress) if progress else None, "best_acc": best_acc,
        "rng": to_cpu(rng_states), "args": args, "split": split, "ema": ema.state_dict() if ema else None,
    }


def position_name(checkpoint: dict[str, Any]) -> str:
    """Where a checkpoint stands, as a file name: epoch-3-step-120, or epoch-3-end."""
    progress = checkpoint.get("progress")
    if progress:
        return f"epoch-{progress['epoch']}-step-{progress['step']}"
    return f"epoch-{checkpoint['epoch']}-end"


# How an optimizer runs, not what it computes: they belong to this run (its device, its flags), not to
# the run that saved the checkpoint.
IMPLEMENTATION_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a saved optimizer state into this run's optimizer, whatever device and flags saved it.

    load_state_dict takes every group option from the file. A CPU run saves fused=False; resumed on a GPU
    with fp16, the fused step GradScaler expects would then refuse to run. Its buffers (momentum) also keep
    the memory layout they were saved in, which fused SGD refuses after --channels-last changed.
    """
    own = [{key: group[key] for key in IMPLEMENTATION_OPTIONS if key in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, options in zip(optimizer.param_groups, own, strict=True):
        group.update(options)
    for param, param_state in optimizer.state.items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                # empty_like keeps the parameter's device and strides (channels-last or not).
                param_state[name] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def checkpoint_to_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """Which checkpoint to continue from: --resume PATH, or with --resume auto (and in an attempt that
    torchrun restarted) the one in --output-dir if there is one. A fresh run refuses to overwrite one."""
    existing = Path(output_dir) / CHECKPOINT_NAME
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and existing.is_file():
        return existing  # a restarted attempt goes on from where the failed one got to, whatever --resume says
    if resume == "auto":
        return existing if existing.is_file() else None
    if resume:
        path = Path(resume)
        if path.is_dir():
            raise UserInputError(f"--resume {resume}: is a folder; name its {CHECKPOINT_NAME}, or use --resume auto "
                                 "with --output-dir set to that folder")
        if not path.is_file():
            raise UserInputError(f"--resume {resume}: no such file")
        return path
    if existing.is_file():
        raise UserInputError(f"--output-dir {output_dir}: holds a run already ({existing}); continue it with "
                             "--resume auto, or choose another --output-dir")
    return None


def load_file(path: Path, flag: str) -> Any:
    """torch.load of a file the user named, restricted to tensors and plain data (`weights_only`: a .pth file
    is a pickle, and unpickling an untrusted one can run any code); a file that is not such a file ends in
    one line of our own words, naming the flag and the file."""
    if path.is_dir():
        raise UserInputError(f"{flag} {path}: is a folder; name the .pth file inside it")
    if path.is_file() and path.stat().st_size == 0:
        raise UserInputError(f"{flag} {path}: is empty (0 bytes), perhaps a copy or download that broke off")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Unsupported global" not in str(err):
            raise UserInputError(f"{flag} {path}: not a PyTorch file (damaged, cut short, or another kind of file)"
                                 ) from None
        raise UserInputError(f"{flag} {path}: holds Python objects besides tensors, which are not loaded because "
                             "loading them could run any code; save a state_dict of tensors instead") from None
    except Exception:
        raise UserInputError(f"{flag} {path}: not a PyTorch file (damaged, cut short, or another kind of file)"
                             ) from None


def read_checkpoint(path: Path) -> dict[str, Any]:
    checkpoint = load_file(path, "--resume")
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "scheduler", "epoch"} <= set(checkpoint):
        raise UserInputError(f"--resume {path}: not a checkpoint of this project (a plain weights file? "
                             "start from it with --weights instead)")
    return checkpoint


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               factor: float) -> None:
    """Scale the saved lr (current, initial and the schedule's base) when the world size changed."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        group["initial_lr"] *= factor
    scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]


def broadcast_from_main(obj: object) -> object:
    """Rank 0's `obj` on every rank: only rank 0 needs to see the file system."""
    if not is_dist_avail_and_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class SavedRun:
    """The checkpoint a run continues from: its path and contents; both None for a fresh start."""

    path: str | None = None
    state: dict[str, Any] | None = None

    @property
    def split(self) -> dict[str, list[str]] | None:
        """The classes and the train/validation split the run started with (None before they were saved)."""
        return self.state.get("split") if self.state else None


def find_saved_run(resume_flag: str | None, output_dir: str | os.PathLike, ctx: DistContext) -> SavedRun:
    """The checkpoint to continue from, read by rank 0 and sent to every rank; found before the data is
    read, since a resumed run keeps the classes and the split it started with."""
    found: tuple[str, Any] | None = None
    if ctx.is_main:
        try:
            path = checkpoint_to_resume(resume_flag, output_dir)
            found = (str(path), read_checkpoint(path)) if path else None
        except UserInputError as err:
            found = ("error", str(err))  # every rank raises it, rather than waiting for rank 0
    found = broadcast_from_main(found)
    if found and found[0] == "error":
        raise UserInputError(found[1])
    return SavedRun(*found) if found else SavedRun()


def resume(saved: SavedRun, ctx: DistContext, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, options: StepOptions) -> tuple[EpochProgress, float]:
    """Load the saved run into this one, if there is one; return (where training goes on, best accuracy so
    far)."""
    if saved.state is None:
        return EpochProgress(0), 0.0
    path, checkpoint = saved.path, saved.state
    try:
        unwrap_model(model).load_state_dict(checkpoint["model"])
        load_optimizer_state(optimizer, checkpoint["optimizer"])
    except (RuntimeError, ValueError) as err:
        args = checkpoint.get("args", {})
        raise UserInputError(f"--resume {path}: saved from --model {args.get('model')} on data with other "
                             f"classes or another model; it does not fit ({str(err).splitlines()[0]})") from None
    scheduler.load_state_dict(checkpoint["scheduler"])
    if options.scaler.is_enabled() and checkpoint.get("scaler"):  # empty when saved by a run without fp16
        options.scaler.load_state_dict(checkpoint["scaler"])
    states = checkpoint["rng"]
    if len(states) == ctx.world_size:
        set_rng_state(states[ctx.rank])
    else:
        print_main(f"Resuming with {ctx.world_size} processes instead of {len(states)}: the batches and the "
                   "random augmentations differ from the saved run's, not the images left to train on")
    # The lr was scaled with the batch of one optimizer step (processes x accumulated batches); follow it.
    saved_batches = len(states) * checkpoint.get("args", {}).get("accum_steps", 1)
    if ctx.world_size * options.accum_steps != saved_batches:
        rescale_lr(optimizer, scheduler, ctx.world_size * options.accum_steps / saved_batches)
        print_main(f"The lr is scaled by {ctx.world_size * options.accum_steps}/{saved_batches} with the batches "
                   "of one optimizer step (processes x --accum-steps)")
    progress = checkpoint.get("progress")
    start = EpochProgress(**progress) if progress else EpochProgress(checkpoint["epoch"] + 1)
    print_main(f"Resuming from {path} at epoch {start.epoch}, step {start.step}")
    return start, checkpoint["best_acc"]
