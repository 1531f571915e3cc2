"""The optional features of a training run. Each is a hook (hooks.py) in a module of its own, made from the
run's flags by its `from_args`: delete a feature's module and its two lines here, and the run trains without it.
They act after each step in this order: the average first, so that a checkpoint written at that step holds it.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from .checkpoint import Checkpointer, SavedRun
from .ema import ModelEma
from .hooks import Hook
from .periodic_checkpoints import PeriodicCheckpoints
from .preemption import StopAtStep
from .tensorboard_log import TensorBoardLog

FEATURES = (
    ModelEma,  # --model-ema: a moving average of the weights, validated and saved beside them
    StopAtStep,  # a stop signal (SIGTERM, SIGUSR1) stops every rank at the same step, with its checkpoint
    PeriodicCheckpoints,  # --checkpoint-every-steps, --checkpoint-every-minutes
    TensorBoardLog,  # every figure of metrics.jsonl, the confusion matrix and the first batch, in TensorBoard
)


def feature_hooks(args: dict[str, Any], checkpoints: Checkpointer, saved: SavedRun,
                  val_loader: DataLoader) -> list[Hook | None]:
    """The hooks of the features that `args` asks for (None for those it does not)."""
    return [feature.from_args(args, checkpoints, saved, val_loader) for feature in FEATURES]
