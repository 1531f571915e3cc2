"""The one extension point of the training loops: what a feature may do at the edges of training.

The loops (train_eval_utils.py) call a `Hooks` list at fixed moments and know nothing of what the hooks do.
Writing checkpoints inside an epoch, stopping for a scheduler, the moving average of the weights and
TensorBoard are each a hook in a module of their own; features.py lists those a run attaches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class StepEnd:
    """What the training loop tells the hooks after each optimizer step."""

    epoch: int
    step: int  # optimizer steps this call of train_one_epoch has taken (a resumed epoch counts from its restart)
    images: int  # images this process has trained on in this call
    loss_sum: torch.Tensor  # their summed loss, on the device (reading it makes the CPU wait for the device)
    non_finite: torch.Tensor  # how many of their batches had a NaN or infinite loss, on the device
    model: nn.Module


class Hook:
    """A feature attached to training. Every method is optional and runs on every rank: a hook that writes
    files does so on rank 0 alone, and one that runs a collective runs it on every rank."""

    name: str | None = None  # the key of state_dict() in the checkpoint; None: the hook keeps no state

    def on_fit_start(self) -> None:
        """Before the first epoch."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the epoch's first batch is loaded."""

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        """The epoch's first batch, as the loader gives it (before it moves to the device)."""

    def on_step_end(self, step: StepEnd) -> None:
        """After each optimizer step (and the schedule's)."""

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """After validation; `metrics` is the epoch's line of metrics.jsonl, to which a hook may add figures."""

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """After the epoch's metrics, weights and checkpoint are written."""

    def on_fit_end(self) -> None:
        """After training, however it ended."""

    def state_dict(self) -> Any:
        """What the checkpoint keeps of this hook, under `name`."""
        return None


class Hooks(Hook):
    """Calls each hook in turn, in the order given."""

    def __init__(self, hooks: Iterable[Hook | None] = ()) -> None:
        self.hooks = [hook for hook in hooks if hook is not None]

    @contextmanager
    def running(self) -> Iterator[None]:
        """on_fit_start before the block, on_fit_end after it, however it ends."""
        self.on_fit_start()
        try:
            yield
        finally:
            self.on_fit_end()

    def on_fit_start(self) -> None:
        for hook in self.hooks:
            hook.on_fit_start()

    def on_epoch_start(self, epoch: int) -> None:
        for hook in self.hooks:
            hook.on_epoch_start(epoch)

    def on_first_batch(self, images: Any, labels: torch.Tensor) -> None:
        for hook in self.hooks:
            hook.on_first_batch(images, labels)

    def on_step_end(self, step: StepEnd) -> None:
        for hook in self.hooks:
            hook.on_step_end(step)

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.on_validation_end(epoch, metrics)

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.on_epoch_end(epoch, metrics)

    def on_fit_end(self) -> None:
        for hook in reversed(self.hooks):
            hook.on_fit_end()
