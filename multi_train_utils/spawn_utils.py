"""What the spawn script adds around its own `torch.multiprocessing.spawn` call: how many processes, where they
meet (a free port), the signals passed on to them, and the exit code that says how they ended."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.multiprocessing as mp

from .errors import (
    CTRL_C_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    STOP_SIGNALS,
    QuietExit,
    UserInputError,
    hold_back_ctrl_c,
    report,
    system_reason,
)
from .launch import resolve_device, usable_cpus
from .meeting import find_free_port

CPU_PROCESSES_PER_CORE = 4
STOP_GRACE_S = 3.0
# After a stop signal, how long the processes have beyond their own --stop-grace: they end by then
# themselves, at the latest 5 s after it (preemption.FORCED_EXIT_AFTER_S).
STOP_MARGIN_S = 10.0
# After Ctrl-C, how long the processes have to end by themselves; Ctrl-C reaches them from the terminal
# as it reaches this launcher. One that has not ended by then (a SIGINT sent to the launcher alone) gets it.
CTRL_C_GRACE_S = 5.0

# mp.spawn's join logs each process it stops ("Terminating process ... via signal SIGTERM"); the processes
# say themselves why they stopped.
logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def processes_to_start(world_size: int | None, device: str | None) -> int:
    """--world-size, checked against the GPUs; by default one process per GPU, or 2 on a CPU."""
    on_cuda = resolve_device(device, 0, distributed=False).type == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    if world_size is None:
        return gpus if on_cuda else 2
    if on_cuda and world_size > gpus:
        raise UserInputError(f"--world-size {world_size}: only {gpus} GPU(s) visible (one process per GPU)")
    if not on_cuda:
        check_cpu_processes(world_size)
    return world_size


def check_cpu_processes(world_size: int) -> None:
    """Each process holds a model, an optimizer and its batches: past a few per core they only fight for the cores
    and the memory."""
    cpus = usable_cpus()
    if world_size > CPU_PROCESSES_PER_CORE * cpus:
        raise UserInputError(f"--world-size {world_size}: more processes than this machine's {cpus} CPU core(s) "
                             f"can run (at most {CPU_PROCESSES_PER_CORE * cpus})")


@contextlib.contextmanager
def meeting_on_a_free_port(dist_url: str = "env://") -> Iterator[None]:
    """Where the processes meet, for the length of the block. env://: a free port of 127.0.0.1, so that two jobs
    on one machine do not collide, unless MASTER_ADDR and MASTER_PORT are set (yours win); the next job this process
    starts picks a port of its own. tcp://HOST:PORT: HOST must be this machine's, as for MASTER_ADDR."""
    chosen: dict[str, str] = {}  # the variables set here, and unset when the block ends
    if dist_url.startswith("tcp://"):
        url = urlparse(dist_url)  # its form checked by cli.check_meeting_address
        free_port_here(url.hostname or "", f"--dist-url {dist_url}", f"such as tcp://127.0.0.1:{url.port}")
    else:
        chosen = master_addr_and_port()
    os.environ.update(chosen)
    try:
        yield
    finally:
        for name in chosen:
            os.environ.pop(name, None)


