"""Ranks that disagree on which collective comes next: the mistakes that people who change a DDP loop make most
(a collective on rank 0 only, a barrier in a save only rank 0 runs, a step one rank takes more). Each is made in a
copy of the repository, as a user would make it, and the job must end soon after --dist-timeout with a line per
rank that names the collective it waits in and the function and line that called it (PyTorch's flight recorder,
multi_train_utils/flight_recorder.py), and each rank's record in the run folder."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_FLAGS, copy_of_the_repository, free_port, make_image_folder, python, run, torchrun
from multi_train_utils import flight_recorder, launch, versions

DIST_TIMEOUT_S = 5
# Each mistake: the file, the line it goes after (its first match; before it, where it returns), the lines added
# (indented as that line), the function they land in, and the collective that rank 0 then waits in. Which
# collective the others wait in is whatever comes next for them (DDP's forward broadcasts the BatchNorm buffers).
MISTAKES = {
    "a metric reduced on rank 0 only": (
        "multi_train_utils/train_eval_utils.py", "    return EvalResult(reduce_sums(sums))",
        ["if is_main_process():  # the mistake: the other ranks never call this all-reduce",
         "    reduce_sums({'loss': sums['loss']})"], "evaluate", "all_reduce"),
    # docs/failures.md's own example, made with its diff
    "a barrier in a save only rank 0 runs": ("multi_train_utils/checkpoint.py", None, [], "write", "barrier"),
    "a step one rank takes more": (
        "multi_train_utils/train_eval_utils.py", "    state.stop_if_diverged(len(data_loader) - 1)",
        ["if torch.distributed.get_rank() == 0:  # the mistake: rank 0 alone trains on one batch more",
         "    criterion(model(images), labels).backward()"], "train_one_epoch", "broadcast"),
}
PAGE = (REPO / "docs" / "failures.md").read_text()
SECTION = PAGE.split("## When the ranks disagree", 1)[1].split("\n## ", 1)[0]


def copy_with_mistake(folder: Path, mistake: str) -> tuple[Path, int]:
    """A copy of the repository with `mistake` made in it, and the number of the mistaken collective's line."""
    copy = copy_of_the_repository(folder)
    file, anchor, added, _, _ = MISTAKES[mistake]
    path = copy / file
    if anchor is None:  # the page's diff, applied as a reader would
        diff = re.search(r"^```diff\n(.*?)^```", SECTION, flags=re.DOTALL | re.MULTILINE).group(1)
        subprocess.run(["git", "apply", "-C1", "-"], input=diff, text=True, cwd=copy, check=True)
        added_line = next(line[1:] for line in diff.splitlines() if line.startswith("+") and "+++" not in line)
        return copy, path.read_text().splitlines().index(added_line) + 1
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.rstrip("\n") == anchor)
    indent = anchor[:len(anchor) - len(anchor.lstrip())]
    if anchor.lstrip().startswith("return"):  # the mistake goes before a return, after anything else
        at -= 1
    lines[at + 1:at + 1] = [f"{indent}{line}\n" for line in added]
    path.write_text("".join(lines))
    return copy, at + 1 + len(added)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("hangs") / "images", {"a": 8, "b": 8})


