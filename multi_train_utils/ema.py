"""--model-ema: an exponential moving average of the weights, which often validates better than the weights
themselves at the end of a noisy schedule (torchvision's references and timm offer it). Updated after every
optimizer step, validated every epoch (ema_val_acc, ema_val_loss), saved as weights/best_ema.pth (best by the
same --best-metric as best.pth) and in the checkpoint."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from .checkpoint import Best, Checkpointer, saved_best
from .config import RunConfig
from .distributed_utils import get_world_size, unwrap_model
from .optim import Criterion, Hook, StepEnd
from .recorder import RunRecorder


def ema_decay_per_step(decay: float, batches_per_step: int) -> float:
    """The decay of one optimizer step, for `decay` given per batch of one process.

    One optimizer step learns from processes x accumulated batches; the average must forget as much per
    step as it would over that many single-batch steps, or its horizon, counted in images, would shrink as
    processes are added. As torchvision's references do, the share of the new weights, 1 - decay, grows
    linearly with the batches (at most to 1: then the average is just the weights).
    """
    return 1.0 - min(1.0, (1.0 - decay) * batches_per_step)


class ModelEma(Hook):
    """The moving average of a model's weights, and the best validation accuracy it reached.

    Each rank averages its own copy of the plain model (not DDP): every rank holds the same weights, so no
    communication is needed. Buffers are averaged too, so that the BatchNorm statistics match the averaged
    weights. The first update copies the weights.
    """

    name = "ema"

    def __init__(self, model: nn.Module, decay: float, batches_per_step: int, best_metric: str = "val_acc",
                 validate: Callable[[nn.Module], Any] | None = None, recorder: RunRecorder | None = None) -> None:
        plain = unwrap_model(model)
        self.device = next(plain.parameters()).device
        self.decay = ema_decay_per_step(decay, batches_per_step)
        self.averaged = AveragedModel(plain, device=self.device, multi_avg_fn=get_ema_multi_avg_fn(self.decay),
                                      use_buffers=True)
        self.best = Best(best_metric)
        self.validate, self.recorder = validate, recorder  # validate(model): the loop's evaluate, on validation

    @classmethod
    def from_config(cls, config: RunConfig, checkpoints: Checkpointer, criterion: Criterion, val_loader: DataLoader,
                    evaluate: Callable[..., Any]) -> ModelEma:
        """--model-ema, its decay per step following the batches of one step (processes x --accum-steps), validated
        by the loop's `evaluate`, restored from the saved run."""
        validate = functools.partial(evaluate, criterion=criterion, data_loader=val_loader,
                                     device=next(checkpoints.model.parameters()).device, options=checkpoints.options)
        ema = cls(checkpoints.model, config.model_ema_decay, get_world_size() * config.accum_steps,
                  checkpoints.best.metric, validate, checkpoints.recorder)
        saved = checkpoints.recorder.saved.state
        if saved and saved.get(cls.name):
            ema.load_state_dict(saved[cls.name])
        return ema

    @property
    def model(self) -> nn.Module:
        """The averaged model, as evaluate() and the saved weights take it."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the weights of the optimizer step just taken into the average."""
        self.averaged.update_parameters(unwrap_model(model))

    def on_step_end(self, step: StepEnd) -> None:
        self.update(step.model)

    def on_validation_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Validate the averaged weights, add their figures to the epoch's (ema_val_acc, ...), and save them as
        weights/best_ema.pth when they are the best the average has reached."""
        result = self.validate(self.model)
        metrics.update({"ema_val_acc": result.accuracy, "ema_val_loss": result.loss,
                        "ema_val_correct": result.correct})
        if self.best.update(metrics, prefix="ema_"):
            self.recorder.save_weights(self.model, "best_ema.pth")

    def state_dict(self) -> dict[str, Any]:
        return {"averaged": {k: v.detach().cpu() for k, v in self.averaged.state_dict().items()},
                "best": asdict(self.best)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state["averaged"])
        self.best.load_state_dict(saved_best(state))

