"""The tutorial's train_eval_utils.py, correct where it is not: train_one_epoch, evaluate, and fit, which runs them
epoch after epoch; the only training and validation loops in the repository, for one process or many.

train_one_epoch is the tutorial's loop plus what DDP really needs: each process's loss its own, DDP averaging the
gradients inside backward() (once per group of accumulated batches), and every rank stopping at the same step when
the loss diverges. evaluate sums its figures over the processes, exactly: no image counted twice, none left out.
Both take the loss (the criterion) from the script that calls them. How each step runs (precision, memory format,
accumulation) is optim.py's, with the hooks through which what a run attaches to the loop (checkpoints, stops,
features: features.py) meets it.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .confusion import class_figures, class_sums, per_class
from .data import workers_ended
from .distributed_utils import (
    broadcast_buffers_from_main,
    get_world_size,
    is_main_process,
    print_main,
    reduce_sums,
    unwrap_model,
)
from .errors import NonFiniteLossError
from .features import attach
from .files import map_tensors
from .optim import Criterion, Hook, Hooks, StepEnd, StepOptions, optimizer_steps_per_epoch

if TYPE_CHECKING:
    from .recorder import RunRecorder

LOG_EVERY = 10  # batches between progress-bar updates; each update waits for the device
# One process draws the bars, so a thread lock will do. tqdm's own is a multiprocessing semaphore, which a
# process killed outright leaves behind, and the spawn script's resource tracker then warns of it.
tqdm.set_lock(threading.RLock())


def train_one_epoch(model: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    options: StepOptions | None = None, hooks: Hooks | None = None,
                    max_steps: int | None = None) -> float:
    """Train on this process's share of one epoch, or its first `max_steps` optimizer steps; return the mean loss
    over all processes' images. With accum_steps K, K batches of b images step as one batch of K*b."""
    options, hooks = options or StepOptions(device.type), hooks or Hooks()
    model.train()
    state, bar, last_step = epoch_progress(data_loader, epoch, options, model, device, max_steps)
    optimizer.zero_grad(set_to_none=True)
    with bar:
        for i, (images, labels) in enumerate(bar):
            if i == 0:
                hooks.call("on_first_batch", images, labels)
            images, labels = options.batch_transform(*options.to_device(images, labels, device))
            group_size, last_of_group = accumulation_group(i, len(data_loader), options.accum_steps)
            # Each process's loss is its own; DDP averages the gradients across processes inside backward(),
            # once per group of accumulated batches (no_sync skips it for the others).
            with options.no_sync(model, last_of_group):
                with options.autocast():
                    loss = criterion(model(images), labels)
                options.scaler.scale(loss / group_size).backward()
            if last_of_group:
                state.figures = {"loss": loss.detach(), "lr": optimizer.param_groups[0]["lr"],
                                 **options.clip_gradients(model, optimizer)}  # --clip-grad-norm
                options.scaler.step(optimizer)  # with fp16, skipped if the gradients overflowed
                options.scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
            state.count(loss, labels.size(0), stepped=last_of_group, hooks=hooks)
            if (i + 1) % LOG_EVERY == 0:
                state.stop_if_diverged(i)
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            if state.step == last_step:  # every rank takes as many steps: none waits in DDP's all-reduce
                break
    state.stop_if_diverged(len(data_loader) - 1)
    totals = reduce_sums({"loss": state.loss_sum, "images": torch.tensor(float(state.images), device=device)})
    return (totals["loss"] / totals["images"]).item()


def epoch_progress(data_loader: DataLoader, epoch: int, options: StepOptions, model: nn.Module,
                   device: torch.device, max_steps: int | None = None) -> tuple[StepEnd, tqdm, int | None]:
    """Where the epoch stands (summed on the device and read every LOG_EVERY batches: reading them every batch would
    stall the GPU), its progress bar, which counts the batches a resumed epoch trained before too, and the step
    to stop after, `max_steps` on (None: the epoch's end)."""
    sampler, batch_size = getattr(data_loader, "sampler", None), getattr(data_loader, "batch_size", None) or 1
    done = getattr(sampler, "skipped", 0) // batch_size  # the batches the run it resumes trained already
    batches = getattr(sampler, "epoch_length", 0) // batch_size or done + len(data_loader)
    state = StepEnd(epoch, done // options.accum_steps, optimizer_steps_per_epoch(batches, options.accum_steps), 0,
                    torch.zeros((), device=device), torch.zeros((), device=device), model)
    bar = tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(),
               dynamic_ncols=True, initial=done, total=batches)
    return state, bar, None if max_steps is None else state.step + max_steps


