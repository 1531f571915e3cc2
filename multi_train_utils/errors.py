"""How a run ends early: a mistake the user can fix, a signal, or another process that stopped first."""

import os
import signal
import sys
import threading
import time
from typing import NoReturn

LAUNCHER_POLL_S = 1.0
KILL_AFTER_S = 20.0  # if a SIGTERM cannot end this process (stuck inside a GPU wait), SIGKILL does


class UserInputError(ValueError):
    """Bad data, flag or file. The scripts print it as one line, without a traceback.

    Anything else that goes wrong is our bug and keeps its traceback.
    """


# 128 + SIGTERM, what a process ended by SIGTERM reports: Kubernetes' ExitCode restart policy retries it
# (128-255 are retryable), and the README's sbatch script requeues the job on it.
REQUEUE_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """SIGTERM (or another stop signal) where no training step is coming to stop at, turned into an
    exception so that `finally` blocks still run: TensorBoard is closed, the process group left, data-loader
    workers stopped. Exits with 143, as a SIGTERM itself would."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.signal_name = signal_name


class Preempted(SystemExit):
    """A stop asked for by a signal, after the checkpoint of the step where every rank stopped was written
    (rank 0 has said so): every process exits with the code a requeue expects."""

    def __init__(self) -> None:
        super().__init__(REQUEUE_EXIT_CODE)


class QuietExit(SystemExit):
    """The exit of a process whose job another process has already explained: when one rank stops, the
    others fail too ("connection closed by peer"), and the user needs the first reason once, not N."""


QUIET_EXIT_DELAY_S = 2.0


def exit_quietly(code: int) -> NoReturn:
    """End this process without a word, a moment later: a launcher such as torchrun stops every process
    once one has ended, and the process that explains why must have had time to say so first. A stop
    from the launcher meanwhile ends it as quietly."""

    def stop(signum: int, frame: object) -> None:
        raise QuietExit(code)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    time.sleep(QUIET_EXIT_DELAY_S)
    raise QuietExit(code)


def exit_code(err: BaseException) -> int:
    """The exit code that says why a process stopped: 2 a mistake the user can fix, 130 Ctrl-C, 143 SIGTERM,
    1 anything else."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    if isinstance(err, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 2 if isinstance(err, UserInputError) else 1


def stop_when_launcher_dies(poll_s: float = LAUNCHER_POLL_S, kill_after_s: float = KILL_AFTER_S) -> None:
    """Stop this process within seconds if the process that started it dies.

    A launcher killed outright (SIGKILL, an out-of-memory kill) cannot stop its workers, which the system
    hands to another parent and which would then train on, and write, alone. A watching thread sees the
    parent change and sends this process SIGTERM: the usual clean stop. SIGKILL follows if that cannot
    run (a main thread stuck waiting for a GPU).
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(kill_after_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def stopped_line(cause: str) -> str:
    """What a run stopped at once (Ctrl-C, or a signal before or outside the training steps) says."""
    return f"Stopped by {cause}; the last checkpoint written is kept."


def report(line: str) -> None:
    """Write one line to stderr in a single write, so lines of several ranks sharing a terminal or a
    log never interleave mid-line (print writes the text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
