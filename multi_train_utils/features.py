"""What a run attaches to the training loop, wired in one place: its checkpoints (which continue the saved run), the
stop at a step on a stop signal, and the features its flags switch on, each imported only when it is on. Each is
a hook (hooks.py) of train_eval_utils.fit."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer
from .hooks import Hook, Hooks
from .preemption import StopAtStep
from .recorder import RunRecorder
from .step_options import Criterion, StepOptions

Evaluate = Callable[..., Any]  # train_eval_utils.evaluate


def attach(run: RunRecorder, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler | None, options: StepOptions, criterion: Criterion,
           train_loader: DataLoader, val_loader: DataLoader, epochs: int, evaluate: Evaluate,
           hooks: Iterable[Hook] = ()) -> Checkpointer:
    """The run's checkpoints, whose `hooks` are every hook of the run, in the order they act after a step (the
    average first, for a checkpoint at that step to hold it; the run's files last). `evaluate`: the loop's, with
    which a feature validates a model of its own (the average of --model-ema)."""
    config, checkpoints = run.config, Checkpointer(model, optimizer, scheduler, options, run, train_loader)
    features: list[Hook] = []
    if config.model_ema:
        from .ema import ModelEma  # --model-ema: a moving average of the weights, validated and saved too

        features.append(ModelEma.from_config(config, checkpoints, criterion, val_loader, evaluate))
    features.append(StopAtStep(checkpoints, config.stop_grace, config.dist_timeout, epochs))  # SIGTERM, SIGUSR1
    if config.checkpoint_every_steps or config.checkpoint_every_minutes:
        from .periodic_checkpoints import PeriodicCheckpoints  # checkpoints inside epochs too

        features.append(PeriodicCheckpoints(checkpoints, config.checkpoint_every_steps,
                                            config.checkpoint_every_minutes, config.dist_timeout))
    if config.freeze_layers:
        from .freezing import FrozenBody  # --freeze-layers: only the classifier trains (until --unfreeze-epoch)

        features.append(FrozenBody(checkpoints.model, config.unfreeze_epoch))
    checkpoints.hooks = Hooks([checkpoints, *features, run, *hooks])
    return checkpoints
