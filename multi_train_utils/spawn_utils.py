"""What the spawn script needs to start its own processes: how many, on which port, and how they end."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .checkpoint import CHECKPOINT_NAME
from .distributed_utils import find_free_port, port_was_taken, resolve_device
from .errors import REQUEUE_EXIT_CODE, QuietExit, UserInputError, report
from .launch import cpu_threads_per_process
from .shutdown import STOP_SIGNALS, end_run, listen_for_stop_signals

PORT_ATTEMPTS = 3
CPU_PROCESSES_PER_CORE = 4
STOP_GRACE_S = 3.0
# After a stop signal, how long the processes have beyond their own --stop-grace: they end by then
# themselves, at the latest 5 s after it (preemption.FORCED_EXIT_AFTER_S).
STOP_MARGIN_S = 10.0
# After Ctrl-C, how long the processes have to end by themselves; Ctrl-C reaches them from the terminal
# as it reaches this launcher. One that has not ended by then (a SIGINT sent to the launcher alone) gets it.
CTRL_C_GRACE_S = 5.0
SIGINT_EXIT_CODE = 128 + signal.SIGINT
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
    """The entry point of every spawned process. However it ends early, it ends as under a launcher
    (shutdown.end_run), with an exit code the spawn script reads; only a port that another program took
    meanwhile goes back to the spawn script as the error itself, to try another."""
    listen_for_stop_signals()
    try:
        worker(rank, world_size, args)
    except BaseException as err:
        if port_was_taken(err) and os.environ.get("MASTER_PORT_CHOSEN_BY") == "spawn":
            raise
        output_dir = getattr(args, "output_dir", None)
        end_run(err, rank, Path(output_dir) / CHECKPOINT_NAME if output_dir else None)


def spawn_workers(worker: Worker, world_size: int, args: argparse.Namespace, start_method: str = "spawn") -> None:
    """Start `world_size` processes running worker(rank, world_size, args) and wait for all of them.

    The processes meet on MASTER_ADDR:MASTER_PORT. Unless those are set, that is a free port on
    127.0.0.1, so two jobs on one machine do not collide; if another program takes the port between
    our choosing and our using it, we try again with another. When one process fails, the others are
    stopped, and the job exits with the code that says why.
    """
    port_is_ours = "MASTER_PORT" not in os.environ
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # mp's join logs each process it stops ("Terminating process ... via signal SIGTERM"); the processes
    # say themselves why they stopped.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if port_is_ours:
                os.environ["MASTER_PORT"] = str(find_free_port(os.environ["MASTER_ADDR"]))
                os.environ["MASTER_PORT_CHOSEN_BY"] = "spawn"  # taken meanwhile: try another, not a user error
            retry_port = port_is_ours and attempt < PORT_ATTEMPTS
            if start_and_wait(worker, world_size, args, start_method, retry_port):
                return
            print(f"Port {os.environ['MASTER_PORT']} was taken meanwhile; trying another.", flush=True)
    finally:
        if port_is_ours:
            # The next job this process starts (the benchmark starts many) picks a free port of its own.
            os.environ.pop("MASTER_PORT", None)
            os.environ.pop("MASTER_PORT_CHOSEN_BY", None)


def start_and_wait(worker: Worker, world_size: int, args: argparse.Namespace, start_method: str,
                   retry_port: bool) -> bool:
    """One attempt: start the processes and wait for them; True once they have all finished, False if the port
    was taken meanwhile and `retry_port`. Signals reaching this launcher are passed on from before the first
    process starts: a signal meanwhile must not end it in the middle of starting them, which would leave those
    started so far waiting for the rest of their group."""
    with stop_signals_passed_on() as passer:
        context = mp.start_processes(run_worker, args=(worker, world_size, args), nprocs=world_size,
                                     join=False, start_method=start_method)
        passer.adopt(context.processes)
        try:
            join_all(context, getattr(args, "stop_grace", 20.0) + STOP_MARGIN_S, passer)
            return True
        except mp.ProcessRaisedException as err:  # what run_worker sends back: only a port that was taken
            if retry_port and port_was_taken(err):
                return False
            report(f"error: process {err.error_index} failed:\n{err}")
            sys.exit(1)
        except mp.ProcessExitedException as err:
            exit_on_lost_process(err, context.processes)
        finally:
            stop_processes(context.processes)  # no process outlives the launcher
    return True


class StopSignalPasser:
    """Passes a stop signal that reaches this launcher on to every process it has started, also to those it
    started while the signal came. Ctrl-C reaches them from the terminal as it reaches the launcher: it is
    noted here, and passed on only to a process that has not ended CTRL_C_GRACE_S later."""

    def __init__(self) -> None:
        self.processes: list[mp.Process] = []
        self.received: list[tuple[float, int]] = []  # (when, which signal)

    def __call__(self, signum: int, frame: object) -> None:
        self.received.append((time.monotonic(), signum))
        if signum != signal.SIGINT:
            self.pass_on(signum)

    def pass_on(self, signum: int) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    def adopt(self, processes: list[mp.Process]) -> None:
        self.processes = processes
        stops = [signum for _, signum in self.received if signum != signal.SIGINT]
        if stops:
            self.pass_on(stops[0])

    def first(self) -> tuple[float, int] | None:
        return self.received[0] if self.received else None


@contextlib.contextmanager
def stop_signals_passed_on() -> Iterator[StopSignalPasser]:
    passer = StopSignalPasser()
    previous = {signum: signal.signal(signum, passer) for signum in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        yield passer
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def join_all(context: mp.ProcessContext, stop_deadline_s: float, passer: StopSignalPasser) -> None:
    """Wait until every process has ended; raise as join() does when one fails.

    After a stop signal, which `passer` has passed on (the processes then stop after the same step and write a
    checkpoint), or Ctrl-C (they stop at once), those that have not ended `stop_deadline_s` later are killed,
    and the job exits 143 or 130 however its processes ended.
    """
    try:
        # join() raises when one process fails, after stopping the rest: SIGTERM once they had STOP_GRACE_S
        # to notice on their own, SIGKILL STOP_GRACE_S later.
        while not context.join(timeout=1.0, grace_period=STOP_GRACE_S):
            if passer.first():
                hurry(context.processes, passer, stop_deadline_s)
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        if not passer.first():
            raise
    if passer.first():
        end_after_signal(context.processes, passer.first()[1])


def hurry(processes: list[mp.Process], passer: StopSignalPasser, stop_deadline_s: float) -> None:
    """After a signal: pass Ctrl-C on to processes that did not get it themselves, and kill those that have not
    stopped by the deadline."""
    when, signum = passer.first()
    waited = time.monotonic() - when
    if signum == signal.SIGINT and waited > CTRL_C_GRACE_S:
        passer.pass_on(signal.SIGINT)
    if waited > (CTRL_C_GRACE_S * 2 if signum == signal.SIGINT else stop_deadline_s):
        report(f"error: the processes did not stop within {waited:.0f} s of the signal; killed them (the last "
               "checkpoint written is kept)")
        stop_processes(processes, grace_s=0.0)
        raise QuietExit(SIGINT_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE)


def end_after_signal(processes: list[mp.Process], signum: int) -> None:
    """The job's end after a signal: the code a requeue expects (143), or Ctrl-C's (130). The processes have
    said where they stopped; one still starting died of the signal's own action, before it could: then this
    launcher says it."""
    stop_processes(processes)
    code = SIGINT_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE
    if code not in (process.exitcode for process in processes):
        cause = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        report(f"Stopped by {cause} while the processes were starting; nothing was trained")
    raise QuietExit(code)


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
    """A process ended without finishing: it said why itself (exit 2 a mistake the user can fix, 1 our bug),
    or a signal killed it before it could.

    The first to end need not be the one that explained: after a mistake the user can fix on one rank, the
    others end too. The job exits 2 if any process did.
    """
    if err.exit_code is not None and err.exit_code < 0:
        report(f"error: process {err.error_index} was killed by {signal.Signals(-err.exit_code).name}; "
               "the others were stopped")
        sys.exit(1)
    stop_processes(processes)
    raise QuietExit(2 if 2 in (process.exitcode for process in processes) else err.exit_code or 1)
