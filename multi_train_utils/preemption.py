"""Stopping when the scheduler says so: every rank stops after the same optimizer step and the run is
saved there, so that a requeued job goes on from that step.

SLURM, Kubernetes and torchrun end a job with SIGTERM and kill it a grace period later (30 s by default);
SLURM can also warn ahead of time with another signal (`--signal=B:USR1@90`). Any of these signals only
raises a flag here. After each optimizer step the ranks compare their flags (one all-reduce of two
numbers on the CPU, so a GPU never waits for it), and all of them act on the same step, whichever rank
the signal reached first.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.context
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .distributed_utils import another_process_failed, is_dist_avail_and_initialized, is_main_process
from .errors import REQUEUE_EXIT_CODE, Terminated, report

# SIGUSR1 is what SLURM users choose for --signal; SIGUSR2 what submitit and LSF send.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
# After the deadline, how long a rank that the signal cannot reach (one waiting inside a collective, which
# does not return to Python) has before it ends without its clean-up.
FORCED_EXIT_AFTER_S = 5.0


class _StopRequest:
    signal_name: str | None = None
    at_steps = False  # whether the training loop is running and will act on the flag
    lock = threading.Lock()  # orders the end of training and the deadline
    sigterm = threading.Event()  # SIGTERM came: the scheduler's kill follows within its grace period
    training_over = threading.Event()


def _on_stop_signal(signum: int, frame: object) -> None:
    # A handler only sets flags: it interrupts the main thread anywhere, even inside a lock it would need.
    _StopRequest.signal_name = _StopRequest.signal_name or signal.Signals(signum).name
    if signum == signal.SIGTERM:
        _StopRequest.sigterm.set()
    if not _StopRequest.at_steps:
        # Setting up, past the last epoch or past the deadline: no step will come to stop at.
        raise Terminated(_StopRequest.signal_name)


def listen_for_stop_signals() -> None:
    """Turn the stop signals into a request that the training loop acts on at its next optimizer step."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)


def stop_signal() -> str | None:
    """The name of the stop signal this process received, or None."""
    return _StopRequest.signal_name


@contextlib.contextmanager
def stopping_at_steps(grace_s: float = 20.0) -> Iterator[None]:
    """While the block runs, a stop signal waits for the next optimizer step instead of ending the process;
    but `grace_s` after a SIGTERM, or at once if another process of the job has failed, a rank that has not
    stopped yet stops without saving (see stop_at_the_deadline)."""
    # Again, here: NCCL may install a SIGUSR1 handler of its own while it starts its communicators.
    listen_for_stop_signals()
    # A signal before now has ended the process; one after it is this run's.
    _StopRequest.signal_name = None
    _StopRequest.sigterm, _StopRequest.training_over = threading.Event(), threading.Event()
    _StopRequest.at_steps = True
    if hasattr(signal, "pthread_kill"):
        threading.Thread(target=stop_at_the_deadline, args=(grace_s, _StopRequest.sigterm, _StopRequest.training_over),
                         daemon=True, name="stop-deadline").start()
    try:
        yield
    finally:
        with _StopRequest.lock:
            _StopRequest.at_steps = False
            _StopRequest.training_over.set()


def stop_at_the_deadline(grace_s: float, sigterm: threading.Event, training_over: threading.Event) -> None:
    """The deadline of a SIGTERM: a rank that has not reached its next step `grace_s` later (a long
    validation, a slow write, a hung data loader or collective) stops at once, keeping the last checkpoint,
    before the scheduler kills it. After another process failed, the launcher is ending the job, and the
    ranks could not vote on a step anyway: no waiting then."""
    while not sigterm.wait(0.5):
        if training_over.is_set():
            return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not another_process_failed():
        if training_over.wait(0.5):
            return
    with _StopRequest.lock:
        if training_over.is_set():
            return
        _StopRequest.at_steps = False
    # The signal again, to the main thread: it interrupts a wait that returns to Python, and the handler
    # now raises. A wait inside a collective does not return: end the process, without its clean-up.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    if not training_over.wait(FORCED_EXIT_AFTER_S):
        if is_main_process():
            report(f"Stopped by {_StopRequest.signal_name}: no step came within --stop-grace {grace_s:g} s; the "
                   "last checkpoint written is kept")
        os._exit(REQUEUE_EXIT_CODE)