def job(copy: Path, launcher: str) -> list[str]:
    if launcher == "torchrun":
        return [*torchrun(), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                str(copy / "train_multi_gpu_using_launch.py")]
    return [python(), str(copy / "train_multi_gpu_using_spawn.py"), "--world-size", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", pytest.param("torchrun", marks=pytest.mark.every_launcher)])
@pytest.mark.parametrize("mistake", [
    "a barrier in a save only rank 0 runs",
    pytest.param("a step one rank takes more", marks=pytest.mark.every_launcher)])
def test_ranks_that_disagree_are_named_with_the_line_each_waits_in(data: Path, tmp_path: Path, launcher: str,
                                                                   mistake: str) -> None:
    """Both ranks wait, each in a collective the other never calls, until --dist-timeout: a line for each."""
    out = tmp_path / "run"
    result, called_at = train_with_mistake(tmp_path, mistake, launcher, data, out)
    assert "collectives that do not match" in the_error(result), result.stderr[-3000:]
    waits = where_ranks_wait(result)
    assert set(waits) == {0, 1}, result.stderr[-3000:]
    assert re.fullmatch(rf"waits in {called_at}", waits[0]), waits
    assert "called from" in waits[1] and waits[1] != waits[0], waits
    records_are_read_by_torchfrtrace(result, out, MISTAKES[mistake][-1])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", pytest.param("torchrun", marks=pytest.mark.every_launcher)])
@pytest.mark.parametrize("mistake", [
    "a barrier in a save only rank 0 runs",
    pytest.param("a metric reduced on rank 0 only", marks=pytest.mark.every_launcher)])
def test_checked_collectives_stop_every_rank_at_the_first_that_differs(data: Path, tmp_path: Path, launcher: str,
                                                                       mistake: str) -> None:
    """--check-collectives: the job ends at the first collective the ranks do not call alike, long before its
    --dist-timeout, with the line of each rank's call (a collective of another size, too: no gloo abort)."""
    result, called_at = train_with_mistake(tmp_path, mistake, launcher, data, tmp_path / "run",
                                           "--check-collectives", "--dist-timeout", "900")
    assert "--check-collectives stopped the processes" in the_error(result), result.stderr[-3000:]
    calls = where_ranks_wait(result)
    assert set(calls) == {0, 1}, result.stderr[-3000:]
    assert re.fullmatch(rf"is at {called_at}", calls[0]), calls
    assert re.match(r"is at \w+ #\d+", calls[1]) and "called from" in calls[1] and calls[1] != calls[0], calls
    assert "SIGABRT" not in result.stderr


@pytest.mark.slow
@pytest.mark.every_launcher
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_collective_of_another_size_aborts_its_rank_and_the_others_say_where_they_wait(
        data: Path, tmp_path: Path, launcher: str) -> None:
    """Where the unmatched collectives carry data of different sizes, gloo aborts the process that receives the
    other's (SIGABRT, from its own thread: no record can be written there). Its end is named, and each rank
    left says where it waited."""
    result, _ = train_with_mistake(tmp_path, "a metric reduced on rank 0 only", launcher, data, tmp_path / "run")
    error = the_error(result)
    if launcher == "spawn":  # the script names the aborted process; the survivor is stopped
        assert "was killed by SIGABRT (a C++ abort: gloo's, above, when the ranks call collectives that do not " \
               "match)" in error, result.stderr[-3000:]
    else:  # torchrun names it in its report; the survivor says what it saw, and where it waited
        assert "lost its connection to rank(s)" in error and "aborted by gloo" in error, result.stderr[-3000:]
        assert list(where_ranks_wait(result)) == [1], result.stderr[-3000:]
        assert "SIGABRT" in result.stderr


def train_with_mistake(tmp_path: Path, mistake: str, launcher: str, data: Path, out: Path,
                       *flags: str) -> tuple[subprocess.CompletedProcess, str]:
    """The failed job of a copy with `mistake` made in it, and a pattern of how rank 0's collective is to be named:
    its kind and number, DDP's part where it has one, and the function, file and line of the mistake."""
    copy, line = copy_with_mistake(tmp_path / "repo", mistake)
    file, _, _, function, collective = MISTAKES[mistake]
    called_at = rf"{collective} #\d+( \(DDP.*\))?, called from {function} \({file}:{line}\)"
    return train_in(copy, launcher, data, out, *flags), called_at


def the_error(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def train_in(copy: Path, launcher: str, data: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """Two epochs of a two-process job in `copy`, which fails: soon after --dist-timeout, not at the test's."""
    started = time.monotonic()
    result = run([*job(copy, launcher), "--data-path", str(data), "--output-dir", str(out),
                  *TINY_FLAGS, "--epochs", "2", "--dist-timeout", str(DIST_TIMEOUT_S), *flags], cwd=copy, timeout=240)
    assert result.returncode != 0, result.stderr[-3000:]
    # the start, one epoch, the time-out, and the end, on a loaded machine: within --dist-timeout + 30 s of the hang
    assert time.monotonic() - started < 150, result.stderr[-3000:]
    return result


def where_ranks_wait(result: subprocess.CompletedProcess) -> dict[int, str]:
    """Each rank's line under the error: where it waits (a time-out), or the call it is at (--check-collectives)."""
    return {int(rank): waits for rank, waits in re.findall(r"^  rank (\d) ((?:waits in|is at) .*)$", result.stderr,
                                                           flags=re.MULTILINE)}


def records_are_read_by_torchfrtrace(result: subprocess.CompletedProcess, out: Path, collective: str) -> None:
    folder = out / "flight-recorder"
    assert f"torchfrtrace {folder})" in result.stderr
    assert sorted(path.name for path in folder.iterdir()) == ["rank_0", "rank_1"]
    read = subprocess.run([python(), "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)],
                          capture_output=True, text=True, timeout=120)
    said = read.stdout + read.stderr  # PyTorch's tool finds the same mismatch
    assert read.returncode == 0 and f"collective: gloo:{collective}" in said and "COLLECTIVE_TYPE_MISMATCH" in said, \
        said[-3000:]


def frame(filename: str, name: str, line: int) -> dict[str, object]:
    return {"filename": filename, "name": name, "line": line}


TORCH = flight_recorder.TORCH_DIR
OURS = flight_recorder.REPO_DIR


@pytest.mark.parametrize(("frames", "said"), [
    # our helper that only hands the all-reduce to PyTorch is skipped: its caller is the line that matters
    ([frame(f"{TORCH}distributed/distributed_c10d.py", "all_reduce", 3906),
      frame(f"{OURS}multi_train_utils/distributed_utils.py", "reduce_value", 134),
      frame(f"{OURS}multi_train_utils/train_eval_utils.py", "evaluate", 190)],
     "waits in all_reduce #215, called from evaluate (multi_train_utils/train_eval_utils.py:190)"),
    # DDP's all-reduce runs inside backward(): the line that called backward() is named, and DDP's part
    ([frame(f"{TORCH}autograd/graph.py", "_engine_run_backward", 1072),
      frame(f"{TORCH}_tensor.py", "backward", 623), frame("/home/me/my_loop.py", "step", 7)],
     "waits in all_reduce #215 (DDP averaging the gradients, in backward()), called from step (/home/me/my_loop.py:7)"),
    ([], "waits in all_reduce #215")])
def test_a_recorded_collective_is_said_in_words(frames: list[dict[str, object]], said: str) -> None:
    entry = {"profiling_name": "gloo:all_reduce", "collective_seq_id": 215, "is_p2p": False, "frames": frames}
    assert flight_recorder.waits_in(entry) == said


def test_a_record_names_every_group_its_entries_name_for_torchfrtrace() -> None:
    """gloo's record files the default group under "" (torch 2.14), where torchfrtrace looks for its name."""
    record = {"pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
              "entries": [{"process_group": ("0", "default_pg")}]}
    groups = flight_recorder.with_groups_named(record)["pg_config"]
    assert groups["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}


def test_the_recorder_is_switched_on_before_the_processes_meet_and_a_users_size_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the name this release reads (older ones read the second, which newer ones call deprecated)
    name = versions.flight_recorder_size_variable()
    for any_name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(any_name, raising=False)
    launch.record_collectives("gloo")
    assert os.environ[name] == str(launch.FLIGHT_RECORDER_ENTRIES)
    monkeypatch.setenv(name, "5000")
    launch.record_collectives("gloo")
    assert os.environ[name] == "5000"


def test_a_recorder_switched_off_by_its_user_is_said_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TORCH_FR_BUFFER_SIZE=0 (a user's choice, which launch.record_collectives keeps): the rank's line says that
    nothing was recorded because the recorder is off, not that this PyTorch cannot record, and nothing is written."""
    monkeypatch.setenv(versions.flight_recorder_size_variable(), "0")
    said = flight_recorder.where_this_rank_waits(RuntimeError("timed out"), tmp_path, 0)
    assert said == (f"waits in a collective that nothing recorded: the flight recorder is off here "
                    f"({versions.flight_recorder_size_variable()}=0)")
    assert not (tmp_path / flight_recorder.FOLDER).exists()


CHECKED = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
           "SequenceNumber=12OpType=BARRIER), but Rank 1 is running collective: CollectiveFingerPrint("
           "SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[2], TensorDtypes=Float)")
# Another rank's, as its own message names it first: all-to-all, which PyTorch's OpType spells as one word.
CHECKED_ALL_TO_ALL = ("Detected mismatch between collectives on ranks. Rank 2 is running collective: "
                      "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLTOALL_BASE, TensorShape=[4], "
                      "TensorDtypes=Float), but Rank 0 is running collective: CollectiveFingerPrint("
                      "SequenceNumber=12OpType=BARRIER)")


def save_on_rank_0(message: str) -> None:
    raise RuntimeError(message)  # where PyTorch's check stops a rank (rank 1's message names rank 1 first)


@pytest.mark.parametrize(("message", "rank", "said"), [
    (CHECKED, 0, "is at barrier #12"), (CHECKED, 1, "is at all_reduce #12"), (CHECKED, 2, None),
    (CHECKED_ALL_TO_ALL, 2, "is at all_to_all_base #12")])
def test_a_checked_mismatch_is_said_from_its_message_and_the_ranks_own_traceback(message: str, rank: int,
                                                                                  said: str | None) -> None:
    with pytest.raises(RuntimeError) as caught:
        save_on_rank_0(message)
    line = save_on_rank_0.__code__.co_firstlineno + 1
    called = f"{said}, called from save_on_rank_0 (tests/test_hangs.py:{line})" if said else None
    assert flight_recorder.checked_call(caught.value, rank) == called
