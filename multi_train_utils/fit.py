"""The epoch loop: train, validate, report, epoch after epoch. Given a run (a RunRecorder), it also writes the
epoch's figures, weights and checkpoint, continues a stopped run, stops at a step when the scheduler asks, and
attaches the optional features the run's flags switch on (each imported only then)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer
from .config import RunConfig
from .confusion import class_figures
from .data import workers_ended
from .distributed_utils import get_world_size, print_main
from .preemption import StopAtStep
from .recorder import RunRecorder
from .train_eval_utils import (
    Criterion,
    EvalResult,
    Hook,
    Hooks,
    NonFiniteLossError,
    StepOptions,
    evaluate,
    train_one_epoch,
)


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
        features = optional_features(run.config, epochs, checkpoints, criterion, val_loader)
        hooks = Hooks([checkpoints, *features, run, *hooks])
        checkpoints.hooks = hooks
    if start_epoch >= epochs:
        print_main(f"Nothing to train: {start_epoch} epoch(s) trained already; a larger --epochs than {epochs} goes on")
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
            stop_if_not_finite(metrics)  # before anything of the epoch is written
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


def stop_if_not_finite(metrics: dict[str, Any]) -> None:
    """Stop every process (their figures are the same, summed over all of them) where an epoch's figure is NaN or
    infinite: the weights have diverged, and are neither written nor chosen as the best."""
    broken = [name for name, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]
    if broken:
        raise NonFiniteLossError(f"epoch {metrics['epoch']}: {', '.join(broken)} became {metrics[broken[0]]}: the "
                                 "weights have diverged, so training stopped without writing them; the last "
                                 "checkpoint written is kept. Try a smaller --lr")


def optional_features(config: RunConfig, epochs: int, checkpoints: Checkpointer, criterion: Criterion,
                      val_loader: DataLoader) -> list[Hook]:
    """Stopping at a step on a stop signal, and the features the flags ask for, each imported only then; in the
    order they act after a step (the average first, for a checkpoint at that step to hold it)."""
    features: list[Hook] = []
    if config.model_ema:
        from .ema import ModelEma  # --model-ema: a moving average of the weights, validated and saved too

        features.append(ModelEma.from_config(config, checkpoints, criterion, val_loader))
    features.append(StopAtStep(checkpoints, config.stop_grace, config.dist_timeout, epochs))  # SIGTERM, SIGUSR1
    if config.checkpoint_every_steps or config.checkpoint_every_minutes:
        from .periodic_checkpoints import PeriodicCheckpoints  # checkpoints inside epochs too

        features.append(PeriodicCheckpoints(checkpoints, config.checkpoint_every_steps,
                                            config.checkpoint_every_minutes, config.dist_timeout))
    if config.freeze_layers:
        from .freezing import FrozenBody  # --freeze-layers: only the classifier trains (until --unfreeze-epoch)

        features.append(FrozenBody(checkpoints.model, config.unfreeze_epoch))
    return features