class StepControl:
    """Decides after every optimizer step, identically on every rank, whether to write a checkpoint
    (every --checkpoint-every-steps steps, every --checkpoint-every-minutes minutes by rank 0's clock) and
    whether to stop (a stop signal reached any rank)."""

    def __init__(self, every_steps: int | None, every_minutes: float | None, steps_per_epoch: int,
                 timeout_s: float = 900.0) -> None:
        self.every_steps = every_steps
        self.every_s = every_minutes * 60 if every_minutes else None
        self.steps_per_epoch = steps_per_epoch
        self.group = control_group(timeout_s)
        self.last_checkpoint = time.monotonic()

    def after_step(self, epoch: int, step: int) -> tuple[bool, bool]:
        """(write a checkpoint, stop) after optimizer step `step` (counted from 1) of `epoch`."""
        global_step = epoch * self.steps_per_epoch + step
        by_steps = bool(self.every_steps) and global_step % self.every_steps == 0
        # Rank 0's clock alone: each rank's own would disagree by a step now and then.
        by_time = bool(self.every_s) and is_main_process() and time.monotonic() - self.last_checkpoint >= self.every_s
        stop, by_time = self.agree(stop_signal() is not None, by_time)
        return stop or by_steps or by_time, stop

    def stop_now(self) -> bool:
        """Whether any rank received a stop signal: asked between epochs, where a signal that came during
        validation is acted on."""
        return self.agree(stop_signal() is not None, False)[0]

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank."""
        if not is_dist_avail_and_initialized():
            return list(flags)
        votes = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(vote) for vote in votes.tolist()]

    def checkpoint_written(self) -> None:
        self.last_checkpoint = time.monotonic()

    def wait_for_all(self) -> None:
        """Wait until every rank is here: after a stop, no rank exits before rank 0 has written the checkpoint
        (a launcher stops the whole job when the first process exits)."""
        if is_dist_avail_and_initialized():
            dist.barrier(group=self.group)


def control_group(timeout_s: float) -> Any:
    """The process group for StepControl's votes: the default group where it is gloo (CPU tensors), else
    a gloo group beside NCCL's, so that voting never waits for the GPU (gloo then needs to reach the other
    machines too: GLOO_SOCKET_IFNAME names the network interface). None with one process."""
    if not is_dist_avail_and_initialized():
        return None
    if dist.get_backend() == "gloo":
        return None  # the default group
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


if sys.platform != "win32":  # fork (and so this) exists on POSIX systems only
    class WorkerForkContext(multiprocessing.context.ForkContext):
        """Forks data-loader workers with the stop signals blocked: every thread of a worker, also those
        started before its worker_init_fn runs, then leaves them to the one thread that sorts them
        (obey_only_the_trainer)."""

        class Process(multiprocessing.context.ForkProcess):
            def start(self) -> None:
                # In the training process only for the moment of the fork: a signal meanwhile waits, then
                # arrives.
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                try:
                    super().start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def obey_only_the_trainer() -> None:
    """In a data-loader worker: ignore stop signals sent by anyone but the training process that owns it.

    Schedulers signal every process of a job (SLURM signals the whole job step, torchrun the process
    group), so the workers get SIGTERM too. A worker that died of it would fail the training process at
    its next batch, before that process could reach the step where every rank stops and saves. The
    training process itself still ends its workers with SIGTERM when it is done with them.
    """
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: the signals act as usual
        return
    trainer = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already, if WorkerForkContext started it

    def sort_signals() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == trainer:
                # As after the loader's own shut-down: a code other than 0 would make the loader, which
                # still watches its workers while Python exits, report the worker as failed.
                os._exit(0)

    threading.Thread(target=sort_signals, name="stop-signals", daemon=True).start()
