"""Checkpoints that let a stopped run continue exactly where it was: what they hold, which one to resume,
and where inside an epoch training stands (a checkpoint may be written after any optimizer step)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from model import state_dict_mismatch

from .ddp import unwrap_model
from .distributed_utils import DistContext, get_world_size, is_dist_avail_and_initialized, print_main, reduce_value
from .divergence import stop_if_diverged
from .errors import UserInputError
from .files import load_file, refuse_a_folder_in_use
from .hooks import Hook, StepEnd
from .optim import align_schedule, scheduled_lr
from .step_options import StepOptions

if TYPE_CHECKING:
    from .recorder import RunRecorder

CHECKPOINT_NAME = "checkpoint.pth"
KEPT_CHECKPOINTS = "checkpoints"  # the older checkpoints that --keep-checkpoints keeps
# What a run writes besides its checkpoint: if any of it is there, the folder holds a run's results.
RESULTS = ("metrics.jsonl", "weights/*.pth", f"{KEPT_CHECKPOINTS}/*.pth")


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
    """Where training stands inside an epoch: what a checkpoint written in the middle of one keeps, and
    where a run resumed from it goes on."""

    epoch: int
    step: int = 0  # optimizer steps done in the epoch
    # How many of the epoch's shuffled samples all processes together have trained on: the position that
    # still means the same with another number of processes.
    samples_seen: int = 0
    loss_sum: float = 0.0  # their summed training loss (for the epoch's train_loss)


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


def results_in(folder: Path) -> list[str]:
    """The results of a run found in `folder` (metrics, weights, checkpoints), as paths relative to it."""
    found = sorted({str(path.relative_to(folder)) for pattern in RESULTS for path in folder.glob(pattern)
                    if path.is_file()})
    return [name for name in found if name != "metrics.jsonl" or (folder / name).stat().st_size > 0]


def checkpoint_to_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """Which checkpoint to continue from: --resume PATH, or with --resume auto (and in an attempt that
    torchrun restarted) the one in --output-dir if there is one. A fresh run never replaces a run's checkpoint
    (nor, refuse_results_without_a_checkpoint, its other results)."""
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


def refuse_results_without_a_checkpoint(folder: Path) -> None:
    """Stop a fresh run before it overwrites, or mixes its own with, the metrics and weights of a run whose
    checkpoint is missing (--save-every and a crash, files deleted by hand)."""
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

    @property
    def start_epoch(self) -> int:
        """The first epoch the resumed run trains (a checkpoint inside an epoch names the one before)."""
        return self.state["epoch"] + 1 if self.state else 0


def find_saved_run(resume_flag: str | None, output_dir: str | os.PathLike, ctx: DistContext) -> SavedRun:
    """The checkpoint to continue from, read by rank 0 and sent to every rank; found before the data is
    read, since a resumed run keeps the classes and the split it started with. A folder another run is
    writing to is refused before anything else."""
    found: tuple[str, Any] | None = None
    if ctx.is_main:
        try:
            refuse_a_folder_in_use(Path(output_dir))
            path = checkpoint_to_resume(resume_flag, output_dir)
            found = (str(path), read_checkpoint(path)) if path else None
        except UserInputError as err:
            found = ("error", str(err))  # every rank raises it, rather than waiting for rank 0
    found = broadcast_from_main(found)
    if found and found[0] == "error":
        raise UserInputError(found[1])
    return SavedRun(*found) if found else SavedRun()


class Checkpointer(Hook):
    """The run's checkpoints: it resumes the saved run, follows where training stands inside each epoch,
    and builds the checkpoint at the end of an epoch or, when a feature asks (a stop signal, a cadence),
    after any optimizer step. Every rank builds them (the random states are gathered from all); rank 0 writes.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, options: StepOptions, recorder: RunRecorder,
                 train_loader: DataLoader) -> None:
        self.model, self.optimizer, self.scheduler, self.options = model, optimizer, scheduler, options
        self.recorder, self.train_loader = recorder, train_loader
        self.steps_per_epoch = -(-len(train_loader) // options.accum_steps)
        self.samples_per_step = train_loader.batch_size * get_world_size() * options.accum_steps
        self.start = EpochProgress(0)
        self.best_acc = 0.0
        self.hooks: list[Hook] = []  # whose state_dict() the checkpoint keeps too
        self.last_step: StepEnd | None = None
        self.last_saved: tuple[int, int | None] | None = None  # (epoch, step) of the last checkpoint written
        self.saved_at = time.monotonic()  # when it was written (or training started)

    def resume(self, saved: SavedRun) -> int:
        """Load the saved run into this one, if there is one; return the epoch training goes on in."""
        if saved.state is None:
            return 0
        checkpoint = saved.state
        problem = state_dict_mismatch(unwrap_model(self.model), checkpoint["model"])
        if problem:
            model = checkpoint.get("args", {}).get("model")
            raise UserInputError(f"--resume {saved.path}: saved from --model {model} on data with other classes "
                                 f"or another model; it does not fit ({problem})")
        unwrap_model(self.model).load_state_dict(checkpoint["model"])
        saved_opt, opt = checkpoint.get("args", {}).get("opt", "sgd"), self.recorder.args.get("opt", "sgd")
        if saved_opt != opt:
            raise UserInputError(f"--opt {opt}: the run to resume ({saved.path}) trained with --opt {saved_opt}, "
                                 "whose state this optimizer cannot take; resume with it")
        try:
            load_optimizer_state(self.optimizer, checkpoint["optimizer"])
        except ValueError as err:  # another --opt, or layers frozen or not (another set of parameters)
            raise UserInputError(f"--resume {saved.path}: its optimizer state does not fit this run's optimizer "
                                 f"({str(err).splitlines()[0]}); resume with the run's --opt and --freeze-layers"
                                 ) from None
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if self.options.scaler.is_enabled() and checkpoint.get("scaler"):  # empty when saved without fp16
            self.options.scaler.load_state_dict(checkpoint["scaler"])
        self.restore_random_states(checkpoint)
        self.best_acc = checkpoint["best_acc"]
        progress = checkpoint.get("progress")
        self.start = EpochProgress(**progress) if progress else EpochProgress(checkpoint["epoch"] + 1)
        # The position is kept in samples: with other processes or batches, it is another step.
        self.start.step = self.start.samples_seen // self.samples_per_step
        print_main(f"Resuming from {saved.path} at epoch {self.start.epoch}, step {self.start.step}")
        return self.start.epoch

    def restore_random_states(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's random state; with another number of processes, the lr follows the new batch."""
        states, world_size = checkpoint["rng"], get_world_size()
        if len(states) == world_size:
            set_rng_state(states[dist.get_rank() if is_dist_avail_and_initialized() else 0])
        else:
            print_main(f"Resuming with {world_size} processes instead of {len(states)}: the batches and the "
                       "random augmentations differ from the saved run's, not the images left to train on")
        # The lr was scaled with the batch of one optimizer step (processes x accumulated batches); follow it.
        saved_batches = len(states) * checkpoint.get("args", {}).get("accum_steps", 1)
        batches = world_size * self.options.accum_steps
        if batches != saved_batches:
            rescale_lr(self.optimizer, self.scheduler, batches / saved_batches)
            print_main(f"The lr is scaled by {batches}/{saved_batches} with the batches of one optimizer step "
                       "(processes x --accum-steps)")

    def resumed_part(self, epoch: int) -> EpochProgress:
        """What was trained of `epoch` before this run: all of the resumed epoch's first part, else nothing."""
        return self.start if epoch == self.start.epoch else EpochProgress(epoch)

    def on_epoch_start(self, epoch: int) -> None:
        before = self.resumed_part(epoch)
        # The resumed epoch's shuffle starts after the samples the stopped run trained on already.
        if before.samples_seen:
            self.train_loader.sampler.skip(before.samples_seen)
        align_schedule(self.scheduler, epoch * self.steps_per_epoch + before.step)  # the lr moves every step
        self.last_step = None

    def on_step_end(self, step: StepEnd) -> None:
        self.last_step = step

    def step_in_epoch(self, step: StepEnd) -> int:
        """Optimizer steps done in the epoch after `step`, those before the resume included."""
        return self.resumed_part(step.epoch).step + step.step

    def position(self, step: StepEnd) -> EpochProgress:
        """Where training stands after `step`, counting the part of the epoch trained before this run."""
        before = self.resumed_part(step.epoch)
        loss_sum = reduce_value(step.loss_sum.detach().clone().float(), average=False).item()
        return EpochProgress(step.epoch, self.step_in_epoch(step), before.samples_seen + step.images * get_world_size(),
                             before.loss_sum + loss_sum)

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """A resumed epoch reports the figures of the whole epoch: its loss over every image of it, and the lr
        of its first step."""
        before = self.resumed_part(epoch)
        if not before.samples_seen:
            return
        trained = (self.last_step.images * get_world_size()) if self.last_step else 0
        metrics["train_loss"] = (before.loss_sum + metrics["train_loss"] * trained) / (before.samples_seen + trained)
        metrics["lr"] = scheduled_lr(self.scheduler, epoch * self.steps_per_epoch)

    def build(self, epoch: int, progress: EpochProgress | None = None) -> dict[str, Any]:
        """All it takes to continue after `epoch` (the last finished one), or from `progress` inside the next:
        weights, optimizer and schedule, the fp16 loss scale, the best accuracy so far, the random states of
        every rank, the arguments (to check that a resumed run is the same run), the classes and split it
        trains on, and the state of the hooks that keep one (the moving average of --model-ema)."""
        checkpoint = {
            "model": model_weights(self.model), "optimizer": to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(), "scaler": self.options.scaler.state_dict(),
            "epoch": epoch, "progress": asdict(progress) if progress else None, "best_acc": self.best_acc,
            "rng": to_cpu(gather_rng_states()), "args": self.recorder.args, "split": self.recorder.split,
        }
        for hook in self.hooks:
            if hook.name:
                checkpoint[hook.name] = hook.state_dict()
        return checkpoint

    def save_at(self, step: StepEnd) -> EpochProgress:
        """Write the checkpoint of the step just taken (every rank takes part); return where it stands."""
        stop_if_diverged(step.non_finite, step.epoch, step.step)  # a checkpoint never keeps NaN weights
        progress = self.position(step)
        self.recorder.write_checkpoint(self.build(step.epoch - 1, replace(progress)))
        self.last_saved, self.saved_at = (progress.epoch, progress.step), time.monotonic()
        return progress

    def save_epoch(self, epoch: int) -> None:
        """Write the checkpoint of the end of `epoch` (every rank takes part)."""
        self.recorder.write_checkpoint(self.build(epoch))
        self.last_saved, self.saved_at = (epoch, None), time.monotonic()

    def improved(self, accuracy: float) -> bool:
        """Whether `accuracy` is the best so far (ties too): best.pth is due."""
        improved = accuracy >= self.best_acc
        self.best_acc = max(self.best_acc, accuracy)
        return improved
