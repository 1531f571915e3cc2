"""The ways a run ends early, as exceptions; the one line that says why; how stop signals and Ctrl-C are caught
from the first moment, and an output that closes costs nothing. Standard library only: the scripts import this
before anything slow (torch), to catch Ctrl-C from the first moment."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

# SIGUSR1 is what SLURM users choose for --signal; SIGUSR2 what submitit and LSF send; SIGTERM what every
# scheduler sends last; SIGHUP what a closed terminal or ssh session sends (torchrun passes it on).
STOP_SIGNALS = (signal.SIGTERM,) if sys.platform == "win32" else (
    signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
# 128 + the signal: what a process ended by it reports. Kubernetes' ExitCode restart policy retries 128-255, and
# the sbatch script of docs/clusters.md requeues the job on 143.
REQUEUE_EXIT_CODE = 128 + signal.SIGTERM
CTRL_C_EXIT_CODE = 128 + signal.SIGINT
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_LINE = 300  # characters: what a terminal shows in two or three rows


def report(line: str, stream: TextIO | None = None) -> None:
    """Write `line` to stderr (or `stream`) in one write: the lines of ranks sharing a log never run together."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


class UserInputError(ValueError):
    """Bad data, flag or file, said in one line without a traceback (anything else is our bug, and keeps its own)."""


class NonFiniteLossError(UserInputError):
    """The loss became NaN or infinite: training has diverged. Raised on every rank at the same step."""


class GroupNotFormedError(UserInputError):
    """The processes never met: each says so itself, since none can count on another to."""


class QuietExit(SystemExit):
    """The exit of a process whose end another explains: one rank's stop makes the others fail too."""


class Terminated(SystemExit):
    """A stop signal outside the training steps, as an exception (every `finally` runs): exits 143, as SIGTERM."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.signal_name = signal_name


class Preempted(SystemExit):
    """A stop at the step where every rank stopped, its checkpoint written: exits 143, rank 0 saying `line`."""

    def __init__(self, line: str = "") -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.line = line


class _Ending:
    under_way = False  # a stop or a failure is being handled: later stop signals change nothing
    store_gone = False  # the key-value store did not answer once (its host has ended): it is not asked again
    launcher: int | None = None  # the process that started this one, where shutdown watches it
    python_unraisablehook = sys.unraisablehook


def exit_code(err: BaseException) -> int:
    """The exit code that says why a process stopped: 2 a mistake the user can fix, 130 Ctrl-C, 143 SIGTERM,
    1 anything else."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    if isinstance(err, KeyboardInterrupt):
        return CTRL_C_EXIT_CODE
    return 2 if isinstance(err, UserInputError) else 1


def one_line(err: BaseException) -> str:
    """The message of `err` on one line of at most MAX_LINE characters, without terminal colour codes. An
    error raised in a data-loader worker arrives with the worker's traceback inside its message; its last
    line is the original message. A longer line (a path of long names) loses its middle: its start names
    the flag or the file, its end says what to do."""
    lines = [line for line in ANSI_ESCAPE.sub("", str(err)).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    last = lines[-1]
    prefix = f"{type(err).__name__}: "
    line = last.split(prefix, 1)[-1] if prefix in last else last
    if len(line) <= MAX_LINE - len("error: "):
        return line
    keep = (MAX_LINE - len("error: ") - len(" [...] ")) // 2
    return f"{line[:keep]} [...] {line[-keep:]}"


def shortened(line: str, limit: int = MAX_LINE) -> str:
    """`line` cut to `limit` characters, its end marked, so that no message fills the screen."""
    return line if len(line) <= limit else line[:limit - 6] + " [...]"


def path_kind(path: Path, flag: str) -> str:
    """What `path` named by `flag` is: "missing", "folder", "file" or "other" (a device, a pipe); a path the system
    refuses to look up (a name too long, a loop of links, a folder it may not read) is one line."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # not there, or a file where a folder of the path should be
        return "missing"
    except OSError as err:
        raise UserInputError(f"{flag} {shortened(str(path), 120)}: {system_reason(err)}") from None
    return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def system_reason(err: OSError) -> str:
    """The system's reason for `err` in its own words ("permission denied"), without the path it repeats."""
    return (err.strerror or str(err)).lower()


def quiet_ctrl_c_while_starting() -> None:
    """Ctrl-C while the script imports torch (seconds) ends it in one line and 130; run_cli replaces this. And
    from now on, an output that is closed or goes away costs the run nothing (outputs_may_close)."""
    signal.signal(signal.SIGINT, stopped_while_starting)
    outputs_may_close()


def outputs_may_close() -> None:
    """Keep training when stdout or stderr is closed from the start (`1>&-`, a service) or its reader goes away
    (`| head`, a closed terminal): what is written there then goes nowhere, instead of failing the run."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        if stream is None:  # its descriptor is free: the next file opened would get it, and C++'s writes with it
            point_at_nowhere(fd)
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))  # noqa: SIM115 (the process's own)
        elif type(stream) is io.TextIOWrapper:  # Python's own; not a test's capture
            setattr(sys, name, OutputThatMayClose(stream))


def point_at_nowhere(fd: int) -> None:
    """Make descriptor `fd` os.devnull's (where `fd` is closed, opening os.devnull may give `fd` itself)."""
    nowhere = os.open(os.devnull, os.O_WRONLY)
    if nowhere != fd:
        os.dup2(nowhere, fd)
        os.close(nowhere)


class OutputThatMayClose:
    """A text stream whose reader may go away: from then on it writes to os.devnull (its descriptor too, so that
    C++'s writes and the interpreter's last flush go there as well)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.send_to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.send_to_nowhere()

    def send_to_nowhere(self) -> None:
        point_at_nowhere(self.stream.fileno())
        self.stream.flush()  # what was held for the pipe

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, reconfigure: the stream's own
        return getattr(self.stream, name)


def stopped_while_starting(signum: int, frame: object) -> None:
    says = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"  # a launcher's rank 0 says it
    stopped_before_training(signum, "while starting", says)


def stopped_before_training(signum: int, moment: str, says: bool) -> NoReturn:
    """End the process at once, the one that `says` saying which signal stopped it `moment`: nothing is written."""
    if says:
        cause = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        report(f"Stopped by {cause} {moment}; nothing was trained")
    os._exit(CTRL_C_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE)


def hold_back_ctrl_c(held: bool) -> None:
    """Block Ctrl-C in this thread (it arrives once unblocked), or unblock it; not on Windows (no signal masks)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK if held else signal.SIG_UNBLOCK, [signal.SIGINT])


