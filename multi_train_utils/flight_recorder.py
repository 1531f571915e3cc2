"""Where each rank waits when a collective never completes: PyTorch's own flight recorder.

The recorder keeps, in a small ring buffer of each process, every collective the process called: its kind, its
sequence number in the process group, and the Python stack that called it. It is switched on before the processes
meet (launch.record_collectives) and read only after a collective has failed: the record is then written into the
run folder (one file per rank, which `torchfrtrace` reads) and its last entry becomes the sentence a learner reads,
e.g. "waits in all_reduce #57, called from evaluate (multi_train_utils/train_eval_utils.py:190)".

With --check-collectives, PyTorch also checks at each collective that every rank calls the same one, and stops
every rank at the first that differs: the sentence then comes from that check ("is at barrier #80, called from ...").
"""

from __future__ import annotations

import os
import pickle
import re
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .versions import flight_recorder_dump, flight_recorder_size_variable

FOLDER = "flight-recorder"
FILE_PREFIX = "rank_"  # one file per rank, <prefix><rank>: the layout torchfrtrace reads
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The helpers that only hand a collective to PyTorch: the line that matters is the one that called them.
HELPERS = (os.path.join(REPO_DIR, "multi_train_utils", "distributed_utils.py"),)
# How PyTorch's check of every collective names each rank's call where they differ (the first names the rank's own).
FINGERPRINT = re.compile(r"Rank (\d+) is running collective: "
                         r"CollectiveFingerPrint\(SequenceNumber=(\d+),? ?OpType=(\w+)")


def recorded() -> dict[str, Any] | None:
    """This process's record, as PyTorch dumps it; None where this release has no recorder."""
    dump = flight_recorder_dump()
    return pickle.loads(dump) if dump is not None else None


def where_this_rank_waits(err: BaseException, run_dir: Path | None, rank: int) -> str:
    """Write this rank's record into `run_dir`'s flight-recorder folder (when there is one) and say where the
    rank waits (after `err`, its collective's failure): the collective it called last, its sequence number and the
    line that called it; or why that cannot be said."""
    checked = checked_call(err, rank)
    size = flight_recorder_size_variable()
    if checked is None and os.environ.get(size, "").strip() == "0":  # a user's choice: record_collectives keeps it
        return f"waits in a collective that nothing recorded: the flight recorder is off here ({size}=0)"
    record = recorded()
    if run_dir is not None and record and record.get("entries"):
        folder = Path(run_dir) / FOLDER
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{FILE_PREFIX}{rank}").write_bytes(pickle.dumps(with_groups_named(record)))
        except OSError:
            pass  # the run folder is gone or full: the sentence below still says where the rank waits
    if checked is not None:
        return checked
    if not record or not record.get("entries"):
        return (f"waits in a collective this PyTorch ({torch.__version__}) does not record for "
                f"{dist.get_backend() if dist.is_initialized() else 'this'} (its flight recorder records gloo's "
                "collectives in newer releases)")
    return waits_in(record["entries"][-1])


def checked_call(err: BaseException, rank: int) -> str | None:
    """Where PyTorch's check of every collective (--check-collectives) stopped this rank, with `err`: at a
    collective that another rank does not call alike; said from the check's message and `err`'s traceback. None
    for any other error."""
    fingerprint = next((found for found in FINGERPRINT.finditer(str(err)) if int(found.group(1)) == rank), None)
    if fingerprint is None:
        return None
    # ALLREDUCE, ALLTOALL: all_reduce, all_to_all, as PyTorch's functions are named
    kind = re.sub(r"^ALL(?!_)", "ALL_", fingerprint.group(3).replace("ALLTOALL", "ALL_TO_ALL")).lower()
    frames = [{"filename": frame.filename, "name": frame.name, "line": frame.lineno}
              for frame in reversed(traceback.extract_tb(err.__traceback__))]  # the innermost first, as recorded
    return f"is at {collective_called(kind, fingerprint.group(2), frames)}"


def with_groups_named(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every process group its entries name in its configuration: gloo's records leave the default
    group's name out there (torch 2.14 files it under ""), and torchfrtrace then fails to read them."""
    groups = record.setdefault("pg_config", {})
    unnamed = groups.get("", {})
    for name, desc in {tuple(entry.get("process_group", ("", ""))) for entry in record["entries"]}:
        groups.setdefault(name, {**unnamed, "name": name, "desc": desc})
    return record


def waits_in(entry: dict[str, Any]) -> str:
    """The sentence for one recorded collective: its kind and number, what in PyTorch ran it, and who called it."""
    kind = entry.get("profiling_name", "a collective").split(":")[-1]
    number = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return f"waits in {collective_called(kind, number, entry.get('frames') or [])}"


def collective_called(kind: str, number: object, frames: list[dict[str, Any]]) -> str:
    """"all_reduce #215 (DDP ...), called from evaluate (file:line)": the collective, what in PyTorch ran it, and
    the line outside PyTorch and the lesson's collective helpers that called it, from `frames` (innermost first)."""
    names = {frame.get("name") for frame in frames if frame.get("filename", "").startswith(TORCH_DIR)}
    through = (" (DDP averaging the gradients, in backward())" if "_engine_run_backward" in names else
               " (DDP's forward)" if "_pre_forward" in names else "")
    caller = next((frame for frame in frames if not frame.get("filename", "").startswith(TORCH_DIR)
                   and frame.get("filename") not in HELPERS), None)
    called = ""
    if caller is not None:
        where = caller["filename"]
        where = where[len(REPO_DIR):] if where.startswith(REPO_DIR) else where
        called = f", called from {caller.get('name')} ({where}:{caller.get('line')})"
    return f"{kind} #{number}{through}{called}"


def how_to_read(run_dir: Path | None) -> str:
    """Where the records are and the command that reads them side by side."""
    if run_dir is None:
        return ""
    folder = Path(run_dir) / FOLDER
    return f"each rank's record of its collectives: {folder}/ (compared by PyTorch's torchfrtrace {folder})"
