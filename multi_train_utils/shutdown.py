"""Ending every process of a job together: one line that says why, from one process; the same exit code from
all of them; no process left waiting for a partner or training on alone.

`end_run` is the one place where a run that did not finish ends, in every process of every launcher, through
cli.ends_in_one_line, which run_cli and the spawn script's worker run inside.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from .config import RunConfig
from .distributed_utils import barrier, cleanup, is_dist_avail_and_initialized
from .errors import (
    STOP_SIGNALS,
    GroupNotFormedError,
    Preempted,
    QuietExit,
    Terminated,
    UserInputError,
    _Ending,
    exit_code,
    one_line,
    report,
)
from .flight_recorder import how_to_read, where_this_rank_waits
from .launch import launcher_gone
from .meeting import meeting_point
from .recorder import CHECKPOINT_NAME
from .versions import default_store, has_default_store

# How long a failing process asks the process group's key-value store before it gives up on it (not the
# --dist-timeout of the collectives: the store's host may be gone with the rest of the job).
STORE_TIMEOUT_S = 5.0
Answer = TypeVar("Answer")
QUIET_EXIT_DELAY_S = 2.0


def absorb_later_signals() -> None:
    """While this process ends, a second stop signal is absorbed, and a second Ctrl-C ends it at once,
    silently: neither may interrupt the clean-up with a traceback."""
    _Ending.under_way = True
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signal.SIGINT))


def end_run(err: BaseException, rank: int, config: RunConfig | None = None) -> NoReturn:
    """End this process after `err`: rank 0 explains, the others end quietly.

    Once the processes are connected, the one that explains is the first to stop (a mistake found by rank 1
    alone is rank 1's to tell); the others then fail too ("connection closed by peer") and end with the
    same exit code and no word. A stop signal or Ctrl-C reached every process, so rank 0 tells it. A stop
    at a step (Preempted) leaves the group as a finished run does, once rank 0 has written its checkpoint.
    Our own bugs keep their traceback. A run that finished (or --help) passes through.
    """
    if isinstance(err, SystemExit) and err.code in (None, 0):
        raise err
    absorb_later_signals()
    run_dir = Path(config.output_dir) if config else None
    checkpoint = run_dir / CHECKPOINT_NAME if run_dir else None
    if isinstance(err, QuietExit):  # already said, by another process or by this one
        cleanup(failed=True)
        raise err
    if isinstance(err, Preempted):
        if rank == 0:  # before the others may exit: a launcher stops the whole job when the first one does
            report(err.line)
        try:
            barrier()  # no process ends before rank 0 has written the checkpoint and said so
        except Exception:  # a partner ended first (the launcher's end reached it between two steps) and said why
            cleanup(failed=True)
            raise QuietExit(err.code) from None
        cleanup()
        raise QuietExit(err.code)
    signalled = isinstance(err, (KeyboardInterrupt, Terminated))
    if launcher_gone() and not signalled:
        # Whatever broke, the launcher's end caused it: a partner whose watch saw it first left a collective.
        err, signalled = Terminated(), True
    reason = err if signalled else (collective_failure(err, rank, run_dir) or out_of_memory(err, config, checkpoint)
                                    or err)
    explains = rank == 0 if signalled or not is_dist_avail_and_initialized() else first_to_stop()
    if isinstance(reason, LostPeerError) and multiprocessing.parent_process() is not None:
        explains = False  # the spawn script, this process's parent, names the one that died, and how
    if isinstance(reason, (GroupNotFormedError, CutOffError)):
        explains = True  # the processes never met, or cannot reach one another: none can count on another
    cleanup(failed=True)
    code = exit_code(reason)
    if not explains:
        exit_quietly(code)
    if signalled:
        print(flush=True)  # the stop may have come while a progress bar drew its line, before it ended it
        report(stopped_line(reason, checkpoint))
    elif isinstance(reason, WhereRanksWait):  # its headline, then where each rank that could answer waits
        report(f"error: {reason}")
    elif isinstance(reason, UserInputError):
        report(f"error: {one_line(reason)}")
    elif not isinstance(reason, SystemExit):
        report(f"rank {rank} failed:\n{''.join(traceback.format_exception(reason)).rstrip()}")
    raise QuietExit(code) from None


def out_of_memory(err: BaseException, config: RunConfig | None, checkpoint: Path | None) -> UserInputError | None:
    """An allocation that failed, on a GPU or on the CPU, as one line that names what to lower; else None."""
    on_the_cpu = isinstance(err, RuntimeError) and "can't allocate memory" in str(err)  # DefaultCPUAllocator's
    if not (isinstance(err, torch.OutOfMemoryError) or on_the_cpu) or config is None:
        return None
    kept = f"; the last checkpoint, {checkpoint}, is kept" if checkpoint and checkpoint.is_file() else ""
    return UserInputError(f"out of memory on the {'CPU' if on_the_cpu else 'GPU'} with --batch-size "
                          f"{config.batch_size} and --image-size {config.image_size}: lower one of them (half the "
                          f"--batch-size with --accum-steps {2 * config.accum_steps} trains on the same batch per "
                          f"step){kept}")


def stopped_line(stop: BaseException, checkpoint: Path | None) -> str:
    """What a run stopped at once (Ctrl-C, or a signal outside the training steps) says."""
    cause = stop.signal_name if isinstance(stop, Terminated) else "Ctrl-C"
    if launcher_gone():
        cause = "the end of the launcher that started this run"
    if checkpoint is not None and checkpoint.is_file():
        return f"Stopped by {cause}; the last checkpoint written, {checkpoint}, is kept; go on with --resume auto"
    return f"Stopped by {cause} before any checkpoint was written"


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


def reachable_store() -> dist.Store | None:
    """The process group's key-value store, with a short time-out, or None where it is gone (its host ended:
    under torchrun the agent, else rank 0). Once gone it is not asked again: every failed call makes PyTorch
    print a page of C++ frames."""
    if launcher_gone() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _Ending.store_gone = True  # torchrun's agent kept the process group's store: it went with it
    if _Ending.store_gone or not is_dist_avail_and_initialized():
        return None
    try:
        store = default_store()
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:
        _Ending.store_gone = True
        return None
    return store


def first_to_stop() -> bool:
    """Whether this is the first process of the job to stop, counted in the process group's key-value
    store. A store that no longer answers was kept by a process that has stopped already. Without the store
    (a PyTorch that does not lend it), each process explains itself, as without a process group."""
    if not has_default_store():
        return True
    return store_answer(lambda store: store.add("processes_stopped", 1) == 1, gone=False)


def another_process_failed() -> bool:
    """Whether a process of the job has already stopped on an error (first_to_stop counted it), or the
    store that counts them is gone."""
    if not is_dist_avail_and_initialized() or not has_default_store():
        return False
    return store_answer(lambda store: store.check(["processes_stopped"]), gone=True)


def store_answer(question: Callable[[dist.Store], Answer], gone: Answer, longest_s: float = STORE_TIMEOUT_S) -> Answer:
    """What `question` asks of the process group's key-value store, or `gone` where the store does not answer
    within `longest_s`: its host has ended, or the network to it is down. Asked in a thread of its own: with
    the network down, no reset ever comes, and a question may wait on the dead connection for good (the
    store's own time-out bounds waiting for keys, not every reply)."""
    store = reachable_store()
    if store is None:
        return gone
    answers: list[Answer] = []

    def ask() -> None:
        with contextlib.suppress(Exception):  # PyTorch's own error prints its page of frames: gone, all the same
            answers.append(question(store))

    asking = threading.Thread(target=ask, name="store-question", daemon=True)
    asking.start()
    asking.join(longest_s)
    if not answers:
        _Ending.store_gone = True
        return gone
    return answers[0]


class WhereRanksWait(Exception):
    """A headline, then a line for each rank that could still answer, saying where it waits (flight_recorder.py),
    and where their records are."""

    def __init__(self, headline: str, where: dict[int, str] | None = None, record: str = "") -> None:
        lines = [headline, *(f"  rank {other} {waits}" for other, waits in sorted((where or {}).items()))]
        super().__init__("\n".join(lines + ([record] if where and record else [])))


class StalledRankError(WhereRanksWait, UserInputError):
    """A collective waited past --dist-timeout because some rank stopped answering, or because the ranks called
    collectives that do not match."""


class CutOffError(StalledRankError):
    """A time-out where the store does not answer either: no other process can tell, so each says it itself."""


class LostPeerError(WhereRanksWait):
    """A process of the job vanished in the middle of a collective (killed, or its machine gone, or aborted by gloo
    on receiving a collective it did not expect)."""


# What gloo and NCCL say when the process at the other end of a connection is gone.
LOST_PEER = re.compile(r"reset by peer|closed by peer|broken pipe|remote process exited|ncclRemoteError",
                       re.IGNORECASE)
PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
TIMED_OUT, LOST, MISMATCHED = "timed out", "lost a peer", "mismatched"
CHECKED_MISMATCH = "Detected mismatch between collectives"  # PyTorch's check of each collective (--check-collectives)


def collective_failure(err: BaseException, rank: int, run_dir: Path | None = None) -> BaseException | None:
    """If `err` is a collective that failed because another process stopped answering (a time-out) or is gone
    (a lost connection), the error that names the ranks concerned and where each rank still alive waits (from
    the flight recorder, whose record goes into `run_dir`); else None."""
    if not isinstance(err, RuntimeError):
        return None
    message = str(err)
    mismatched = CHECKED_MISMATCH in message
    # gloo says "Timed out waiting ..." or "Application timeout caused pair closure", by where it waited; the
    # collectives' check, that a rank failed to pass its barrier.
    timed_out = re.search(r"timed out|timeout|failed to pass monitoredBarrier", message, re.IGNORECASE) is not None
    if not (mismatched or timed_out or LOST_PEER.search(message)):
        return None
    if not has_default_store():
        # a PyTorch that does not lend the store: who stopped answering cannot be asked
        return None if timed_out or mismatched else lost_peer(rank, message, [], {})
    waits = where_this_rank_waits(err, run_dir, rank)
    stopped = stopped_ranks(rank, MISMATCHED if mismatched else TIMED_OUT if timed_out else LOST, waits)
    where = {other: noted for other, (_, noted) in (stopped or {}).items()}  # each rank that noted where it is
    if mismatched:
        return StalledRankError("--check-collectives stopped the processes at the first collective they do not all "
                                "call alike: every process must call the same collectives in the same order, with "
                                "tensors of the same shapes (docs/failures.md)", where or {rank: waits},
                                how_to_read(run_dir))
    if stopped is None:
        if not timed_out:
            return lost_peer(rank, message, None, {rank: waits}, how_to_read(run_dir))
        store = "the job's key-value store" + (f" at {meeting_point()}" if meeting_point() else "")
        return CutOffError(f"rank {rank} waited longer than --dist-timeout for the other processes, and "
                           f"{store} does not answer either: the network to its machine is down, or the process "
                           "that keeps it (rank 0, or torchrun's agent on the first machine) is stuck or gone",
                           {rank: waits}, how_to_read(run_dir))
    silent = [other for other in range(dist.get_world_size()) if other not in stopped]
    if not timed_out and not any(how == TIMED_OUT for how, _ in stopped.values()):
        return lost_peer(rank, message, silent, where, how_to_read(run_dir))  # none left waited too long: one died
    if silent:
        headline = (f"rank {rank} waited longer than --dist-timeout for the other processes; "
                    f"{ranks_named(silent)} stopped answering")
    else:
        headline = ("the processes waited longer than --dist-timeout in collectives that do not match: every "
                    "process must call the same collectives in the same order (docs/failures.md)")
    return StalledRankError(headline, where, how_to_read(run_dir))


def lost_peer(rank: int, message: str, silent: list[int] | None, where: dict[int, str],
              record: str = "") -> LostPeerError:
    address = PEER_ADDRESS.search(message)
    who = (ranks_named(silent) if silent else
           "the process that kept the job's key-value store" if silent is None else "another process")
    at = f" (at {address.group(1)})" if address else ""
    return LostPeerError(f"rank {rank} lost its connection to {who}{at}: that process ended without a word: killed "
                         "by a signal (the out-of-memory killer sends SIGKILL), gone with its machine, or aborted by "
                         "gloo on a collective that does not match its own; "
                         "the launcher's report says how it ended", where, record)


def ranks_named(ranks: list[int]) -> str:
    return f"rank(s) {', '.join(map(str, ranks))}"


def stopped_ranks(rank: int, how: str, waits: str, settle_s: float = 2.0) -> dict[int, tuple[str, str]] | None:
    """The ranks whose collective failed too, each with how it failed and where it waits: every rank still
    alive meets the failure at about the same moment (gloo closes its connections when one rank gives up),
    notes itself in the process group's key-value store, and waits a moment for the others; those never noted
    are silent (hung in a data loader, deadlocked, stopped, or dead). None if the store cannot be asked (its
    host is gone too). With NCCL, PyTorch's own watchdog may end the processes first, naming the collective."""

    def noted(store: dist.Store) -> dict[int, tuple[str, str]]:
        store.set(f"collective_failed/{rank}", f"{how}\t{waits}")
        time.sleep(settle_s)
        found = {}
        for other in range(dist.get_world_size()):
            if store.check([f"collective_failed/{other}"]):
                noted_how, _, noted_waits = store.get(f"collective_failed/{other}").decode().partition("\t")
                found[other] = (noted_how, noted_waits)
        return found

    return store_answer(noted, gone=None, longest_s=STORE_TIMEOUT_S + settle_s)
