"""The epoch loop: train, validate, report, epoch after epoch. Given a run (a RunRecorder), it also writes the
epoch's figures, weights and checkpoint, continues a stopped run, stops at a step when the scheduler asks, and
attaches the optional features the run's flags switch on (each imported only then)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer
from .confusion import class_figures
from .data import workers_ended
from .distributed_utils import get_world_size, print_main
from .preemption import StopAtStep
from .recorder import RunRecorder
from .train_eval_utils import Criterion, EvalResult, Hook, Hooks, StepOptions, evaluate, train_one_epoch


def fit(model: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer, train_loader: DataLoader,
        val_loader: DataLoader, device: torch.device, epochs: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, options: StepOptions | None = None,
        run: RunRecorder | None = None, hooks: Iterable[Hook] = ()) -> EvalResult | None:
    """Train and validate up to `epochs`, print each epoch's figures, return the last validation result; with
    `run`, also continue its saved state and write what it keeps."""
    options = options or StepOptions(device.type)
    hooks, start_epoch, checkpoints = Hooks(hooks), 0, None
    if run is not None:
        checkpoints = Checkpointer(model, optimizer, scheduler, options, run, train_loader)
        start_epoch = checkpoints.resume(run.saved) if run.saved.state else 0
        features = optional_features(run.args, epochs, checkpoints, criterion, val_loader)
        hooks = Hooks([checkpoints, *features, run, *hooks])
        checkpoints.hooks = hooks
    if start_epoch >= epochs:
        print_main(f"Nothing to train: the run has finished all {epochs} epochs (a larger --epochs trains on)")
    result = None
    with hooks.running(), workers_ended(train_loader, val_loader):
        for epoch in range(start_epoch, epochs):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch: without it, each repeats the first
            hooks.call("on_epoch_start", epoch)
            lr = optimizer.param_groups[0]["lr"]  # the lr of the epoch's first step
            started = time.perf_counter()
            train_loss = train_one_epoch(model, criterion, optimizer, train_loader, device, epoch, scheduler,
                                         options, hooks)
            train_time = time.perf_counter() - started
            result = evaluate(model, criterion, val_loader, device, options, run and len(run.class_names))
            images = len(train_loader) * train_loader.batch_size * get_world_size()
            metrics = {"epoch": epoch, "train_loss": train_loss, **result.figures(), "lr": lr,
                       "images_per_s": images / train_time, "epoch_time_s": time.perf_counter() - started,
                       "world_size": get_world_size()}
            hooks.call("on_validation_end", epoch, metrics)
            print_main(epoch_line(metrics))
            if run is not None:
                metrics.update(class_figures(result.sums, run.class_names))
                run.end_epoch(model, metrics, result.sums.get("confusion"), improved=checkpoints.improved(metrics),
                              run_step=(epoch + 1) * checkpoints.steps_per_epoch)
                if run.checkpoint_due(epoch, last_epoch=epochs - 1):  # the same answer on every rank
                    checkpoints.save_epoch(epoch)
            hooks.call("on_epoch_end", epoch, metrics)
    return result


def epoch_line(metrics: dict[str, Any]) -> str:
    """An epoch's figures on one line (its mean training loss: that of its last batch is the progress bar's)."""
    ema = f"  ema_acc {metrics['ema_val_acc']:.3f}" if "ema_val_acc" in metrics else ""
    return (f"[epoch {metrics['epoch']}] train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
            f"val_acc {metrics['val_acc']:.3f} ({metrics['val_correct']}/{metrics['val_total']}){ema}  "
            f"lr {metrics['lr']:.2e}  {metrics['images_per_s']:.1f} img/s  {metrics['epoch_time_s']:.1f} s")


def optional_features(args: dict[str, Any], epochs: int, checkpoints: Checkpointer, criterion: Criterion,
                      val_loader: DataLoader) -> list[Hook]:
    """Stopping at a step on a stop signal, and the features the flags ask for, each imported only then; in the
    order they act after a step (the average first, for a checkpoint at that step to hold it)."""
    features: list[Hook] = []
    if args.get("model_ema"):
        from .ema import ModelEma  # --model-ema: a moving average of the weights, validated and saved too

        features.append(ModelEma.from_args(args, checkpoints, criterion, val_loader))
    features.append(StopAtStep.from_args(args, checkpoints, epochs))  # SIGTERM, SIGUSR1: every rank stops at one step
    if args.get("checkpoint_every_steps") or args.get("checkpoint_every_minutes"):
        from .periodic_checkpoints import PeriodicCheckpoints  # checkpoints inside epochs too

        features.append(PeriodicCheckpoints.from_args(args, checkpoints))
    if args.get("freeze_layers"):
        from .freezing import FrozenBody  # --freeze-layers: only the classifier trains (until --unfreeze-epoch)

        features.append(FrozenBody(checkpoints.model, args.get("unfreeze_epoch")))
    return features
