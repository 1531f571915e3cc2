"""How a run ends early: a mistake the user can fix, or a signal."""

import signal
import sys


class UserInputError(ValueError):
    """Bad data, flag or file. The scripts print it as one line, without a traceback.

    Anything else that goes wrong is our bug and keeps its traceback.
    """


class Terminated(SystemExit):
    """SIGTERM, turned into an exception so that `finally` blocks still run: TensorBoard is closed, the
    process group left, data-loader workers stopped. Exits with 143, as the signal itself would."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def raise_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, handler)


def report(line: str) -> None:
    """Write one line to stderr in a single write, so lines of several ranks sharing a terminal or a
    log never interleave mid-line (print writes the text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