def accumulation_group(batch: int, batches: int, accum_steps: int) -> tuple[int, bool]:
    """The size of the group of accumulated batches `batch` is in (the epoch's last may be smaller), and
    whether `batch` is its last."""
    group_start = batch - batch % accum_steps
    group_size = min(accum_steps, batches - group_start)
    return group_size, batch == group_start + group_size - 1


def class_logits(output: Any) -> torch.Tensor:
    """The class logits (batch x classes) in what the model returns: the output itself, the first item of a tuple
    or list (a model with a second head returns the classifier's first), or a dict's "logits". The accuracy, the
    confusion matrix, predict.py and the default loss (model.build_criterion) take them through here alone: for
    a model that returns them otherwise, change this function."""
    if isinstance(output, torch.Tensor):
        return output
    return output["logits"] if isinstance(output, dict) else output[0]


def batch_sums(output: Any, labels: torch.Tensor, criterion: Criterion,
               num_classes: int | None) -> dict[str, torch.Tensor]:
    """One validation batch's figures as sums, each by name: added up over the batches and the processes, then
    turned into the epoch's metrics by EvalResult.figures. A new metric is one more sum here, and its figure
    there; it is then exact on any number of processes, and logged everywhere."""
    logits = class_logits(output)
    predictions = logits.argmax(dim=1)
    sums = {"correct": (predictions == labels).sum(), "total": torch.tensor(labels.numel(), device=labels.device),
            # the criterion's mean over the batch (of the output in float32: autocast's may be half), times its size:
            # the sum, whichever the batch sizes
            "loss": criterion(map_tensors(torch.Tensor.float, output), labels) * labels.numel() if labels.numel()
            else logits.sum()}
    if num_classes:
        sums.update(class_sums(labels, predictions, num_classes))
    return sums


@dataclass(frozen=True)
class EvalResult:
    """Every sum of batch_sums over the whole validation set and every process, and the figures made of them."""

    sums: dict[str, torch.Tensor]

    @property
    def correct(self) -> int:
        return int(self.sums["correct"])

    @property
    def total(self) -> int:
        return int(self.sums["total"])

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    @property
    def loss(self) -> float:
        return float(self.sums["loss"]) / self.total if self.total else float("nan")

    def figures(self) -> dict[str, Any]:
        """Validation's figures in metrics.jsonl and --eval-only (confusion.class_figures adds the classes')."""
        return {"val_correct": self.correct, "val_total": self.total, "val_acc": self.accuracy, "val_loss": self.loss}


