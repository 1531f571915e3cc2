"""The hooks through which the rest of a run (checkpoints, stops, logs, the features the flags switch on) meets the
training loop, at its edges: what each may do, and when it is called."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .distributed_utils import reduce_sums
from .errors import NonFiniteLossError


@dataclass
class StepEnd:
    """What the loop tells the hooks after each optimizer step (tensors stay on the device until read)."""

    epoch: int
    step: int  # optimizer steps done in the epoch (a resumed epoch's first part included)
    steps_per_epoch: int
    images: int  # images this process has trained on in this call, their summed loss, their non-finite losses
    loss_sum: torch.Tensor
    non_finite: torch.Tensor
    model: nn.Module
    figures: dict[str, Any] = field(default_factory=dict)  # the step's own: loss, lr (TensorBoard draws them)

    @property
    def run_step(self) -> int:  # optimizer steps since the start of the run
        return self.epoch * self.steps_per_epoch + self.step

    def stop_if_diverged(self, batch: int) -> None:
        """Stop every process at the same step if the loss of any of them was NaN or infinite since the last check.

        One all-reduce tells every rank the same count, so all raise together; a rank that stopped alone would leave
        the others waiting for it in their next collective.
        """
        count = int(reduce_sums({"non_finite": self.non_finite})["non_finite"])
        if count:
            raise NonFiniteLossError(f"epoch {self.epoch}, step {batch}: the training loss became NaN or infinite "
                                     f"({count} time(s) since the last check), so training stopped; the last "
                                     "checkpoint written is kept. Try a smaller --lr")

    def count(self, loss: torch.Tensor, images: int, stepped: bool, hooks: Hooks) -> None:
        """Add a batch's mean `loss` over `images` to the sums; after an optimizer step, tell the hooks."""
        self.loss_sum += loss.detach().float() * images
        self.non_finite += ~torch.isfinite(loss.detach())
        self.images += images
        if stepped:
            self.step += 1
            hooks.call("on_step_end", self)


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


class Hooks(list):
    """Hooks called in turn, in their order (at the end, in reverse)."""

    def __init__(self, hooks: Iterable[Hook | None] = ()) -> None:
        super().__init__(filter(None, hooks))

    def call(self, event: str, *args: Any) -> None:
        for hook in reversed(self) if event == "on_fit_end" else self:
            getattr(hook, event)(*args)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """on_fit_start before the block, on_fit_end after it, however it ends."""
        self.call("on_fit_start")
        try:
            yield
        finally:
            self.call("on_fit_end")
