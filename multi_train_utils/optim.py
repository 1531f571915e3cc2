"""The optimizer and the learning-rate schedule, chosen separately by flag (--opt, --sched, --warmup-epochs).

Add your own: one entry in OPTIMIZERS or SCHEDULES, and its name is a choice of the flag.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import UserInputError

# name -> (the optimizer class, its own arguments, its default --weight-decay)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], float]] = {
    "sgd": (torch.optim.SGD, {"momentum": 0.9}, 5e-3),  # the tutorial's
    "adamw": (torch.optim.AdamW, {}, 0.05),
}


def cosine(progress: float, lrf: float) -> float:
    """From 1 down to `lrf` along half a cosine (Bag of Tricks, arXiv:1812.01187)."""
    return ((1 + math.cos(progress * math.pi)) / 2) * (1 - lrf) + lrf


def step(progress: float, lrf: float) -> float:
    """A tenth as large after each third of training (lrf is not used)."""
    return 0.1 ** min(2, math.floor(progress * 3))


def constant(progress: float, lrf: float) -> float:
    return 1.0


# name -> the factor of the base lr at `progress` (0 at the end of the warm-up, 1 at the end of training)
SCHEDULES: dict[str, Callable[[float, float], float]] = {"cosine": cosine, "step": step, "constant": constant}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Every parameter (frozen ones too, to train once unfrozen): weight decay for weights, none for biases and
    normalisation layers (1-D tensors), which it would only pull towards zero."""
    decayed, plain = [], []
    for param in model.parameters():
        (decayed if param.ndim > 1 else plain).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return list(filter(operator.itemgetter("params"), groups))  # a model may have either kind only


def build_optimizer(model: nn.Module, name: str = "sgd", lr: float = 0.001,
                    weight_decay: float | None = None) -> torch.optim.Optimizer:
    """--opt over the trainable parameters, with --weight-decay (the optimizer's own default if None)."""
    optimizer_class, arguments, default_decay = OPTIMIZERS[name]
    groups = parameter_groups(model, default_decay if weight_decay is None else weight_decay)
    # fused on CUDA, where the optimizer has it: one kernel for all parameters, and GradScaler then checks for
    # overflow on the GPU instead of waiting for it on the host every step.
    if groups[0]["params"][0].is_cuda and "fused" in inspect.signature(optimizer_class).parameters:
        arguments = {**arguments, "fused": True}
    return optimizer_class(groups, lr=lr, **arguments)


def scaled_lr(lr: float, world_size: int = 1, accum_steps: int = 1) -> float:
    """The lr of a step that learns from world_size x accum_steps batches, where `lr` (--lr) is that of one
    process's batch: proportionally larger (the linear scaling rule, Goyal et al. 2017). Written here alone."""
    return lr * world_size * accum_steps


def warmup_then(schedule: Callable[[float, float], float], lrf: float, warmup_steps: int,
                total_steps: int) -> Callable[[int], float]:
    """The factor of the base lr at each optimizer step (not epoch: a warm-up rises smoothly): a linear warm-up
    over `warmup_steps`, then `schedule`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return schedule((step - warmup_steps) / max(1, total_steps - warmup_steps), lrf)

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, name: str = "cosine", epochs: int = 1,
                    steps_per_epoch: int = 1, warmup_epochs: int = 0, lrf: float = 0.1,
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """--sched after --warmup-epochs, stepped after every optimizer step."""
    factor = warmup_then(SCHEDULES[name], lrf, warmup_epochs * steps_per_epoch, epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_steps_per_epoch(batches: int, accum_steps: int = 1) -> int:
    """Optimizer steps in an epoch of `batches` batches: the last step may gather fewer than accum_steps."""
    if accum_steps > batches:
        # The lr is multiplied by accum_steps for batches that would never come.
        raise UserInputError(f"--accum-steps {accum_steps}: more than the {batches} batches each process trains on "
                             f"in an epoch; at most {batches}")
    return math.ceil(batches / accum_steps)


def scheduled_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> float:
    """The lr of the first parameter group at optimizer step `step` (of a LambdaLR; else its lr now)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return scheduler.get_last_lr()[0]
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](step)


def align_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Put a per-step schedule at optimizer step `step`, its lr computed anew: a resumed run may take another
    number of steps per epoch (other processes or batches), and another lr or schedule (changed flags)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=True):
        group["lr"] = base * factor(step)
