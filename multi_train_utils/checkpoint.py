"""Checkpoints that let a stopped run continue exactly where it was: what they hold, which one to resume,
and where inside an epoch training stands (a checkpoint may be written after any optimizer step)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from .distributed_utils import (
    get_world_size,
    is_dist_avail_and_initialized,
    print_main,
    read_on_main,
    reduce_value,
    unwrap_model,
)
from .errors import UserInputError, report
from .files import load_file, megabytes, to_cpu
from .optim import align_schedule, scheduled_lr
from .recorder import (
    CHECKPOINT_NAME,
    LOCK_NAME,
    RunRecorder,
    SavedRun,
    model_weights,
    newest_readable,
    refuse_a_folder_in_use,
)
from .train_eval_utils import Hook, StepEnd, StepOptions, stop_if_diverged

# Which way each --best-metric improves.
BEST_METRICS = {"val_acc": "higher", "val_loss": "lower"}


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


@dataclass
class EpochProgress:
    """Where training stands inside an epoch, as a checkpoint written there keeps it."""

    epoch: int
    step: int = 0  # optimizer steps done in the epoch
    samples_seen: int = 0  # by all processes together: a position that holds with another number of them
    loss_sum: float = 0.0  # their summed training loss (for the epoch's train_loss)


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
    """The flags of the run to resume (or validate), {} if there is none; read without loading its tensors (mmap),
    since the flags are parsed before rank 0 reads the checkpoint."""
    try:
        path = checkpoint_to_resume(resume, output_dir)
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if path else None
    except Exception:
        return {}  # find_saved_run names what is wrong with the file
    flags = saved.get("args") if isinstance(saved, dict) else None
    return flags if isinstance(flags, dict) else {}


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


def find_saved_run(resume_flag: str | None, output_dir: str | os.PathLike) -> SavedRun:
    """The checkpoint to continue from, read by rank 0 and sent to every rank (before the data is read: a
    resumed run keeps its classes and split)."""
    return SavedRun(*read_on_main(lambda: saved_checkpoint(resume_flag, Path(output_dir))))


def saved_checkpoint(resume_flag: str | None, output_dir: Path) -> tuple[str | None, dict[str, Any] | None]:
    with contextlib.suppress(OSError), open(output_dir / LOCK_NAME) as lock:  # no lock file: no run in it
        refuse_a_folder_in_use(output_dir, lock)  # before anything else
    path = checkpoint_to_resume(resume_flag, output_dir)
    return (str(path), read_checkpoint(path)) if path else (None, None)


def state_dict_mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """What keeps `state` from loading into `model`, in a few words (how many tensors, and the first of each
    kind); None if it fits."""
    own = model.state_dict()
    missing = [name for name in own if name not in state]
    unexpected = [name for name in state if name not in own]
    reshaped = [name for name in own if name in state and own[name].shape != state[name].shape]
    parts = [f"{len(missing)} tensor(s) missing, such as {missing[0]}" if missing else "",
             f"{len(unexpected)} not in this model, such as {unexpected[0]}" if unexpected else "",
             f"{len(reshaped)} of another shape, such as {reshaped[0]} ({tuple(state[reshaped[0]].shape)} saved, "
             f"{tuple(own[reshaped[0]].shape)} here)" if reshaped else ""]
    return "; ".join(part for part in parts if part) or None


@dataclass
class Best:
    """The best value of one validation metric so far: the one rule of "better", for best.pth and best_ema.pth."""

    metric: str = "val_acc"
    value: float | None = None

    def update(self, metrics: dict[str, Any], prefix: str = "") -> bool:
        """Whether `metrics` (its `prefix` + metric) is the best so far (a tie is, a NaN never); if so, it is now."""
        value, higher = metrics[prefix + self.metric], BEST_METRICS[self.metric] == "higher"
        if value != value or (self.value is not None and (value < self.value if higher else value > self.value)):
            return False
        self.value = value
        return True

    def load_state_dict(self, state: dict[str, Any]) -> None:  # a saved run's best, if judged by this metric
        if state.get("metric") == self.metric:
            self.value = state["value"]


def warn_if_the_disk_is_short(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                              epochs_with_weights: int) -> None:
    """Say at the start, not epochs later, that the disk cannot hold what the run writes: the checkpoint (the
    weights and the optimizer's state of 0, 1 or 2 tensors per weight), best.pth and each model-N.pth."""
    weights = 0
    for value in unwrap_model(model).state_dict().values():
        if isinstance(value, torch.Tensor):  # not a module's extra state, which may be anything
            weights += value.numel() * value.element_size()
    state_per_weight = 2 if "betas" in optimizer.defaults else 1 if optimizer.defaults.get("momentum") else 0
    needed, free = weights * (2 + state_per_weight + epochs_with_weights), shutil.disk_usage(folder).free
    if free < needed:
        report(f"warning: {folder} has {megabytes(free)} free, and the run writes about {megabytes(needed)} "
               "(checkpoint.pth, best.pth, model-N.pth of each epoch): it will stop when the disk is full, keeping "
               "what it wrote before")


def saved_best(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The best of a checkpoint; one written before --best-metric existed kept its accuracy as best_acc."""
    return checkpoint.get("best") or {"metric": "val_acc", "value": checkpoint.get("best_acc")}


class Checkpointer(Hook):
    """The run's checkpoints: it resumes the saved run, follows where training stands inside each epoch,
    and builds the checkpoint at the end of an epoch or, when a feature asks (a stop signal, a cadence),
    after any optimizer step. Every rank builds them (the random states are gathered from all); rank 0 writes.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, options: StepOptions,
                 recorder: RunRecorder, train_loader: DataLoader) -> None:
        self.model, self.optimizer, self.scheduler, self.options = model, optimizer, scheduler, options
        self.recorder, self.train_loader = recorder, train_loader
        self.steps_per_epoch = -(-len(train_loader) // options.accum_steps)
        self.samples_per_step = train_loader.batch_size * get_world_size() * options.accum_steps
        self.start = EpochProgress(0)
        self.best = Best(recorder.args.get("best_metric", "val_acc"))
        self.hooks: list[Hook] = []  # whose state_dict() the checkpoint keeps too
        self.last_step: StepEnd | None = None
        self.last_saved: tuple[int, int | None] | None = None  # (epoch, step) of the last checkpoint written
        self.saved_at = time.monotonic()  # when it was written (or training started)
        if recorder.enabled:
            epochs = recorder.args.get("epochs", 1) if recorder.args.get("keep_epoch_weights", True) else 0
            warn_if_the_disk_is_short(recorder.output_dir, model, optimizer, epochs)

    def resume(self, saved: SavedRun) -> int:
        """Load the saved run into this one; return the epoch training goes on in."""
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
        except ValueError as err:  # another set of parameters
            raise UserInputError(f"--resume {saved.path}: its optimizer state does not fit this run's optimizer "
                                 f"({str(err).splitlines()[0]}); resume with the run's --model and --opt") from None
        if self.scheduler is not None and checkpoint.get("scheduler"):
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        if self.options.scaler.is_enabled() and checkpoint.get("scaler"):  # empty when saved without fp16
            self.options.scaler.load_state_dict(checkpoint["scaler"])
        self.restore_random_states(checkpoint)
        self.best.load_state_dict(saved_best(checkpoint))
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
        if batches != saved_batches and self.scheduler is not None:
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
        if self.scheduler is not None:
            align_schedule(self.scheduler, epoch * self.steps_per_epoch + before.step)  # the lr moves every step
        self.last_step = None

    def on_step_end(self, step: StepEnd) -> None:
        self.last_step = step

    def position(self, step: StepEnd) -> EpochProgress:
        """Where training stands after `step`, counting the part of the epoch trained before this run."""
        before = self.resumed_part(step.epoch)
        loss_sum = reduce_value(step.loss_sum.detach().clone().float(), average=False).item()
        return EpochProgress(step.epoch, step.step, before.samples_seen + step.images * get_world_size(),
                             before.loss_sum + loss_sum)

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """A resumed epoch reports the figures of the whole epoch: its loss over every image of it, and the lr
        of its first step."""
        before = self.resumed_part(epoch)
        if not before.samples_seen:
            return
        trained = (self.last_step.images * get_world_size()) if self.last_step else 0
        metrics["train_loss"] = (before.loss_sum + metrics["train_loss"] * trained) / (before.samples_seen + trained)
        if self.scheduler is not None:
            metrics["lr"] = scheduled_lr(self.scheduler, epoch * self.steps_per_epoch)

    def build(self, epoch: int, progress: EpochProgress | None = None) -> dict[str, Any]:
        """All it takes to continue after `epoch` (the last finished one), or from `progress` inside the next:
        weights, optimizer and schedule, the fp16 loss scale, the best figure so far, the random states of
        every rank, the arguments (to check that a resumed run is the same run), the classes and split it
        trains on, and the state of the hooks that keep one (the moving average of --model-ema)."""
        checkpoint = {
            "model": model_weights(self.model), "optimizer": to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.options.scaler.state_dict(), "epoch": epoch,
            "progress": asdict(progress) if progress else None, "best": asdict(self.best),
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
        self.recorder.write_checkpoint(self.build(step.epoch - 1, replace(progress)),
                                       f"epoch-{progress.epoch}-step-{progress.step}")
        self.last_saved, self.saved_at = (progress.epoch, progress.step), time.monotonic()
        return progress

    def save_epoch(self, epoch: int) -> None:
        """Write the checkpoint of the end of `epoch` (every rank takes part)."""
        self.recorder.write_checkpoint(self.build(epoch), f"epoch-{epoch}-end")
        self.last_saved, self.saved_at = (epoch, None), time.monotonic()

    def improved(self, metrics: dict[str, Any]) -> bool:
        """Whether the epoch's `metrics` are the best so far, by --best-metric: best.pth is due."""
        return self.best.update(metrics)