@torch.no_grad()
def evaluate(model: nn.Module, criterion: Criterion, data_loader: DataLoader, device: torch.device,
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
    # The sums of an empty batch: where they start, and all a rank without a validation image adds.
    sums = batch_sums(torch.zeros(0, num_classes or 1, device=device), torch.zeros(0, dtype=torch.long, device=device),
                      criterion, num_classes)
    # A bar that erases itself when done: on a terminal only, where erasing works; in a log file or a pipe
    # it would leave its frames in front of the next line (the JSON line of --eval-only).
    for images, labels in tqdm(data_loader, desc="validate", file=sys.stdout, leave=False, dynamic_ncols=True,
                               disable=not (is_main_process() and sys.stdout.isatty())):
        images, labels = options.to_device(images, labels, device)
        with options.autocast():
            output = model(images)
        for name, value in batch_sums(output, labels, criterion, num_classes).items():
            sums[name] += value
    return EvalResult(reduce_sums(sums))


def evaluate_only(model: nn.Module, criterion: Criterion, val_loader: DataLoader, device: torch.device,
                  options: StepOptions, class_names: list[str]) -> EvalResult:
    """--eval-only: validate the loaded weights once and print their figures (print_figures)."""
    with workers_ended(val_loader):
        result = evaluate(model, criterion, val_loader, device, options, len(class_names))
    print_figures(result, class_names)
    return result


def print_figures(result: EvalResult, class_names: list[str]) -> None:
    """A validation's figures (the numbers of the epoch that saved the weights), every class's included, at any
    number of classes, as the last line of standard output: one JSON object, on rank 0."""
    if not math.isfinite(result.loss):  # the same on every rank
        raise NonFiniteLossError(f"--eval-only: the validation loss of these weights is {result.loss}: they have "
                                 "diverged; validate an earlier epoch's weights/model-N.pth instead")
    if is_main_process():
        figures = {**result.figures(), **class_figures(result.sums, class_names),
                   "per_class": per_class(result.sums, class_names)}
        print(json.dumps(figures, allow_nan=False), flush=True)


def fit(model: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer, train_loader: DataLoader,
        val_loader: DataLoader, device: torch.device, epochs: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, options: StepOptions | None = None,
        run: RunRecorder | None = None, hooks: Iterable[Hook] = ()) -> EvalResult | None:
    """Train and validate up to `epochs`, print each epoch's figures, return the last validation result; with
    `run`, also continue its saved state, write what it keeps, and attach what its flags ask for (features.py)."""
    options, result = options or StepOptions(device.type), None
    checkpoints = attach(run, model, optimizer, scheduler, options, criterion, train_loader, val_loader, epochs,
                         evaluate, hooks) if run else None
    hooks, start_epoch = (checkpoints.hooks, checkpoints.start.epoch) if checkpoints else (Hooks(hooks), 0)
    with hooks.running(), workers_ended(train_loader, val_loader):
        for epoch in range(start_epoch, epochs):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch: without it, each repeats the first
            hooks.call("on_epoch_start", epoch)
            lr, started = optimizer.param_groups[0]["lr"], time.perf_counter()  # the lr of the epoch's first step
            train_loss = train_one_epoch(model, criterion, optimizer, train_loader, device, epoch, scheduler,
                                         options, hooks)
            train_time = time.perf_counter() - started
            result = evaluate(model, criterion, val_loader, device, options, run and len(run.class_names))
            metrics = {"epoch": epoch, "train_loss": train_loss, **result.figures(), "lr": lr,
                       "images_per_s": len(train_loader) * train_loader.batch_size * get_world_size() / train_time,
                       "epoch_time_s": time.perf_counter() - started, "world_size": get_world_size()}
            hooks.call("on_validation_end", epoch, metrics)
            stop_if_not_finite(metrics)  # before anything of the epoch is written
            print_main(epoch_line(metrics))
            if checkpoints is not None:  # the run's: metrics.jsonl, the weights, and the checkpoint when due
                checkpoints.end_epoch(epoch, metrics, result.sums, last_epoch=epochs - 1)
            hooks.call("on_epoch_end", epoch, metrics)
    return result


def epoch_line(metrics: dict[str, Any]) -> str:
    """An epoch's figures on one line (its mean training loss: that of its last batch is the progress bar's)."""
    ema = f"  ema_acc {metrics['ema_val_acc']:.3f}" if "ema_val_acc" in metrics else ""
    return (f"[epoch {metrics['epoch']}] train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
            f"val_acc {metrics['val_acc']:.3f} ({metrics['val_correct']}/{metrics['val_total']}){ema}  "
            f"lr {metrics['lr']:.2e}  {metrics['images_per_s']:.1f} img/s  {metrics['epoch_time_s']:.1f} s")


def stop_if_not_finite(metrics: dict[str, Any]) -> None:
    """Stop every process (their figures are the same, summed over all of them) where an epoch's figure is NaN or
    infinite: the weights have diverged, and are neither written nor chosen as the best."""
    broken = [name for name, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]
    if broken:
        raise NonFiniteLossError(f"epoch {metrics['epoch']}: {', '.join(broken)} became {metrics[broken[0]]}: the "
                                 "weights have diverged, so training stopped without writing them; the last "
                                 "checkpoint written is kept. Try a smaller --lr")
