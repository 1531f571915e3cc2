"""What a run attaches to the training loop, wired in one place (attach): its checkpoints, which continue the saved
run; the stop at a step when a scheduler asks, which is always on and is here; and the features its flags switch
on, each in a module of its own, imported only when it is on. Each is a hook (optim.py) of train_eval_utils.fit.

Stopping when the scheduler says so: every rank stops after the same optimizer step and the run is saved there, so
that a requeued job goes on from that step. SLURM, Kubernetes and torchrun end a job with SIGTERM and kill it a
grace period later (30 s by default); SLURM can also warn ahead of time with another signal (`--signal=USR1@90`).
While training runs, any of these signals only raises a flag here. After each optimizer step the ranks compare
their flags (one all-reduce of one number on the CPU, so a GPU never waits for it), and all of them act on the
same step, whichever rank the signal reached first. Without StopAtStep (and its line in attach) a stop signal
ends the run at once, keeping the last checkpoint written.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint import Checkpointer
from .distributed_utils import any_rank, cpu_side_group, is_main_process, print_main
from .errors import REQUEUE_EXIT_CODE, STOP_SIGNALS, Preempted, listen_for_stop_signals, report, stop_now
from .optim import Criterion, Hook, Hooks, StepEnd, StepOptions
from .recorder import RunRecorder
from .shutdown import another_process_failed

Evaluate = Callable[..., Any]  # train_eval_utils.evaluate


def attach(run: RunRecorder, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler | None, options: StepOptions, criterion: Criterion,
           train_loader: DataLoader, val_loader: DataLoader, epochs: int, evaluate: Evaluate,
           hooks: Iterable[Hook] = ()) -> Checkpointer:
    """The run's checkpoints, with the saved run loaded (from the epoch `start.epoch`), whose `hooks` are every hook
    of the run, in the order they act after a step (the average first, for a checkpoint at that step to hold it;
    the run's files last). `evaluate`: the loop's, with which a feature validates a model of its own (the average
    of --model-ema)."""
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
    start_epoch = checkpoints.resume(run.saved) if run.saved.state else 0
    if start_epoch >= epochs:
        print_main(f"Nothing to train: {start_epoch} epoch(s) trained already; a larger --epochs than {epochs} goes on")
    return checkpoints


# After the deadline, how long a rank that the signal cannot reach (one waiting inside a collective, which
# does not return to Python) has before it ends without its clean-up.
FORCED_EXIT_AFTER_S = 5.0


def stop_signal() -> str | None:
    """The name of the stop signal this process received during training, or None."""
    return StopRequest.current.signal_name if StopRequest.current else None


# The stop signals a kill follows: a scheduler's SIGTERM; SIGHUP, which torchrun passes on and kills 30 s later.
KILL_FOLLOWS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

class StopRequest:
    """The stop signals of one training run: while it runs they only set a flag, which the ranks compare after
    each optimizer step. SIGTERM and SIGHUP also start a deadline of `grace_s` (stop_at_the_deadline)."""

    current: StopRequest | None = None  # the run's, while one trains in this process

    def __init__(self, grace_s: float) -> None:
        self.grace_s, self.signal_name, self.at_steps = grace_s, None, True
        # The signals a kill follows (the scheduler's, or torchrun's, within its grace period), for the deadline's
        # thread: a SimpleQueue, as its put() may interrupt itself (an Event's set() waits for good on its lock).
        self.kill_follows: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.lock = threading.Lock()  # orders the end of training and the deadline
        self.training_over = threading.Event()

    def on_signal(self, signum: int, frame: object) -> None:
        # A handler takes no lock: it interrupts the main thread anywhere, itself included. SLURM signals a torchrun
        # job's processes directly and torchrun passes the signal on, milliseconds apart, and the second call
        # would wait for good on a lock the first one holds.
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if signum in KILL_FOLLOWS:
            self.kill_follows.put(signum)
        if not self.at_steps:  # past the last step or past the deadline: no step will come to stop at
            stop_now(signum)

    def watch_the_deadline(self) -> None:
        """In a thread of its own: wait for a SIGTERM or SIGHUP, then keep its deadline."""
        while not self.training_over.is_set():
            try:
                self.kill_follows.get(timeout=0.5)
            except queue.Empty:
                continue
            stop_at_the_deadline(self)
            return


class StopAtStep(Hook):
    """While training runs, a stop signal waits for the next optimizer step, where every rank stops and rank 0
    writes the checkpoint of that step; a signal during validation stops the run after the epoch, with its
    checkpoint. `grace_s` after a SIGTERM, or at once if another process of the job has failed, a rank that
    has not stopped yet stops without saving (see stop_at_the_deadline)."""

    def __init__(self, checkpoints: Checkpointer, grace_s: float, timeout_s: float, epochs: int) -> None:
        self.checkpoints, self.grace_s, self.last_epoch = checkpoints, grace_s, epochs - 1
        self.group = cpu_side_group(timeout_s)

    def on_fit_start(self) -> None:
        # A signal before now has ended the process; one after it is this run's. Installed here, after set-up:
        # NCCL may install a SIGUSR1 handler of its own while it starts.
        request = StopRequest.current = StopRequest(self.grace_s)
        for signum in STOP_SIGNALS:
            signal.signal(signum, request.on_signal)
        if hasattr(signal, "pthread_kill"):
            threading.Thread(target=request.watch_the_deadline, daemon=True, name="stop-deadline").start()

    def on_step_end(self, step: StepEnd) -> None:
        if self.any_rank_signalled():
            progress = self.checkpoints.save_at(step)
            self.stop(f"at epoch {progress.epoch}, step {progress.step}")

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        # A signal that came during validation stops the run here, unless there is nothing left to train.
        if self.any_rank_signalled() and epoch < self.last_epoch:
            if self.checkpoints.last_saved != (epoch, None):
                self.checkpoints.save_epoch(epoch)
            self.stop(f"after epoch {epoch}")

    def on_fit_end(self) -> None:
        request = StopRequest.current
        with request.lock:
            request.at_steps = False
            request.training_over.set()
        if request.signal_name is None:
            listen_for_stop_signals()  # from now on a stop signal ends the process at once

    def any_rank_signalled(self) -> bool:
        return any_rank(stop_signal() is not None, self.group)

    def stop(self, where: str) -> None:
        """End the run after the checkpoint just written; every rank exits once rank 0 has written it
        (shutdown.end_run)."""
        raise Preempted(f"Stopped by {stop_signal() or 'a signal to another process'} {where}; its checkpoint is "
                        f"{self.checkpoints.recorder.checkpoint_path}; go on with --resume auto")


def stop_at_the_deadline(request: StopRequest) -> None:
    """The deadline of a SIGTERM: a rank that has not reached its next step --stop-grace later (a long
    validation, a slow write, a hung data loader or collective) stops at once, keeping the last checkpoint,
    before the scheduler kills it. After another process failed, or once the launcher is gone, the job is
    ending and the ranks could not vote on a step anyway: no waiting then."""
    deadline = time.monotonic() + request.grace_s
    while time.monotonic() < deadline and not another_process_failed():
        if request.training_over.wait(0.5):
            return
    with request.lock:
        if request.training_over.is_set():
            return
        request.at_steps = False
    # The signal again, to the main thread: it interrupts a wait that returns to Python, and the handler
    # now raises. A wait inside a collective does not return: end the process, without its clean-up.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    if not request.training_over.wait(FORCED_EXIT_AFTER_S):
        if is_main_process():
            report(f"Stopped by {request.signal_name}: no step came within --stop-grace {request.grace_s:g} s; "
                   "the last checkpoint written is kept")
        os._exit(REQUEUE_EXIT_CODE)
