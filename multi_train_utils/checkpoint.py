"""Checkpoints that let a stopped run continue exactly where it was: what they hold, how a run goes on from one,
and where inside an epoch training stands (a checkpoint may be written after any optimizer step). Which file is
where, and finding and reading the one to resume, is recorder.py's; what each flag does on resume, config.py's."""

from __future__ import annotations

import math
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

from .config import applied_changes
from .confusion import class_figures
from .data import SkippingSampler, sampler_name
from .distributed_utils import (
    get_world_size,
    is_dist_avail_and_initialized,
    print_main,
    reduce_value,
    unwrap_model,
)
from .errors import UserInputError, report
from .files import megabytes, to_cpu
from .optim import Hook, StepEnd, StepOptions, align_schedule, optimizer_steps_per_epoch, scheduled_lr
from .recorder import (
    RunRecorder,
    SavedRun,
    model_weights,
    write_checkpoint,
)

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


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what a saved optimizer learnt (momentum, Adam's moments) into this run's optimizer, which keeps its
    own options: the lr and weight decay of this run's flags (a resume may change them), and how it runs on this
    run's device (a CPU run saves fused=False, and fp16 on a GPU needs the fused step GradScaler expects).
    Its buffers take the parameters' memory layout, which fused SGD requires after --channels-last changed."""
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, options in zip(optimizer.param_groups, own, strict=True):
        group.update(options)
    for param, param_state in optimizer.state.items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                # empty_like keeps the parameter's device and strides (channels-last or not).
                param_state[name] = torch.empty_like(param, dtype=value.dtype).copy_(value)








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
    epoch: int | None = None  # whose weights best.pth holds

    def update(self, metrics: dict[str, Any], prefix: str = "") -> bool:
        """Whether `metrics` (its `prefix` + metric) is the best so far (a tie is; a NaN or an infinity never, nor
        anything where the validation loss is not finite); if so, it is now."""
        value, higher = metrics[prefix + self.metric], BEST_METRICS[self.metric] == "higher"
        if not (math.isfinite(value) and math.isfinite(metrics[prefix + "val_loss"])):
            return False
        if self.value is not None and (value < self.value if higher else value > self.value):
            return False
        self.value, self.epoch = value, metrics["epoch"]
        return True

    def load_state_dict(self, state: dict[str, Any]) -> None:  # a saved run's best, if judged by this metric
        if state.get("metric") == self.metric:
            self.value, self.epoch = state["value"], state.get("epoch")


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
        self.steps_per_epoch = optimizer_steps_per_epoch(len(train_loader), options.accum_steps)
        self.samples_per_step = train_loader.batch_size * get_world_size() * options.accum_steps
        self.start = EpochProgress(0)
        self.best = Best(recorder.config.best_metric)
        self.hooks: list[Hook] = []  # whose state_dict() the checkpoint keeps too
        self.last_step: StepEnd | None = None
        self.last_saved: tuple[int, int | None] | None = None  # (epoch, step) of the last checkpoint written
        self.saved_at = time.monotonic()  # when it was written (or training started)
        if recorder.enabled:
            kept = recorder.config.keep_epoch_weights
            epochs = recorder.config.epochs if kept is None else min(kept + 1, recorder.config.epochs) if kept else 0
            warn_if_the_disk_is_short(recorder.output_dir, model, optimizer, epochs)

    def resume(self, saved: SavedRun) -> int:
        """Load the saved run into this one; return the epoch training goes on in. What the optimizer, the schedule
        and the features do from here is this run's configuration: a flag changed on resume applies from the first
        step this run takes (config.ON_RESUME), and is said."""
        checkpoint = saved.state
        problem = state_dict_mismatch(unwrap_model(self.model), checkpoint["model"])
        if problem:
            raise UserInputError(f"--resume {saved.path}: saved from another model, or for other classes, than "
                                 f"--model {self.recorder.config.model} here; it does not fit ({problem})")
        unwrap_model(self.model).load_state_dict(checkpoint["model"])
        try:
            load_optimizer_state(self.optimizer, checkpoint["optimizer"])
        except ValueError as err:  # another set of parameters
            raise UserInputError(f"--resume {saved.path}: its optimizer state does not fit this run's optimizer "
                                 f"({str(err).splitlines()[0]}); resume with the run's --model and --opt") from None
        # Ours follows the flags and the step (align_schedule); a schedule of one's own goes on from its state.
        if self.scheduler is not None and checkpoint.get("scheduler") and not isinstance(
                self.scheduler, torch.optim.lr_scheduler.LambdaLR):
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        if self.options.scaler.is_enabled() and checkpoint.get("scaler"):  # empty when saved without fp16
            self.options.scaler.load_state_dict(checkpoint["scaler"])
        self.restore_random_states(checkpoint, saved.path)
        self.best.load_state_dict(saved_best(checkpoint))
        progress = checkpoint.get("progress")
        self.start = EpochProgress(**progress) if progress else EpochProgress(checkpoint["epoch"] + 1)
        # The position is kept in samples: with other processes or batches, it is another step.
        self.start.step = self.start.samples_seen // self.samples_per_step
        print_main(f"Resuming from {saved.path} at epoch {self.start.epoch}, step {self.start.step}")
        if "args" not in checkpoint:
            print_main(f"--resume {saved.path}: holds no flags (an older or hand-made checkpoint): this command's "
                       "flags and their defaults are taken as the run's")
        if "split" not in checkpoint:
            print_main(f"--resume {saved.path}: holds no split (an older or hand-made checkpoint): the validation "
                       f"images are drawn again from --data-path with --seed {self.recorder.config.seed}, and differ "
                       "from the run's if the folder or the seed changed")
        changes = applied_changes(self.recorder.config, checkpoint.get("args") or {})
        now, saved_sampler = sampler_name(self.train_loader.sampler), checkpoint.get("sampler")
        if saved_sampler not in (None, now):  # the code changed: no flag says it
            changes.append(f"the training sampler {saved_sampler} -> {now}")
        if changes:
            print_main(f"Changed on resume, applied from here on and kept in the checkpoints: {', '.join(changes)}")
        return self.start.epoch

    def restore_random_states(self, checkpoint: dict[str, Any], path: str | None) -> None:
        """Every rank's random state, where the saved run had as many ranks."""
        states, world_size = checkpoint.get("rng"), get_world_size()
        if states is None:
            print_main(f"--resume {path}: holds no random states (an older or hand-made checkpoint): the random "
                       "augmentations are drawn anew, so the run will not end as an unbroken one would, bit for bit")
        elif len(states) == world_size:
            set_rng_state(states[dist.get_rank() if is_dist_avail_and_initialized() else 0])
        elif isinstance(self.train_loader.sampler, SkippingSampler) and checkpoint.get("progress"):
            print_main(f"Resuming inside an epoch with {world_size} processes instead of {len(states)}: the training "
                       f"sampler {sampler_name(self.train_loader.sampler)} has no skip() of its own (data.py), so each "
                       "process leaves out its share of the samples trained, counted in its own order: some images "
                       "of this epoch may come twice and others not at all")
        else:
            print_main(f"Resuming with {world_size} processes instead of {len(states)}: the batches and the "
                       "random augmentations differ from the saved run's, not the images left to train on, and "
                       "the lr follows the batch of one step (processes x --accum-steps)")

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
        trained = (self.last_step.images * get_world_size()) if self.last_step else 0  # none: it ended at a step
        trained_loss = metrics["train_loss"] * trained if trained else 0.0
        metrics["train_loss"] = (before.loss_sum + trained_loss) / (before.samples_seen + trained)
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
            "rng": to_cpu(gather_rng_states()), "args": self.recorder.config.as_saved(), "split": self.recorder.split,
            "sampler": sampler_name(self.train_loader.sampler),
        }
        for hook in self.hooks:
            if hook.name:
                checkpoint[hook.name] = hook.state_dict()
        return checkpoint

    def save_at(self, step: StepEnd) -> EpochProgress:
        """Write the checkpoint of the step just taken (every rank takes part); return where it stands."""
        step.stop_if_diverged(step.step)  # a checkpoint never keeps NaN weights
        progress = self.position(step)
        self.write(self.build(step.epoch - 1, replace(progress)))
        self.last_saved, self.saved_at = (progress.epoch, progress.step), time.monotonic()
        return progress

    def save_epoch(self, epoch: int) -> None:
        """Write the checkpoint of the end of `epoch` (every rank takes part)."""
        self.write(self.build(epoch))
        self.last_saved, self.saved_at = (epoch, None), time.monotonic()

    def write(self, checkpoint: dict[str, Any]) -> None:
        if self.recorder.enabled:
            write_checkpoint(self.recorder.output_dir, checkpoint, self.recorder.config.keep_checkpoints)

    def end_epoch(self, epoch: int, metrics: dict[str, Any], sums: dict[str, torch.Tensor], last_epoch: int) -> None:
        """Write the epoch's line of metrics.jsonl (with every class's figures, from validation's `sums`), its
        weights (best.pth when they are the best so far, by --best-metric) and, when it is due, its checkpoint
        (every rank takes part)."""
        metrics.update(class_figures(sums, self.recorder.class_names))
        self.recorder.end_epoch(self.model, metrics, sums.get("confusion"), improved=self.best.update(metrics),
                                run_step=(epoch + 1) * self.steps_per_epoch, best_epoch=self.best.epoch)
        if self.recorder.checkpoint_due(epoch, last_epoch):  # the same answer on every rank
            self.save_epoch(epoch)
        if epoch == last_epoch:
            self.say_what_the_run_left()

    def say_what_the_run_left(self) -> None:
        """At the end of the last epoch: which epoch was best, where its weights are, and what to run next."""
        folder = self.recorder.output_dir
        if self.best.epoch is not None:
            print_main(f"Finished: the best epoch by {self.best.metric} was {self.best.epoch} ({self.best.value:.4g}); "
                       f"its weights are {folder / 'weights' / 'best.pth'}")
        print_main(f"Next: the same command with --eval-only evaluates them again; python predict.py --run {folder} "
                   f"IMAGE... classifies images; tensorboard --logdir {folder} draws the curves")
