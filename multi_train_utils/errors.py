"""The ways a run ends early, as exceptions; the one line that says why; how stop signals and Ctrl-C are caught
from the first moment; and the refusal of a PyTorch older than supported. Standard library only: the scripts
import this before anything slow (torch)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from .versions import OLDEST_TORCH, OLDEST_TORCHVISION, dotted

# SIGUSR1 is what SLURM users choose for --signal; SIGUSR2 what submitit and LSF send; SIGTERM what every
# scheduler sends last.
STOP_SIGNALS = (signal.SIGTERM,) if sys.platform == "win32" else (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# 128 + the signal: what a process ended by it reports. Kubernetes' ExitCode restart policy retries 128-255, and
# the sbatch script of docs/clusters.md requeues the job on 143.
REQUEUE_EXIT_CODE = 128 + signal.SIGTERM
CTRL_C_EXIT_CODE = 128 + signal.SIGINT


def report(line: str, stream: TextIO | None = None) -> None:
    """Write one line to stderr (or `stream`) in a single write, so lines of several ranks sharing a terminal
    or a log never run into each other (print writes the text and the newline separately)."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


class UserInputError(ValueError):
    """Bad data, flag or file. The scripts print it as one line, without a traceback.

    Anything else that goes wrong is our bug and keeps its traceback.
    """


class Terminated(SystemExit):
    """SIGTERM (or another stop signal) where no training step is coming to stop at, turned into an
    exception so that `finally` blocks still run: the process group is left, data-loader workers stopped.
    Exits with 143, as a SIGTERM itself would."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.signal_name = signal_name


class Preempted(SystemExit):
    """A stop asked for by a signal, after the checkpoint of the step where every rank stopped was written:
    every process exits with the code a requeue expects, and rank 0 says `line`."""

    def __init__(self, line: str = "") -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.line = line


class QuietExit(SystemExit):
    """The exit of a process whose end another process explains: when one rank stops, the others fail
    too ("connection closed by peer"), and the user needs the first reason once, not N times."""


def exit_code(err: BaseException) -> int:
    """The exit code that says why a process stopped: 2 a mistake the user can fix, 130 Ctrl-C, 143 SIGTERM,
    1 anything else."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    if isinstance(err, KeyboardInterrupt):
        return CTRL_C_EXIT_CODE
    return 2 if isinstance(err, UserInputError) else 1


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_LINE = 300  # characters: what a terminal shows in two or three rows


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


class _Ending:
    under_way = False  # a stop or a failure is being handled: later stop signals change nothing
    store_gone = False  # the key-value store did not answer once (its host has ended): it is not asked again
    launcher: int | None = None  # the process that started this one, where shutdown watches it
    python_unraisablehook = sys.unraisablehook


def quiet_ctrl_c_while_starting() -> None:
    """Ctrl-C before the run has set itself up (importing torch alone takes seconds) ends the process with
    one line and 130, instead of a page of traceback from inside the imports. run_cli replaces this."""

    def stop(signum: int, frame: object) -> None:
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # a launcher's rank 0 says it
            report("Stopped by Ctrl-C while starting; nothing was trained")
        os._exit(CTRL_C_EXIT_CODE)

    signal.signal(signal.SIGINT, stop)


def hold_back_ctrl_c(held: bool) -> None:
    """Block Ctrl-C in this thread (it waits, and arrives once unblocked), or unblock it. Where there are no
    signal masks (Windows), nothing."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK if held else signal.SIG_UNBLOCK, [signal.SIGINT])


@contextlib.contextmanager
def signals_end_the_wait(rank: int, moment: str) -> Iterator[None]:
    """Ctrl-C and the stop signals end the process at once, with one line from rank 0, while the block waits
    inside C++ for other processes (nothing is written yet): such a wait returns to Python only when it
    ends, after --dist-timeout, and a signal that interrupts it only makes it print a page of C++ frames and
    try again. The main thread holds the signals back meanwhile; Python's own handler, in whichever thread
    takes them, wakes a thread that ends the process."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    import socket  # here: its import takes longer than the scripts may wait before catching Ctrl-C

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signals = (signal.SIGINT, *STOP_SIGNALS)
    over = threading.Event()

    def end_on_a_signal() -> None:
        while (received := reader.recv(64)) and not over.is_set():
            signum = next((number for number in received if number in signals), None)
            if signum is not None:
                if rank == 0:
                    cause = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
                    report(f"Stopped by {cause} {moment}; nothing was trained")
                os._exit(CTRL_C_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE)

    watcher = threading.Thread(target=end_on_a_signal, name="signals-while-waiting", daemon=True)
    watcher.start()  # before the main thread holds the signals back: this thread may take them
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # one that came just now: the usual way
        signal.set_wakeup_fd(previous_fd)
        over.set()
        writer.close()
        watcher.join()
        reader.close()


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as 2.6.0+cu124 or 2.7.0a0+git1a2b3c (a pre-release of 2.7 counts as 2.7)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a release number: {version!r}")
    return int(found[1]), int(found[2])


def unsupported_pytorch(torch_version: str, torchvision_version: str) -> str | None:
    """The one-line error for a torch/torchvision pair older than the oldest supported one (versions.py says
    which, and why), or None."""
    if release(torch_version) >= OLDEST_TORCH and release(torchvision_version) >= OLDEST_TORCHVISION:
        return None
    return (f"error: installed are torch {torch_version} and torchvision {torchvision_version}; this needs torch >= "
            f"{dotted(OLDEST_TORCH)} and torchvision >= {dotted(OLDEST_TORCHVISION)} "
            "(pip install -U -r requirements.txt)")


def require_supported_pytorch() -> None:
    """Exit with code 2 and one line, before any work, where the installed PyTorch is older than supported."""
    torch_version, torchvision_version = installed_version("torch"), installed_version("torchvision")
    if torch_version is None or torchvision_version is None:
        return  # not installed: its own import tells
    problem = unsupported_pytorch(torch_version, torchvision_version)
    if problem is not None:
        report(problem)
        sys.exit(2)


def installed_version(package: str) -> str | None:
    """The release of `package` as its version.py says (torch and torchvision each write one), or None where it
    is not installed. Read without importing it (torch takes seconds) or importlib.metadata (a tenth of a
    second, during which Ctrl-C is not yet caught); pip's record of it where there is no version.py."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        with contextlib.suppress(OSError), open(os.path.join(folder, "version.py")) as file:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", file.read(), re.MULTILINE)
            if found:
                return found[1]
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def stop_now(signum: int, frame: object = None) -> None:
    """What a stop signal does outside the training steps: end the process through an exception, once."""
    if _Ending.under_way:
        return  # schedulers and impatient users signal twice: the stop is already under way
    _Ending.under_way = True
    raise Terminated(signal.Signals(signum).name)


def listen_for_stop_signals() -> None:
    """A stop signal ends the process through an exception, so that every `finally` runs (the process group
    is left, the port freed, the loader workers stopped), and so does Ctrl-C (KeyboardInterrupt); while
    training runs, preemption.py makes the stop signals wait for the next step instead."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_now)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.unraisablehook is not raise_a_dropped_stop_again:
        _Ending.python_unraisablehook = sys.unraisablehook
        sys.unraisablehook = raise_a_dropped_stop_again


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
