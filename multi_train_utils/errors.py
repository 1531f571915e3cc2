"""The ways a run ends early, as exceptions, and the one line that says why."""

from __future__ import annotations

import re
import signal
import sys


class UserInputError(ValueError):
    """Bad data, flag or file. The scripts print it as one line, without a traceback.

    Anything else that goes wrong is our bug and keeps its traceback.
    """


# SIGUSR1 is what SLURM users choose for --signal; SIGUSR2 what submitit and LSF send; SIGTERM what every
# scheduler sends last.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))

# 128 + SIGTERM, what a process ended by SIGTERM reports: Kubernetes' ExitCode restart policy retries it
# (128-255 are retryable), and the sbatch script of docs/clusters.md requeues the job on it.
REQUEUE_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """SIGTERM (or another stop signal) where no training step is coming to stop at, turned into an
    exception so that `finally` blocks still run: the process group is left, data-loader workers and
    TensorBoard stopped. Exits with 143, as a SIGTERM itself would."""

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
    """The exit of a process whose job another process explains: when one rank stops, the others fail
    too ("connection closed by peer"), and the user needs the first reason once, not N times."""


def exit_code(err: BaseException) -> int:
    """The exit code that says why a process stopped: 2 a mistake the user can fix, 130 Ctrl-C, 143 SIGTERM,
    1 anything else."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    if isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 2 if isinstance(err, UserInputError) else 1


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(err: BaseException) -> str:
    """The message of `err` on one line, without terminal colour codes. An error raised in a data-loader
    worker arrives with the worker's traceback inside its message; its last line is the original message."""
    lines = [line for line in ANSI_ESCAPE.sub("", str(err)).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    last = lines[-1]
    prefix = f"{type(err).__name__}: "
    return last.split(prefix, 1)[-1] if prefix in last else last


def report(line: str) -> None:
    """Write one line to stderr in a single write, so lines of several ranks sharing a terminal or a
    log never interleave mid-line (print writes the text and the newline separately). It starts on a line
    of its own: a progress bar may have left the cursor at the end of its line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
