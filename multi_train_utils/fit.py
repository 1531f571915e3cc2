"""The epoch loop: train, validate, write the epoch's figures, weights and checkpoint, epoch after epoch, with
the optional features of features.py attached."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer, SavedRun
from .distributed_utils import get_world_size, print_main
from .features import feature_hooks
from .hooks import Hooks
from .recorder import RunRecorder
from .step_options import StepOptions
from .train_eval_utils import EvalResult, evaluate, train_one_epoch


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: DataLoader, val_loader: DataLoader, recorder: RunRecorder, device: torch.device,
        options: StepOptions, saved: SavedRun | None = None) -> EvalResult | None:
    """Train and validate every epoch from where `saved` stopped (a fresh run: epoch 0) to --epochs, handing
    each epoch's figures, weights and checkpoint to `recorder`, with the features of features.py attached;
    return the last validation result."""
    saved = saved or SavedRun()
    epochs, class_names = recorder.args["epochs"], recorder.class_names
    checkpoints = Checkpointer(model, optimizer, scheduler, options, recorder, train_loader)
    start_epoch = checkpoints.resume(saved)
    hooks = Hooks([checkpoints, *feature_hooks(recorder.args, checkpoints, saved, val_loader)])
    checkpoints.hooks = hooks.hooks
    if start_epoch >= epochs:
        print_main(f"Nothing to train: the run has finished all {epochs} epochs (a larger --epochs trains on)")
    result = None
    with hooks.running():
        for epoch in range(start_epoch, epochs):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch: without it, each repeats the first
            hooks.on_epoch_start(epoch)
            lr = optimizer.param_groups[0]["lr"]  # the lr of the epoch's first step
            started = time.perf_counter()
            train_loss = train_one_epoch(model, optimizer, train_loader, device, epoch, scheduler, options, hooks)
            train_time = time.perf_counter() - started
            result = evaluate(model, val_loader, device, options, len(class_names))
            images = len(train_loader) * train_loader.batch_size * get_world_size()
            metrics = {"epoch": epoch, "train_loss": train_loss, **result.figures(class_names), "lr": lr,
                       "images_per_s": images / train_time, "epoch_time_s": time.perf_counter() - started,
                       "world_size": get_world_size()}
            hooks.on_validation_end(epoch, metrics)
            recorder.end_epoch(model, metrics, improved=checkpoints.improved(result.accuracy))
            if recorder.checkpoint_due(epoch, last_epoch=epochs - 1):  # the same answer on every rank
                checkpoints.save_epoch(epoch)
            hooks.on_epoch_end(epoch, metrics)
    return result
