"""--model-ema: an exponential moving average of the weights, which often validates better than the weights
themselves at the end of a noisy schedule (torchvision's references and timm offer it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .ddp import unwrap_model


def ema_decay_per_step(decay: float, batches_per_step: int) -> float:
    """The decay of one optimizer step, for `decay` given per batch of one process.

    One optimizer step learns from processes x accumulated batches; the average must forget as much per
    step as it would over that many single-batch steps, or its horizon, counted in images, would shrink as
    processes are added. As torchvision's references do, the share of the new weights, 1 - decay, grows
    linearly with the batches (at most to 1: then the average is just the weights).
    """
    return 1.0 - min(1.0, (1.0 - decay) * batches_per_step)


class ModelEma:
    """The moving average of a model's weights, and the best validation accuracy it reached.

    Each rank averages its own copy of the plain model (not DDP): every rank holds the same weights, so no
    communication is needed. Buffers are averaged too, so that the BatchNorm statistics match the averaged
    weights. The first update copies the weights.
    """

    def __init__(self, model: nn.Module, decay: float, batches_per_step: int) -> None:
        plain = unwrap_model(model)
        self.decay = ema_decay_per_step(decay, batches_per_step)
        self.averaged = AveragedModel(plain, device=next(plain.parameters()).device,
                                      multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True)
        self.best_acc = 0.0

    @property
    def model(self) -> nn.Module:
        """The averaged model, as evaluate() and the saved weights take it."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the weights of the optimizer step just taken into the average."""
        self.averaged.update_parameters(unwrap_model(model))

    def state_dict(self) -> dict[str, Any]:
        return {"averaged": {k: v.detach().cpu() for k, v in self.averaged.state_dict().items()},
                "best_acc": self.best_acc}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averaged.load_state_dict(state["averaged"])
        self.best_acc = state["best_acc"]


def build_ema(model: nn.Module, enabled: bool, decay: float, batches_per_step: int,
              checkpoint: dict[str, Any] | None = None) -> ModelEma | None:
    """The average for --model-ema (None without it), restored from `checkpoint` if the run resumes."""
    if not enabled:
        return None
    ema = ModelEma(model, decay, batches_per_step)
    if checkpoint is not None and checkpoint.get("ema"):
        ema.load_state_dict(checkpoint["ema"])
    return ema
