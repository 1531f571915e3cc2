"""The training and validation loops: the only ones in the repository, for one process or many."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .checkpoint import EpochProgress, gather_rng_states, make_checkpoint
from .confusion import count_confusion, per_class
from .ddp import broadcast_buffers_from_main, unwrap_model
from .distributed_utils import get_world_size, is_main_process, print_main, reduce_value
from .ema import ModelEma
from .errors import Preempted, UserInputError, report
from .preemption import StepControl, stop_signal, stopping_at_steps
from .recorder import RunRecorder
from .step_options import StepOptions

LOG_EVERY = 10  # steps between progress-bar updates; each update waits for the device


class NonFiniteLossError(UserInputError):
    """The loss became NaN or infinite: training has diverged. Raised on every rank at the same step."""


@dataclass(frozen=True)
class EvalResult:
    correct: int
    total: int
    loss: float  # mean cross-entropy per image
    # rows: true class, columns: predicted class, in class-index order; sums to `total`
    confusion: list[list[int]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def figures(self, class_names: list[str]) -> dict[str, Any]:
        """The result as metrics.jsonl and --eval-only write it."""
        return {"val_correct": self.correct, "val_total": self.total, "val_acc": self.accuracy,
                "val_loss": self.loss, "confusion_matrix": self.confusion,
                "per_class": per_class(self.confusion, class_names)}


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int, options: StepOptions | None = None,
                    on_first_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    ema: ModelEma | None = None, progress: EpochProgress | None = None,
                    after_step: Callable[[EpochProgress, torch.Tensor, torch.Tensor], None] | None = None) -> float:
    """Train on this process's share of one epoch (what is left of it after `progress`); return the mean loss
    over all processes' images.

    With options.accum_steps K, the gradients of K batches are added up before each optimizer step: K
    batches of b images take the same step as one batch of K*b (BatchNorm statistics aside). After each
    optimizer step, the schedule and `ema` move on, `progress` counts the step, and `after_step(progress,
    loss_sum, non_finite)` may write a checkpoint or stop the run.
    """
    options = options or StepOptions(device.type)
    progress = progress or EpochProgress(epoch)
    model.train()
    loss_function = options.loss_function()
    # Summed on the device and read only every LOG_EVERY steps: reading them every step would make the
    # CPU wait for the GPU every step. A resumed epoch starts from the sums of the part already trained.
    loss_sum = torch.tensor(progress.loss_sum if is_main_process() else 0.0, device=device)
    images_seen = progress.samples_seen if is_main_process() else 0
    non_finite = torch.zeros((), device=device)
    batches = len(data_loader)
    optimizer.zero_grad(set_to_none=True)
    bar = tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(),
               dynamic_ncols=True)
    step = -1  # an empty loader still reaches the check below
    for step, (images, labels) in enumerate(bar):
        if step == 0 and on_first_batch is not None:
            on_first_batch(images, labels)
        images, labels = options.to_device(images, labels, device)
        group_size, last_micro_step = accumulation_group(step, batches, options.accum_steps)
        with options.no_sync(model, last_micro_step):
            with options.autocast():
                loss = loss_function(model(images), labels)
            # Each process's loss is its own; DDP averages the gradients across processes inside backward().
            options.scaler.scale(loss / group_size).backward()
        loss_sum += loss.detach().float() * labels.size(0)
        non_finite += ~torch.isfinite(loss.detach())
        images_seen += labels.size(0)
        if last_micro_step:
            optimizer_step(model, optimizer, options, scheduler, ema)
            progress.step += 1
            progress.samples_seen += group_size * labels.size(0) * get_world_size()
            if after_step is not None:
                after_step(progress, loss_sum, non_finite)
        if (step + 1) % LOG_EVERY == 0:
            stop_if_diverged(non_finite, epoch, step)
            if is_main_process():
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
    stop_if_diverged(non_finite, epoch, step)
    totals = reduce_value(torch.stack([loss_sum, torch.tensor(float(images_seen), device=device)]), average=False)
    return (totals[0] / totals[1]).item()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, options: StepOptions,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, ema: ModelEma | None) -> None:
    """Step the optimizer (through the loss scaler and the gradient clipping), then the schedule and the
    moving average of the weights."""
    options.optimizer_step(model, optimizer)
    if scheduler is not None:
        scheduler.step()
    if ema is not None:
        ema.update(model)


def accumulation_group(step: int, batches: int, accum_steps: int) -> tuple[int, bool]:
    """The size of the group of batches whose gradients `step` adds to, and whether it is the group's last.
    The last group of an epoch may hold fewer than accum_steps batches; each batch weighs 1/(its group's size)."""
    group_start = step - step % accum_steps
    group_size = min(accum_steps, batches - group_start)
    return group_size, step == group_start + group_size - 1


def stop_if_diverged(non_finite: torch.Tensor, epoch: int, step: int) -> None:
    """Stop every process at the same step if the loss of any of them was NaN or infinite.

    One all-reduce tells every rank the same count, so all raise together; a rank that stopped alone
    would leave the others waiting for it in their next collective.
    """
    count = int(reduce_value(non_finite.clone(), average=False).item())
    if count:
        raise NonFiniteLossError(f"epoch {epoch}, step {step}: the training loss became NaN or infinite "
                                 f"({count} time(s) since the last check), so training stopped; the checkpoint "
                                 "of the last finished epoch is kept. Try a smaller --lr")


@torch.no_grad()
def evaluate(model: nn.Module, data_loader: DataLoader, device: torch.device,
             options: StepOptions | None = None, num_classes: int | None = None) -> EvalResult:
    """Correct count, image count, mean loss and confusion matrix over the whole validation set, summed
    over processes.

    Each process evaluates its own unpadded share with the plain model (not DDP, so ranks with one batch
    more or less never wait for each other); one all-reduce then adds all the sums. Without
    `num_classes` no matrix is counted: every rank must all-reduce sums of one size, and a rank without a
    batch could not learn the width of the model's output.
    """
    options = options or StepOptions(device.type)
    broadcast_buffers_from_main(model)  # every rank evaluates the model that rank 0 saves
    model = unwrap_model(model)  # uncompiled too: evaluating does not pay for a second compilation
    model.eval()
    # correct, total, summed loss, then the confusion matrix row by row: float64 counts exactly to 2**53
    num_classes = num_classes or 0
    sums = torch.zeros(3 + num_classes**2, dtype=torch.float64, device=device)
    # A bar that erases itself when done: on a terminal only, where erasing works; in a log file or a pipe
    # it would leave its frames in front of the next line (the JSON line of --eval-only).
    for images, labels in tqdm(data_loader, desc="validate", file=sys.stdout, leave=False, dynamic_ncols=True,
                               disable=not (is_main_process() and sys.stdout.isatty())):
        images, labels = options.to_device(images, labels, device)
        with options.autocast():
            logits = model(images)
        predictions = logits.argmax(dim=1)
        sums[0] += (predictions == labels).sum()
        sums[1] += labels.numel()
        sums[2] += nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        if num_classes:
            sums[3:] += count_confusion(labels, predictions, num_classes).flatten()
    totals = reduce_value(sums, average=False).cpu()
    correct, total, loss_sum = totals[:3].tolist()
    confusion = totals[3:].long().view(num_classes, num_classes).tolist()
    return EvalResult(int(correct), int(total), loss_sum / total if total else float("nan"), confusion)


def evaluate_only(model: nn.Module, val_loader: DataLoader, device: torch.device, options: StepOptions,
                  class_names: list[str]) -> EvalResult:
    """--eval-only: validate the loaded weights once and print the figures as the last line of standard
    output, one JSON object (rank 0 alone): the numbers of the epoch that saved the weights."""
    result = evaluate(model, val_loader, device, options, len(class_names))
    if is_main_process():
        print(json.dumps(result.figures(class_names)), flush=True)
    return result


def cosine_with_warmup(epochs: int, lrf: float, warmup_epochs: int = 0, steps_per_epoch: int = 1,
                       ) -> Callable[[int], float]:
    """Factor of the base lr at each optimizer step: a linear warm-up over `warmup_epochs`, then a cosine
    from 1 down to `lrf` at the end of the last epoch. Per step, not per epoch: a one-epoch warm-up then
    rises in as many small steps as the epoch has, instead of starting the epoch at half the lr and
    jumping to the whole of it."""
    warmup_steps = warmup_epochs * steps_per_epoch
    total_steps = epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return ((1 + math.cos(progress * math.pi)) / 2) * (1 - lrf) + lrf

    return factor


def optimizer_steps_per_epoch(train_loader: DataLoader, accum_steps: int = 1) -> int:
    return math.ceil(len(train_loader) / accum_steps)


def build_optimizer(model: nn.Module, lr: float, epochs: int, lrf: float = 0.1, warmup_epochs: int = 0,
                    steps_per_epoch: int = 1) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The tutorial's SGD (momentum 0.9, weight decay 5e-3) over the trainable parameters, with a cosine
    schedule (Bag of Tricks, arXiv:1812.01187) stepped after every optimizer step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused on CUDA: one kernel for all parameters, and GradScaler then checks for overflow on the GPU
    # instead of waiting for it on the host every step.
    optimizer = torch.optim.SGD(trainable, lr=lr, momentum=0.9, weight_decay=5e-3, fused=trainable[0].is_cuda)
    schedule = cosine_with_warmup(epochs, lrf, warmup_epochs, steps_per_epoch)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def scheduled_lrs(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> list[float]:
    """The lr of each parameter group at optimizer step `step` of a per-step schedule."""
    return [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]


def align_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put a per-step schedule at optimizer step `step`. A run resumed with other processes or batches
    takes another number of steps per epoch than the run that saved the schedule's step count."""
    if scheduler.last_epoch == step:
        return
    scheduler.last_epoch = step
    for group, lr in zip(scheduler.optimizer.param_groups, scheduled_lrs(scheduler, step), strict=True):
        group["lr"] = lr


@dataclass
class Checkpointer:
    """Builds the run's checkpoints, at the end of an epoch and inside one, and stops the run where a stop
    signal asks for it. Every rank builds them (the random states are gathered from all); rank 0 writes."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    options: StepOptions
    recorder: RunRecorder
    control: StepControl
    ema: ModelEma | None = None
    best_acc: float = 0.0

    def builder(self, epoch: int, progress: EpochProgress | None = None) -> Callable[[dict], dict[str, Any]]:
        """What builds the checkpoint from the weights: after `epoch`, or at `progress` in the epoch after it."""
        return partial(make_checkpoint, optimizer=self.optimizer, scheduler=self.scheduler, epoch=epoch,
                       best_acc=self.best_acc, rng_states=gather_rng_states(), args=self.recorder.args,
                       scaler=self.options.scaler, split=self.recorder.split, ema=self.ema, progress=progress)

    def after_step(self, progress: EpochProgress, loss_sum: torch.Tensor, non_finite: torch.Tensor) -> None:
        """Write a checkpoint inside the epoch when one is due or a stop signal came, then stop if it came."""
        save, stop = self.control.after_step(progress.epoch, progress.step)
        if not save:
            return
        stop_if_diverged(non_finite, progress.epoch, progress.step)  # a checkpoint never keeps NaN weights
        progress.loss_sum = reduce_value(loss_sum.detach().clone(), average=False).item()
        self.write(self.builder(progress.epoch - 1, replace(progress)))
        if stop:
            self.stop(f"at epoch {progress.epoch}, step {progress.step}")

    def write(self, builder: Callable[[dict], dict[str, Any]]) -> None:
        self.recorder.write_checkpoint(self.model, builder)
        self.control.checkpoint_written()

    def stop(self, where: str) -> None:
        """End the run after the checkpoint just written, on every rank once rank 0 has written it."""
        if is_main_process():  # now: a launcher stops the others once the first process has exited
            report(f"Stopped by {stop_signal() or 'a signal to another process'} {where}; its checkpoint is "
                   f"{self.recorder.checkpoint_path}; go on with --resume auto")
        self.control.wait_for_all()
        raise Preempted


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
        train_loader: DataLoader, val_loader: DataLoader, recorder: RunRecorder, epochs: int,
        device: torch.device, start: EpochProgress | None = None, best_acc: float = 0.0,
        options: StepOptions | None = None, ema: ModelEma | None = None) -> EvalResult:
    """Train and validate from `start` (an epoch, or a point inside one) to the last epoch, handing each
    epoch's figures and checkpoint to `recorder`; returns the last validation result. With `ema`, the
    averaged weights are validated and saved too. Checkpoints inside epochs follow --checkpoint-every-steps
    and --checkpoint-every-minutes; a stop signal ends the run with one (Preempted)."""
    options = options or StepOptions(device.type)
    start = start or EpochProgress(0)
    steps_per_epoch = optimizer_steps_per_epoch(train_loader, options.accum_steps)
    samples_per_step = train_loader.batch_size * get_world_size() * options.accum_steps
    args = recorder.args
    control = StepControl(args.get("checkpoint_every_steps"), args.get("checkpoint_every_minutes"), steps_per_epoch,
                          args.get("dist_timeout", 900.0))
    saver = Checkpointer(model, optimizer, scheduler, options, recorder, control, ema, best_acc)
    result = EvalResult(0, 0, float("nan"))
    if start.epoch >= epochs:
        print_main(f"Nothing to train: the run has finished all {epochs} epochs (a larger --epochs trains on)")
    with stopping_at_steps(args.get("stop_grace", 20.0)):
        for epoch in range(start.epoch, epochs):
            progress = start if epoch == start.epoch else EpochProgress(epoch)
            # The position is kept in samples: a run resumed with other processes or batches counts other steps.
            progress.step = progress.samples_seen // samples_per_step
            # A new shuffle every epoch, started after the samples a resumed run trained on already.
            train_loader.sampler.set_epoch(epoch, progress.samples_seen)
            align_schedule(scheduler, epoch * steps_per_epoch + progress.step)  # the lr moves every step
            outcome = train_and_validate(saver, train_loader, val_loader, device, progress)
            result = outcome.result
            due = recorder.checkpoint_due(epoch, last_epoch=epochs - 1)  # the same answer on every rank
            # A signal that came during validation stops the run here, unless there is nothing left to train.
            stop = control.stop_now() and epoch < epochs - 1
            checkpoint = saver.builder(epoch) if due or stop else None
            recorder.end_epoch(model, outcome.metrics, outcome.improved, checkpoint, outcome.best_ema)
            if checkpoint is not None:
                control.checkpoint_written()
            if stop:
                saver.stop(f"after epoch {epoch}")
    return result


@dataclass(frozen=True)
class EpochOutcome:
    result: EvalResult
    metrics: dict[str, Any]  # the epoch's line of metrics.jsonl
    improved: bool  # the best validation accuracy so far (ties too): best.pth is due
    best_ema: nn.Module | None  # the averaged model, if it reached its best accuracy so far


def train_and_validate(saver: Checkpointer, train_loader: DataLoader, val_loader: DataLoader, device: torch.device,
                       progress: EpochProgress) -> EpochOutcome:
    """Train one epoch (what is left of it after `progress`), validate, and gather the epoch's figures."""
    model, optimizer, options, recorder, ema = saver.model, saver.optimizer, saver.options, saver.recorder, saver.ema
    epoch = progress.epoch
    # The lr of the epoch's first step (also in a resumed epoch); the schedule moves every step.
    lr = scheduled_lrs(saver.scheduler, epoch * saver.control.steps_per_epoch)[0]
    started = time.perf_counter()
    # The first batch as TensorBoard shows it: what the model really sees after augmentation.
    show_batch = recorder.add_batch_grid if epoch == 0 else None
    train_loss = train_one_epoch(model, optimizer, train_loader, device, epoch, options, show_batch, saver.scheduler,
                                 ema, progress, saver.after_step)
    train_time = time.perf_counter() - started
    result = evaluate(model, val_loader, device, options, len(recorder.class_names))
    improved = result.accuracy >= saver.best_acc
    saver.best_acc = max(saver.best_acc, result.accuracy)
    images = len(train_loader) * train_loader.batch_size * get_world_size()
    metrics = {"epoch": epoch, "train_loss": train_loss, **result.figures(recorder.class_names), "lr": lr,
               "images_per_s": images / train_time, "epoch_time_s": time.perf_counter() - started,
               "world_size": get_world_size()}
    ema_improved = ema is not None and validate_ema(ema, val_loader, device, options, len(recorder.class_names),
                                                    metrics)
    return EpochOutcome(result, metrics, improved, ema.model if ema_improved else None)


def validate_ema(ema: ModelEma, val_loader: DataLoader, device: torch.device, options: StepOptions,
                 num_classes: int, metrics: dict[str, Any]) -> bool:
    """Validate the averaged weights, add their figures to `metrics` (ema_val_acc, ...), and return whether
    they are the best the average has reached."""
    result = evaluate(ema.model, val_loader, device, options, num_classes)
    metrics.update({"ema_val_acc": result.accuracy, "ema_val_loss": result.loss, "ema_val_correct": result.correct})
    improved = result.accuracy >= ema.best_acc
    ema.best_acc = max(ema.best_acc, result.accuracy)
    return improved