def master_addr_and_port() -> dict[str, str]:
    """What env:// needs that is not set: MASTER_ADDR 127.0.0.1, and a free MASTER_PORT there (with
    MASTER_PORT_CHOSEN_BY, for the message if it is taken meanwhile)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    chosen = {} if "MASTER_ADDR" in os.environ else {"MASTER_ADDR": host}
    if "MASTER_PORT" not in os.environ:
        port = free_port_here(host, f"MASTER_ADDR {host}", "or unset MASTER_ADDR")
        chosen.update(MASTER_PORT=str(port), MASTER_PORT_CHOSEN_BY="spawn")
    return chosen


def free_port_here(host: str, named: str, instead: str) -> int:
    """A free port of `host`, which must be this machine's, where every spawned process runs, rank 0 among them:
    elsewhere they would wait for a rank 0 that is not there."""
    try:
        return find_free_port(host)
    except OSError as err:
        raise UserInputError(f"{named}: this machine cannot listen there ({system_reason(err)}); the spawned "
                             f"processes all run here: give an address of this machine, {instead}") from None


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
        """Pass signals on to `processes` from now on, and the stop signal that came while they started."""
        self.processes = processes
        hold_back_ctrl_c(False)
        stops = [signum for _, signum in self.received if signum != signal.SIGINT]
        if stops:
            self.pass_on(stops[0])

    def first(self) -> tuple[float, int] | None:
        return self.received[0] if self.received else None


@contextlib.contextmanager
def stop_signals_passed_on() -> Iterator[StopSignalPasser]:
    """Signals that reach this launcher are passed on (StopSignalPasser), from before the first process
    starts: a signal meanwhile must not end the launcher in the middle of starting them, which would leave
    those started so far waiting for the rest of their group. Ctrl-C is held back meanwhile, and the new
    processes start with it held back (a signal mask survives fork and exec): each gets it once it has set up
    its own handling (cli.ends_in_one_line), instead of a traceback from the middle of `import torch`."""
    passer = StopSignalPasser()
    previous = {signum: signal.signal(signum, passer) for signum in (*STOP_SIGNALS, signal.SIGINT)}
    if os.name == "posix":
        # Started now, not by the first process: starting it unblocks Ctrl-C again afterwards, and every
        # process started after that would get Ctrl-C in the middle of its imports.
        resource_tracker.ensure_running()
    hold_back_ctrl_c(True)
    try:
        yield passer
    finally:
        hold_back_ctrl_c(False)
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def wait_for_all(context: mp.ProcessContext, passer: StopSignalPasser, stop_grace_s: float) -> None:
    """Wait until every process has ended; no process outlives this launcher. When one fails, mp's join()
    stops the others (SIGTERM once they had STOP_GRACE_S to notice on their own, SIGKILL STOP_GRACE_S later),
    and the job exits with the code that says why. After a stop signal (passed on: the processes then stop
    after the same step and write a checkpoint) or Ctrl-C (they stop at once), those that have not ended
    --stop-grace + STOP_MARGIN_S later are killed, and the job exits 143 or 130 however its processes ended."""
    passer.adopt(context.processes)
    try:
        while not context.join(timeout=1.0, grace_period=STOP_GRACE_S):
            if passer.first():
                hurry(context.processes, passer, stop_grace_s + STOP_MARGIN_S)
    except mp.ProcessRaisedException as err:  # an error before the process could say it itself
        if not passer.first():
            report(f"error: process {err.error_index} failed:\n{err}")
            sys.exit(1)
    except mp.ProcessExitedException as err:
        if not passer.first():
            exit_on_lost_process(err, context.processes)
    finally:
        stop_processes(context.processes)
    if passer.first():
        end_after_signal(context.processes, passer.first()[1])


def hurry(processes: list[mp.Process], passer: StopSignalPasser, stop_deadline_s: float) -> None:
    """After a signal: pass Ctrl-C on to processes that did not get it themselves, and kill those that have not
    stopped by the deadline."""
    when, signum = passer.first()
    if any(map(holds_ctrl_c_back, processes)):  # still importing torch (seconds; more on a loaded machine): the
        passer.received[0] = (time.monotonic(), signum)  # clock starts once every process can stop
        return
    waited = time.monotonic() - when
    if signum == signal.SIGINT and waited > CTRL_C_GRACE_S:
        passer.pass_on(signal.SIGINT)
    if waited > (CTRL_C_GRACE_S * 2 if signum == signal.SIGINT else stop_deadline_s):
        report(f"error: the processes did not stop within {waited:.0f} s of the signal; killed them (the last "
               "checkpoint written is kept)")
        stop_processes(processes, grace_s=0.0)
        raise QuietExit(CTRL_C_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE)


def holds_ctrl_c_back(process: mp.Process) -> bool:
    """Whether `process` is still starting, before cli.ends_in_one_line lets Ctrl-C in (stop_signals_passed_on),
    as Linux's /proc tells; False where there is none to ask."""
    with contextlib.suppress(OSError, TypeError):
        status = Path(f"/proc/{process.pid}/status").read_text()
        blocked = re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.MULTILINE)
        return bool(int(blocked[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


def end_after_signal(processes: list[mp.Process], signum: int) -> None:
    """The job's end after a signal: the code a requeue expects (143), or Ctrl-C's (130). The processes have
    said where they stopped; one still starting died of the signal's own action, before it could: then this
    launcher says it."""
    code = CTRL_C_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE
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
        name = signal.Signals(-err.exit_code).name
        why = {"SIGKILL": " (the out-of-memory killer sends it)",
               "SIGABRT": " (a C++ abort: gloo's, above, when the ranks call collectives that do not match)"}
        report(f"error: rank {err.error_index} was killed by {name}{why.get(name, '')}; the others were stopped")
        sys.exit(1)
    stop_processes(processes)
    raise QuietExit(2 if 2 in (process.exitcode for process in processes) else err.exit_code or 1)