@contextlib.contextmanager
def signals_end_the_wait(rank: int, moment: str) -> Iterator[None]:
    """Ctrl-C and the stop signals end the process at once, rank 0 saying so, while the block waits in C++ for the
    others (a signal there prints C++ frames, and it waits on to --dist-timeout): held back, they wake a watcher."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    reader, writer = os.pipe()
    os.set_blocking(writer, False)  # as a wakeup fd must be
    watcher = threading.Thread(target=end_on_a_signal, args=(reader, rank, moment), name="signals-while-waiting",
                               daemon=True)
    watcher.start()  # before the main thread holds the signals back: this thread may take them
    previous_fd = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, *STOP_SIGNALS))
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)  # first: a signal from now on comes the usual way
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        os.close(writer)  # which ends the watcher's wait
        watcher.join()
        os.close(reader)


def end_on_a_signal(reader: int, rank: int, moment: str) -> None:
    """Python's handler of each signal writes its number to the wakeup fd: Ctrl-C or a stop signal ends the process."""
    while received := os.read(reader, 64):
        for signum in received:
            if signum == signal.SIGINT or signum in STOP_SIGNALS:
                stopped_before_training(signum, moment, rank == 0)


def stop_now(signum: int, frame: object = None) -> None:
    """What a stop signal does outside the training steps: end the process through an exception, once."""
    if _Ending.under_way:
        return  # schedulers and impatient users signal twice: the stop is already under way
    _Ending.under_way = True
    raise Terminated(signal.Signals(signum).name)


def listen_for_stop_signals() -> None:
    """A stop signal, like Ctrl-C, ends the process through an exception: every `finally` runs (features.py
    makes it wait for the next step while training runs)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_now)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.unraisablehook is not raise_a_dropped_stop_again:  # installed once, in front of whichever was there
        _Ending.python_unraisablehook, sys.unraisablehook = sys.unraisablehook, raise_a_dropped_stop_again


def raise_a_dropped_stop_again(unraisable: sys.UnraisableHookArgs) -> None:
    """A stop raised while Python was running a finalizer (a generator closed by the garbage collector, a
    `__del__`) is dropped there with an "Exception ignored" page, and the run would go on. Its signal comes
    again instead, a moment later, when the main thread has left the finalizer."""
    stop = unraisable.exc_value
    if isinstance(stop, Terminated):
        _Ending.under_way = False  # this stop never reached end_run
        signum = signal.Signals[stop.signal_name]
    elif isinstance(stop, KeyboardInterrupt):
        signum = signal.SIGINT
    else:
        _Ending.python_unraisablehook(unraisable)
        return
    threading.Thread(target=signal_the_main_thread, args=(signum,), daemon=True, name="stop-again").start()


def signal_the_main_thread(signum: int, after_s: float = 0.05) -> None:
    # Not from inside the hook itself, which runs within the finalizer: the stop would be dropped again.
    time.sleep(after_s)
    if not _Ending.under_way:
        signal.pthread_kill(threading.main_thread().ident, signum)
