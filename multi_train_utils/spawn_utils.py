"""What the spawn script needs to start its own processes: how many, on which port, and how to fail."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.multiprocessing as mp

from .cli import one_line
from .distributed_utils import find_free_port, port_was_taken, resolve_device
from .errors import REQUEUE_EXIT_CODE, Terminated, UserInputError, report, stopped_line
from .launch import cpu_threads_per_process
from .preemption import FORCED_EXIT_AFTER_S, STOP_SIGNALS, listen_for_stop_signals

PORT_ATTEMPTS = 3
CPU_PROCESSES_PER_CORE = 4
STOP_GRACE_S = 3.0
# After a stop signal, how long the processes have beyond their own --stop-grace: they end by then
# themselves, at the latest FORCED_EXIT_AFTER_S after it.
STOP_MARGIN_S = FORCED_EXIT_AFTER_S + 5.0
Worker = Callable[[int, int, argparse.Namespace], None]


def processes_to_start(world_size: int | None, device: str | None) -> int:
    """--world-size, checked against the GPUs; by default one process per GPU, or 2 on a CPU."""
    on_cuda = resolve_device(device, 0, distributed=False).type == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    if world_size is None:
        return gpus if on_cuda else 2
    if on_cuda and world_size > gpus:
        raise UserInputError(f"--world-size {world_size}: only {gpus} GPU(s) visible (one process per GPU)")
    cpus = cpu_threads_per_process(1)
    if not on_cuda and world_size > CPU_PROCESSES_PER_CORE * cpus:
        # Each process holds a model, an optimizer and its batches: past a few per core they only fight
        # for the cores and the memory.
        raise UserInputError(f"--world-size {world_size}: more processes than this machine's {cpus} CPU core(s) "
                             f"can run (at most {CPU_PROCESSES_PER_CORE * cpus})")
    return world_size


def run_worker(rank: int, worker: Worker, world_size: int, args: argparse.Namespace) -> None:
    """The entry point of every spawned process: a mistake the user can fix ends it with one line; any
    other error is printed here, because once one rank fails the others fail too ("connection closed
    by peer"), and mp.spawn reports whichever failure it noticed first, not necessarily the cause."""
    listen_for_stop_signals()
    try:
        worker(rank, world_size, args)
    except Terminated as stop:  # a stop signal before training started
        if rank == 0:
            report(stopped_line(stop.signal_name))
        raise
    except UserInputError as err:
        report(f"error (rank {rank}): {one_line(err)}")
        sys.exit(2)
    except Exception:
        report(f"rank {rank} failed:\n{traceback.format_exc()}")
        raise


def spawn_workers(worker: Worker, world_size: int, args: argparse.Namespace, start_method: str = "spawn") -> None:
    """Start `world_size` processes running worker(rank, world_size, args) and wait for all of them.

    The processes meet on MASTER_ADDR:MASTER_PORT. Unless those are set, that is a free port on
    127.0.0.1, so two jobs on one machine do not collide; if another program takes the port between
    our choosing and our using it, we try again with another. When one process fails, mp.spawn ends
    the others, and we exit non-zero.
    """
    port_is_ours = "MASTER_PORT" not in os.environ
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # mp's join logs each process it stops ("Terminating process ... via signal SIGTERM"); we say once
    # which process failed, and that the others were stopped.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if port_is_ours:
                os.environ["MASTER_PORT"] = str(find_free_port(os.environ["MASTER_ADDR"]))
                os.environ["MASTER_PORT_CHOSEN_BY"] = "spawn"  # taken meanwhile: try another, not a user error
            # Installed before the processes start: a signal meanwhile must not end this launcher in the middle
            # of starting them, which would leave those started so far waiting for the rest of their group.
            with stop_signals_passed_on() as passer:
                context = mp.start_processes(run_worker, args=(worker, world_size, args), nprocs=world_size,
                                             join=False, start_method=start_method)
                passer.adopt(context.processes)
                try:
                    join_all(context, getattr(args, "stop_grace", 20.0) + STOP_MARGIN_S, passer)
                    return
                except mp.ProcessRaisedException as err:
                    if port_is_ours and port_was_taken(err) and attempt < PORT_ATTEMPTS:
                        print(f"Port {os.environ['MASTER_PORT']} was taken meanwhile; trying another.", flush=True)
                        continue
                    report(f"error: process {err.error_index} failed (see its traceback above); the others were "
                           "stopped")
                    sys.exit(1)
                except mp.ProcessExitedException as err:
                    exit_on_lost_process(err, context.processes)
                finally:
                    # Also on Ctrl-C to this process: no worker outlives the launcher.
                    stop_processes(context.processes)
    finally:
        if port_is_ours:
            # The next job this process starts (the benchmark starts many) picks a free port of its own.
            os.environ.pop("MASTER_PORT", None)
            os.environ.pop("MASTER_PORT_CHOSEN_BY", None)


class StopSignalPasser:
    """Passes a stop signal that reaches this launcher on to every process it has started, also to those it
    started while the signal came."""

    def __init__(self) -> None:
        self.processes: list[mp.Process] = []
        self.received: list[tuple[float, int]] = []  # (when, which signal)

    def __call__(self, signum: int, frame: object) -> None:
        self.received.append((time.monotonic(), signum))
        self.pass_on(signum)

    def pass_on(self, signum: int) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    def adopt(self, processes: list[mp.Process]) -> None:
        self.processes = processes
        if self.received:
            self.pass_on(self.received[0][1])


@contextlib.contextmanager
def stop_signals_passed_on() -> Iterator[StopSignalPasser]:
    passer = StopSignalPasser()
    previous = {signum: signal.signal(signum, passer) for signum in STOP_SIGNALS}
    try:
        yield passer
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def join_all(context: mp.ProcessContext, stop_deadline_s: float, passer: StopSignalPasser) -> None:
    """Wait until every process has ended; raise as join() does when one fails.

    After a stop signal, which `passer` has passed on (the processes then stop after the same step and write
    a checkpoint), those that have not ended `stop_deadline_s` later are killed, and the job exits 143
    however its processes ended.
    """
    try:
        # join() raises when one process fails, after stopping the rest: SIGTERM once they had STOP_GRACE_S
        # to notice on their own, SIGKILL STOP_GRACE_S later.
        while not context.join(timeout=1.0, grace_period=STOP_GRACE_S):
            if passer.received and time.monotonic() - passer.received[0][0] > stop_deadline_s:
                report(f"error: the processes did not stop within {stop_deadline_s:.0f} s of the signal; killed "
                       "them (the last checkpoint written is kept)")
                stop_processes(context.processes, grace_s=0.0)
                sys.exit(REQUEUE_EXIT_CODE)
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        if not passer.received:
            raise
        # Stopped as asked, whichever way: at a step, or still starting (the signal's own default then ended
        # them, before they could say a word). The job is to be requeued either way.
        stop_processes(context.processes)
        if REQUEUE_EXIT_CODE not in (process.exitcode for process in context.processes):
            report(stopped_line(signal.Signals(passer.received[0][1]).name))
        sys.exit(REQUEUE_EXIT_CODE)


def stop_processes(processes: list[mp.Process], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL those that have not ended after `grace_s`."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def exit_on_lost_process(err: mp.ProcessExitedException, processes: list[mp.Process]) -> None:
    """A process ended without a Python exception: it printed its own error, or a signal killed it.

    The first to end need not be the one that explained: after a mistake the user can fix (exit 2) on one
    rank, the others end too, without a word. The job exits 2 if any process did.
    """
    if err.exit_code is not None and err.exit_code < 0:
        report(f"error: process {err.error_index} was killed by {signal.Signals(-err.exit_code).name}; "
               "the others were stopped")
        sys.exit(1)
    stop_processes(processes)
    sys.exit(2 if 2 in (process.exitcode for process in processes) else err.exit_code or 1)
