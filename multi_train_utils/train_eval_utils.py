"""The training and validation loops: the only ones in the repository, for one process or many.

train_one_epoch is the tutorial's loop plus what DDP really needs (autocast, no_sync accumulation, the loss
summed without waiting for the device); fit.py runs it epoch after epoch with `evaluate`. Everything else
reaches them through `hooks` (hooks.py), at the edges.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .confusion import count_confusion, per_class
from .ddp import broadcast_buffers_from_main, unwrap_model
from .distributed_utils import is_main_process, reduce_sums, reduce_value
from .divergence import stop_if_diverged
from .hooks import Hooks, StepEnd
from .step_options import StepOptions

LOG_EVERY = 10  # batches between progress-bar updates; each update waits for the device
NO_HOOKS = Hooks()


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                    options: StepOptions | None = None, hooks: Hooks = NO_HOOKS) -> float:
    """Train on this process's share of one epoch; return the mean loss over all processes' images.

    With options.accum_steps K, the gradients of K batches add up before each optimizer step: K batches of
    b images take the same step as one batch of K*b (BatchNorm statistics aside).
    """
    options = options or StepOptions(device.type)
    model.train()
    loss_function = nn.CrossEntropyLoss(label_smoothing=options.label_smoothing)
    # Summed on the device and read only every LOG_EVERY batches: reading them every batch would make the
    # CPU wait for the GPU every batch.
    state = StepEnd(epoch, 0, 0, torch.zeros((), device=device), torch.zeros((), device=device), model)
    optimizer.zero_grad(set_to_none=True)
    with progress_bar(data_loader, epoch) as bar:
        for i, (images, labels) in enumerate(bar):
            if i == 0:
                hooks.on_first_batch(images, labels)
            images, labels = options.to_device(images, labels, device)
            group_size, last_of_group = accumulation_group(i, len(data_loader), options.accum_steps)
            # Each process's loss is its own; DDP averages the gradients across processes inside backward(),
            # once per group of accumulated batches (no_sync skips it for the others).
            with options.no_sync(model, last_of_group):
                with options.autocast():
                    loss = loss_function(model(images), labels)
                options.scaler.scale(loss / group_size).backward()
            state.loss_sum += loss.detach().float() * labels.size(0)
            state.non_finite += ~torch.isfinite(loss.detach())
            state.images += labels.size(0)
            if last_of_group:
                if options.clip_grad_norm is not None:  # on the true gradients: unscaled first under fp16
                    options.scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), options.clip_grad_norm)
                options.scaler.step(optimizer)  # with fp16, skipped if the gradients overflowed
                options.scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
                state.step += 1
                hooks.on_step_end(state)
            if (i + 1) % LOG_EVERY == 0:
                stop_if_diverged(state.non_finite, epoch, i)
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
    stop_if_diverged(state.non_finite, epoch, len(data_loader) - 1)
    totals = reduce_value(torch.stack([state.loss_sum, torch.tensor(float(state.images), device=device)]),
                          average=False)
    return (totals[0] / totals[1]).item()


def accumulation_group(batch: int, batches: int, accum_steps: int) -> tuple[int, bool]:
    """The size of the group of batches whose gradients `batch` adds to, and whether it is the group's last.
    The last group of an epoch may hold fewer than accum_steps batches; each batch weighs 1/(its group's size)."""
    group_start = batch - batch % accum_steps
    group_size = min(accum_steps, batches - group_start)
    return group_size, batch == group_start + group_size - 1


def progress_bar(data_loader: DataLoader, epoch: int) -> tqdm:
    """Rank 0's bar over the epoch's batches; in a resumed epoch it starts at the batches already trained."""
    sampler, batch_size = getattr(data_loader, "sampler", None), getattr(data_loader, "batch_size", None) or 1
    done = getattr(sampler, "skipped", 0) // batch_size
    return tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(),
                dynamic_ncols=True, initial=done, total=done + len(data_loader))


def batch_sums(logits: torch.Tensor, labels: torch.Tensor, num_classes: int | None) -> dict[str, torch.Tensor]:
    """One validation batch's figures as sums, each by name: added up over the batches and the processes, then
    turned into the epoch's metrics by EvalResult.figures. A new metric is one more sum here, and its figure
    there; it is then exact on any number of processes, and logged everywhere."""
    predictions = logits.argmax(dim=1)
    sums = {"correct": (predictions == labels).sum(), "total": torch.tensor(labels.numel(), device=labels.device),
            "loss": nn.functional.cross_entropy(logits.float(), labels, reduction="sum")}
    if num_classes:
        sums["confusion"] = count_confusion(labels, predictions, num_classes)
    return sums


@dataclass(frozen=True)
class EvalResult:
    sums: dict[str, torch.Tensor]  # every sum of batch_sums, over the whole validation set and every process

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
        """Mean cross-entropy per image."""
        return float(self.sums["loss"]) / self.total if self.total else float("nan")

    @property
    def confusion(self) -> list[list[int]]:
        """Rows: true class, columns: predicted class, in class-index order; sums to `total`."""
        return self.sums["confusion"].long().tolist() if "confusion" in self.sums else []

    def figures(self, class_names: list[str]) -> dict[str, Any]:
        """The result as metrics.jsonl and --eval-only write it."""
        return {"val_correct": self.correct, "val_total": self.total, "val_acc": self.accuracy,
                "val_loss": self.loss, "confusion_matrix": self.confusion,
                "per_class": per_class(self.confusion, class_names)}


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
    # The sums of an empty batch: where they start, and all a rank without a validation image adds.
    sums = batch_sums(torch.zeros(0, num_classes or 1, device=device), torch.zeros(0, dtype=torch.long, device=device),
                      num_classes)
    # A bar that erases itself when done: on a terminal only, where erasing works; in a log file or a pipe
    # it would leave its frames in front of the next line (the JSON line of --eval-only).
    for images, labels in tqdm(data_loader, desc="validate", file=sys.stdout, leave=False, dynamic_ncols=True,
                               disable=not (is_main_process() and sys.stdout.isatty())):
        images, labels = options.to_device(images, labels, device)
        with options.autocast():
            logits = model(images)
        for name, value in batch_sums(logits, labels, num_classes).items():
            sums[name] += value
    return EvalResult(reduce_sums(sums))


def evaluate_only(model: nn.Module, val_loader: DataLoader, device: torch.device, options: StepOptions,
                  class_names: list[str]) -> EvalResult:
    """--eval-only: validate the loaded weights once and print the figures as the last line of standard
    output, one JSON object (rank 0 alone): the numbers of the epoch that saved the weights."""
    result = evaluate(model, val_loader, device, options, len(class_names))
    if is_main_process():
        print(json.dumps(result.figures(class_names)), flush=True)
    return result

