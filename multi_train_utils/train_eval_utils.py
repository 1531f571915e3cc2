"""The training and validation loops: the only ones in the repository, for one process or many."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .checkpoint import gather_rng_states, make_checkpoint
from .distributed_utils import get_world_size, is_main_process, reduce_value, unwrap_model
from .errors import UserInputError

if TYPE_CHECKING:
    from .recorder import RunRecorder

LOG_EVERY = 10  # steps between progress-bar updates; each update waits for the device


class NonFiniteLossError(UserInputError):
    """The loss became NaN or infinite: training has diverged. Raised on every rank at the same step."""


@dataclass(frozen=True)
class EvalResult:
    correct: int
    total: int
    loss: float  # mean cross-entropy per image

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                    device: torch.device, epoch: int) -> float:
    """Train on this process's share of one epoch; return the mean loss over all processes' images."""
    model.train()
    loss_function = nn.CrossEntropyLoss()
    # Summed on the device and read only every LOG_EVERY steps: reading them every step would make the
    # CPU wait for the GPU every step.
    loss_sum = torch.zeros((), device=device)
    non_finite = torch.zeros((), device=device)
    images_seen = 0
    progress = tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(),
                    dynamic_ncols=True)
    for step, (images, labels) in enumerate(progress):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = loss_function(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        # Each process's loss is its own; DDP averages the gradients across processes inside backward().
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * labels.size(0)
        non_finite += ~torch.isfinite(loss.detach())
        images_seen += labels.size(0)
        if (step + 1) % LOG_EVERY == 0:
            stop_if_diverged(non_finite, epoch, step)
            if is_main_process():
                progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
    stop_if_diverged(non_finite, epoch, step)
    totals = reduce_value(torch.stack([loss_sum, torch.tensor(float(images_seen), device=device)]), average=False)
    return (totals[0] / totals[1]).item()


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
def evaluate(model: nn.Module, data_loader: DataLoader, device: torch.device) -> EvalResult:
    """Correct count, image count and mean loss over the whole validation set, summed over processes.

    Each process evaluates its own unpadded share with the plain model (not DDP, so ranks with one batch
    more or less never wait for each other); one all-reduce then adds the three sums.
    """
    model = unwrap_model(model)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, total, summed loss
    for images, labels in tqdm(data_loader, desc="validate", file=sys.stdout, disable=not is_main_process(),
                               leave=False, dynamic_ncols=True):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        sums[0] += (logits.argmax(dim=1) == labels).sum()
        sums[1] += labels.numel()
        sums[2] += nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
    correct, total, loss_sum = reduce_value(sums, average=False).tolist()
    return EvalResult(int(correct), int(total), loss_sum / total if total else float("nan"))


def cosine_with_warmup(epochs: int, lrf: float, warmup_epochs: int = 0) -> Callable[[int], float]:
    """Factor of the base lr in each epoch: a linear warm-up, then a cosine from 1 down to `lrf`."""

    def factor(epoch: int) -> float:
        if epoch < warmup_epochs:
            return (epoch + 1) / (warmup_epochs + 1)
        progress = (epoch - warmup_epochs) / max(1, epochs - warmup_epochs)
        return ((1 + math.cos(progress * math.pi)) / 2) * (1 - lrf) + lrf

    return factor


def build_optimizer(model: nn.Module, lr: float, epochs: int, lrf: float = 0.1, warmup_epochs: int = 0,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The tutorial's SGD (momentum 0.9, weight decay 5e-3) over the trainable parameters, with a
    per-epoch cosine schedule (Bag of Tricks, arXiv:1812.01187)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=lr, momentum=0.9, weight_decay=5e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(epochs, lrf, warmup_epochs))
    return optimizer, scheduler


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: DataLoader, val_loader: DataLoader, recorder: RunRecorder, epochs: int,
        device: torch.device, start_epoch: int = 0, best_acc: float = 0.0) -> EvalResult:
    """Train and validate epochs start_epoch..epochs-1, handing each epoch's figures and checkpoint to
    `recorder`; returns the last validation result."""
    result = EvalResult(0, 0, float("nan"))
    for epoch in range(start_epoch, epochs):
        # A new shuffle every epoch; without set_epoch every epoch repeats the first epoch's order.
        train_loader.sampler.set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]  # read before scheduler.step(): the lr this epoch trains with
        started = time.perf_counter()
        train_loss = train_one_epoch(model, optimizer, train_loader, device, epoch)
        train_time = time.perf_counter() - started
        result = evaluate(model, val_loader, device)
        scheduler.step()
        images = len(train_loader) * train_loader.batch_size * get_world_size()
        best_acc = max(best_acc, result.accuracy)
        checkpoint = make_checkpoint(model, optimizer, scheduler, epoch, best_acc, gather_rng_states(), recorder.args)
        recorder.end_epoch(model, {
            "epoch": epoch, "train_loss": train_loss, "val_loss": result.loss, "val_acc": result.accuracy,
            "val_correct": result.correct, "val_total": result.total, "lr": lr,
            "images_per_s": images / train_time, "epoch_time_s": time.perf_counter() - started,
            "world_size": get_world_size(),
        }, checkpoint)
    return result
