"""When things go wrong: a diverging loss on one rank, and input the user can fix, on every launcher."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import train_single_gpu
from conftest import (
    REPO,
    TINY_FLAGS,
    free_port,
    make_image_folder,
    python,
    run,
    run_single_in_this_process,
    script_env,
    signal_once_ready,
    torchrun,
)
from multi_train_utils.cli import parse_args, run_cli
from multi_train_utils.errors import UserInputError
from multi_train_utils.recorder import claim_folder

SCRIPTS = {"single": [python(), str(REPO / "train_single_gpu.py")],
           "torchrun": [*torchrun(), "--standalone", "--nproc_per_node=2",
                        str(REPO / "train_multi_gpu_using_launch.py")],
           "spawn": [python(), str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("failures") / "images", {"a": 10, "b": 10, "c": 10})


def one_line_error(result: object, expected_start: str) -> None:
    """The error is one line, once however many processes met it, without a traceback through our code.

    torchrun itself still reports a failed worker with its own ChildFailedError traceback, which names
    the worker's exit code; that part is torchrun's and the same for every script.
    """
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert expected_start in errors[0], result.stderr[-3000:]
    assert "Connection closed" not in result.stderr, "the other ranks stop quietly"
    our_frames = [line for line in result.stderr.splitlines()
                  if line.startswith('  File "') and str(REPO) in line and "site-packages" not in line]
    assert our_frames == [], result.stderr[-3000:]
    if "ChildFailedError" not in result.stderr:
        assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_and_keeps_the_last_checkpoint(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = script_env(NAN_RANK="1", NAN_EPOCH="1", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    result = run([*SCRIPTS["torchrun"], "--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                  "--epochs", "3"], env=env, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "became NaN or infinite" in line]
    assert len(lines) == 1, f"both ranks stop at the same step; the first to stop says why: {lines}"
    assert lines[0].startswith("error: epoch 1, step 2: the training loss became NaN"), lines
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 0
    assert all(torch.isfinite(t).all() for t in saved["model"].values() if t.is_floating_point())
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["single", pytest.param("torchrun", marks=pytest.mark.every_launcher),
                                      pytest.param("spawn", marks=pytest.mark.every_launcher)])
def test_a_missing_data_folder_is_one_line_on_every_launcher(tmp_path: Path, launcher: str) -> None:
    result = run([*SCRIPTS[launcher], "--data-path", str(tmp_path / "nowhere"), "--output-dir",
                  str(tmp_path / "run"), *TINY_FLAGS], timeout=120)
    assert result.returncode != 0
    one_line_error(result, f"--data-path {tmp_path / 'nowhere'}: no such folder")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("launcher", "workers"), [
    ("single", "1"), pytest.param("spawn", "1", marks=pytest.mark.every_launcher),
    pytest.param("single", "0", marks=pytest.mark.every_launcher),
    pytest.param("torchrun", "0", marks=pytest.mark.every_launcher)])
def test_a_corrupt_image_is_named_in_one_line(tmp_path: Path, launcher: str, workers: str) -> None:
    """With several processes, one of them reads the file: it says so, and the others, whose next
    collective then fails, stop without a word."""
    broken = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    photo = broken / "b" / "b_004.jpg"
    data = photo.read_bytes()
    scan = data.index(b"\xff\xda")  # the compressed pixels start here: cut in their middle, the header stays whole
    photo.write_bytes(data[:scan + (len(data) - scan) // 2])  # only decoding finds the damage
    result = run([*SCRIPTS[launcher], "--data-path", str(broken), "--output-dir", str(tmp_path / "run"),
                  *TINY_FLAGS, "--workers", workers, "--epochs", "2"], timeout=120)
    assert result.returncode == (1 if launcher == "torchrun" else 2)  # torchrun exits 1 for any failed worker
    one_line_error(result, f"cannot read image {broken / 'b' / 'b_004.jpg'}")


@pytest.mark.parametrize(("content", "message"), [(b"<html>404</html>", "not a PyTorch file"),
                                                  ("tensors", "none of its 1 tensors fit resnet18")])
def test_a_weights_file_that_is_not_weights_or_does_not_fit(data: Path, tmp_path: Path, content: object,
                                                            message: str) -> None:
    weights = tmp_path / "weights.pth"
    if content == "tensors":
        torch.save({"unrelated.layer": torch.zeros(3)}, weights)
    else:
        weights.write_bytes(content)
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(tmp_path / "run"), *TINY_FLAGS,
                  "--weights", str(weights)])
    assert result.returncode == 2
    one_line_error(result, f"--weights {weights}: {message}")


def test_an_output_folder_that_cannot_be_written(data: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the output folder should go")
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(blocker / "run"), *TINY_FLAGS])
    assert result.returncode == 2
    one_line_error(result, f"--output-dir {blocker / 'run'}: cannot write there")
    assert blocker.read_text() == "a file where the output folder should go"


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_named_and_the_job_ends(data: Path, tmp_path: Path) -> None:
    """Rank 0 names the silent rank through the process group's store, in code that is the same under every
    launcher (how the spawn script ends after a failed process, test_launchers.py tests)."""
    env = script_env(HANG_RANK="1", HANG_EPOCH="1", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    started = time.monotonic()
    result = run([*SCRIPTS["torchrun"], "--data-path", str(data), "--output-dir", str(tmp_path / "run"), *TINY_FLAGS,
                  "--epochs", "3", "--dist-timeout", "5"], env=env, timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - started < 90, "the job must end soon after the time-out, not hang"
    one_line_error(result, "rank 0 waited longer than --dist-timeout for the other processes; rank(s) 1 stopped "
                           "answering")


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "said"), [
    pytest.param("torchrun", "rank 0 lost its connection to rank(s) 1 (at 127.0.0.1): that process ended without a "
                             "word", marks=pytest.mark.every_launcher),
    ("spawn", "rank 1 was killed by SIGKILL (the out-of-memory killer sends it); the others were stopped")])
def test_a_rank_killed_outright_is_one_line_naming_it(data: Path, tmp_path: Path, launcher: str, said: str) -> None:
    """SIGKILL, as the out-of-memory killer sends it: no clean-up, no word from the dead rank. One line names
    it (under torchrun the survivor's, beside torchrun's own report; under spawn the script's), no traceback
    of ours, and nothing after it: no semaphore of the dead process's progress bar left behind."""
    env = script_env(KILL_RANK="1", KILL_EPOCH="0", PYTHONPATH=f"{REPO / 'tests' / 'fault_injection'}:{REPO}")
    result = run([*SCRIPTS[launcher], "--data-path", str(data), "--output-dir", str(tmp_path / "run"), *TINY_FLAGS,
                  "--epochs", "2", "--workers", "1"], env=env, timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines()
            if line.startswith('  File "') and str(REPO) in line and "site-packages" not in line]
    assert ours == [], output[-3000:]
    one_line_error(result, said)
    assert "leaked" not in output and "Connection reset" not in output, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "said"), [
    ("0", "only 1 of the 2 processes joined within --dist-timeout 3 s (WORLD_SIZE=2): start every rank"),
    ("1", "rank 1 could not reach rank 0's MASTER_ADDR:MASTER_PORT 127.0.0.1:")])
def test_a_group_that_never_forms_is_one_line_from_the_process_that_waited(data: Path, tmp_path: Path, rank: str,
                                                                         said: str) -> None:
    """RANK and WORLD_SIZE=2 set by hand, one process started: it says how many came, or whom it missed."""
    env = script_env(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run([python(), str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data), "--output-dir",
                  str(tmp_path / "run"), *TINY_FLAGS, "--dist-timeout", "3"], env=env, timeout=120)
    assert result.returncode == 2
    one_line_error(result, said)
    assert "Traceback" not in result.stderr


def test_another_program_on_the_meeting_port_is_one_line(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A web server, say, where rank 0's store should be: PyTorch's "Ping failed" traceback, otherwise."""
    import train_multi_gpu_using_launch

    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = []

        def answer_as_a_web_server() -> None:  # and keep the line open, as a server does
            with contextlib.suppress(OSError):
                while True:
                    clients.append(server.accept()[0])
                    clients[-1].sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer_as_a_web_server, daemon=True).start()
        port = server.getsockname()[1]
        for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stop:
            run_cli(train_multi_gpu_using_launch.main, "launch", ["--data-path", str(data), "--output-dir",
                                                                  str(tmp_path / "run"), *TINY_FLAGS,
                                                                  "--dist-timeout", "3"])
        for client in clients:
            client.close()
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"error: rank 1: another program, not rank 0's store, answers at MASTER_ADDR:MASTER_PORT "
                    f"127.0.0.1:{port}; choose a port that nothing else listens on"), line


@pytest.mark.parametrize(("variables", "flags", "said"), [
    ({"RANK": "1"}, [], "error: RANK=1 is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, [], "error: MASTER_ADDR is not set"),
    # a rank past the world would wait for the others until --dist-timeout; a world of none fails in PyTorch
    ({"RANK": "3", "WORLD_SIZE": "2"}, [], "error: RANK=3 with WORLD_SIZE=2: the ranks of a job run from 0 to"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, [], "error: RANK=0 with WORLD_SIZE=0: the ranks of a job run from 0 to"),
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "2"}, [], "error: SLURM_PROCID=2 with SLURM_STEP_NUM_TASKS=2"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, [],
     "error: MASTER_PORT=99999: a port is a number from 1 to 65535"),
    # a name no machine resolves: PyTorch would retry it until --dist-timeout, with pages of C++ log
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "nohost.invalid", "MASTER_PORT": "1234"}, [],
     "error: MASTER_ADDR nohost.invalid: this machine cannot find the host nohost.invalid"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--dist-url", "tcp://nohost.invalid:1234"],
     "error: --dist-url tcp://nohost.invalid:1234: this machine cannot find the host nohost.invalid")])
def test_a_launchers_variables_by_hand_that_cannot_work_are_refused(data: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    variables: dict[str, str], flags: list[str],
                                                                    said: str) -> None:
    import train_multi_gpu_using_launch

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        run_cli(train_multi_gpu_using_launch.main, "launch", ["--data-path", str(data), "--output-dir",
                                                              str(tmp_path / "run"), *TINY_FLAGS, *flags])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(said), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ctrl_c_while_the_processes_meet_ends_at_once_in_one_line(data: Path, tmp_path: Path) -> None:
    """A wait for the other processes inside C++ does not return to Python until --dist-timeout; Ctrl-C then
    ends it at once."""
    port = free_port()
    env = script_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code, output = signal_once_ready(
        [python(), str(REPO / "train_multi_gpu_using_launch.py"), "--data-path", str(data), "--output-dir",
         str(tmp_path / "run"), *TINY_FLAGS, "--dist-timeout", "300"], env, tmp_path / "log",
        lambda job: listening(port), signal.SIGINT, settle_s=0.5)
    assert code == 130, output
    assert output.strip().splitlines()[-1] == "Stopped by Ctrl-C while the processes were meeting; nothing was trained"
    assert "frame #" not in output and "Traceback" not in output, output


def listening(port: int) -> bool:
    """Whether some process listens on `port`, IPv4 or IPv6 (read from the kernel's tables: no connection made)."""
    rows = [row for table in ("tcp", "tcp6") for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]]
    return any(row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A" for row in rows)


def test_a_second_run_into_a_folder_in_use_stops_in_one_line_and_writes_nothing(data: Path, tmp_path: Path) -> None:
    """Two runs into one --output-dir would each write the other's files (and two records on one line of
    metrics.jsonl). The first holds a lock for its life, which the system frees when it ends."""
    out = tmp_path / "run"
    held = claim_folder(out)  # as the first run holds it
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS])
    assert result.returncode == 2
    one_line_error(result, f"--output-dir {out}: another run is writing there (process {os.getpid()} on")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    (out / "checkpoint.pth").write_bytes(b"a checkpoint the first run is about to replace")
    resumed = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                          "--resume", "auto"])
    assert resumed.returncode == 2 and "Resuming" not in resumed.stdout, "refused before it reads the checkpoint"
    one_line_error(resumed, f"--output-dir {out}: another run is writing there")
    (out / "checkpoint.pth").unlink()
    held.close()  # the first run ends
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS])
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_damaged_image_is_named_before_the_first_epoch(tmp_path: Path) -> None:
    """A damaged validation image used to be found after a whole epoch of training; now the headers of all
    files are read first, and all bad files are named at once."""
    folder = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    (folder / "a" / "a_001.jpg").write_bytes(b"")
    (folder / "b" / "b_002.jpg").write_text("<html>not found</html>")
    (folder / "b" / "b_004.jpg").write_bytes(b"\xff\xd8\xff\xe0 this JPEG stops here")
    args = parse_args("single", ["--data-path", str(folder), "--output-dir", str(tmp_path / "run"), *TINY_FLAGS])
    with pytest.raises(UserInputError) as found:
        train_single_gpu.main(args)
    message = str(found.value)
    assert message.startswith(f"3 image file(s) in {folder} cannot be read: ")
    assert message.endswith("; delete or replace them") and len(message) <= 300 - len("error: ")
    for name in ("a/a_001.jpg (empty)", "b/b_002.jpg (not an image", "b/b_004.jpg (not an image"):
        assert name in message, message
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "stopped before any training"


def test_names_the_system_refuses_are_one_line(data: Path, tmp_path: Path) -> None:
    """A link that loops, among the images; a name longer than the file system takes, for the output folder
    and for the data: each one short line naming the flag or the file, and why."""
    folder = make_image_folder(tmp_path / "images", {"a": 10, "b": 10})
    (folder / "a" / "loop.jpg").symlink_to("loop.jpg")
    (folder / "b" / "loop_dir").symlink_to("loop_dir")
    result = run_single_in_this_process(["--data-path", str(folder), "--output-dir", str(tmp_path / "run"),
                                         *TINY_FLAGS])
    assert result.returncode == 2
    one_line_error(result, "a/loop.jpg (too many levels of symbolic links)")
    long_name = "n" * 300
    for flag, path in (("--output-dir", tmp_path / long_name / "run"), ("--data-path", tmp_path / long_name)):
        flags = {"--data-path": str(data), "--output-dir": str(tmp_path / "run2"), flag: str(path)}
        result = run_single_in_this_process([*(word for pair in flags.items() for word in pair), *TINY_FLAGS])
        assert result.returncode == 2, result.stderr[-2000:]
        one_line_error(result, f"{flag} {tmp_path}")
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert "file name too long" in line and len(line) <= 300, line


def test_forty_damaged_images_are_one_line_of_at_most_300_characters(tmp_path: Path) -> None:
    folder = make_image_folder(tmp_path / "images", {"a": 30, "b": 30})
    for index in range(40):
        (folder / "ab"[index % 2] / f"{'ab'[index % 2]}_{index // 2:03d}.jpg").write_bytes(b"\xff\xd8\xff damaged")
    result = run_single_in_this_process(["--data-path", str(folder), "--output-dir", str(tmp_path / "run"),
                                         *TINY_FLAGS])
    assert result.returncode == 2
    one_line_error(result, "40 image file(s) in")
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(line) <= 300 and line.count(str(folder)) == 1, line


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 30 MB file system of its own (tmpfs), which training fills: a full disk, for real."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_in_one_line_and_keeps_the_last_checkpoint(data: Path,
                                                                               small_disk: Path) -> None:
    out = small_disk / "run"
    result = run([*SCRIPTS["spawn"], "--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                  "--model", "mobilenet_v3_small", "--epochs", "6"], timeout=120)
    assert result.returncode == 2
    one_line_error(result, "the disk is full")
    assert re.search(r"the disk is full.*\(the file needs about \d+\.\d MB, \d+\.\d MB free\)", result.stderr)
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert "the run writes about" in warning, "a disk too small for what the run writes is said at the start"
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] >= 0, "the last checkpoint is whole"
    assert not list(out.rglob("*.partial")), "no temporary file keeps the disk full"
    assert (out / "weights" / "model-0.pth").stat().st_mode & 0o644 == 0o644, "saved files are not private"


def test_a_run_whose_checkpoint_is_missing_is_not_overwritten(data: Path, tmp_path: Path) -> None:
    """A finished run without checkpoint.pth (--save-every and a crash, or deleted by hand) still holds results:
    a new run into its folder stops in one line that says what is there, and every file stays."""
    out = tmp_path / "run"
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                                "--epochs", "2"]))
    (out / "checkpoint.pth").unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    for resume in ([], ["--resume", "auto"]):
        result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS, *resume])
        assert result.returncode == 2
        one_line_error(result, f"--output-dir {out}: holds the results of a run (metrics.jsonl, weights/best.pth, "
                               "weights/model-0.pth, weights/model-1.pth) but no checkpoint.pth to continue from; "
                               "choose another --output-dir, or move those files away")
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == before


@pytest.mark.parametrize(("in_the_way", "kind"), [("checkpoints", "file"), ("tensorboard", "file"),
                                                  ("weights", "file"), ("metrics.jsonl", "folder"),
                                                  ("weights/best.pth", "folder")])
def test_whatever_is_in_the_way_of_a_file_the_run_writes_is_found_before_the_first_step(
        data: Path, tmp_path: Path, in_the_way: str, kind: str) -> None:
    out = tmp_path / "run"
    (out / in_the_way).parent.mkdir(parents=True, exist_ok=True)
    (out / in_the_way).mkdir() if kind == "folder" else (out / in_the_way).write_text("in the way")
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                  "--keep-checkpoints", "2"])
    assert result.returncode == 2
    want = "a file, where the run writes a folder" if kind == "file" else "a folder, where the run writes a file"
    one_line_error(result, f"--output-dir {out}: {out / in_the_way} is {want}")
    assert "[epoch 0] train" not in result.stdout, "no step was trained"


def test_what_a_killed_write_left_is_deleted_by_the_next_run(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "weights").mkdir(parents=True)
    left = [out / ".checkpoint.pth.a1b2c3.partial", out / "weights" / ".best.pth.d4e5f6.partial"]
    for partial in left:
        partial.write_bytes(b"half a checkpoint" * 1000)
    train_single_gpu.main(parse_args("single", ["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS]))
    assert not any(partial.exists() for partial in left)
    assert not list(out.rglob("*.partial"))


def test_more_accumulated_batches_than_an_epoch_has_are_refused(data: Path, tmp_path: Path) -> None:
    """24 training images in batches of 4: 6 batches an epoch; a step of 1024 of them would never come, and the
    lr would be multiplied by 1024 all the same."""
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(tmp_path / "run"), *TINY_FLAGS,
                  "--accum-steps", "1024"])
    assert result.returncode == 2
    one_line_error(result, "--accum-steps 1024: more than the 6 batches each process trains on in an epoch; "
                           "at most 6")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_out_of_memory_on_the_cpu_is_one_line_naming_what_to_lower(data: Path, tmp_path: Path) -> None:
    limit = 4500 * 2**20  # the address space a process may map: torch's libraries fit, a 1024-pixel batch does not
    proc = subprocess.run([*SCRIPTS["single"], "--data-path", str(data), "--output-dir", str(tmp_path / "run"),
                           *TINY_FLAGS, "--image-size", "1024", "--batch-size", "12"], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 2
    one_line_error(proc, "error: out of memory on the CPU with --batch-size 12 and --image-size 1024: lower one of "
                         "them (half the --batch-size with --accum-steps 2 trains on the same batch per step)")


def test_out_of_memory_on_a_gpu_is_one_line_and_keeps_the_last_checkpoint(data: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from multi_train_utils import train_eval_utils

    def the_gpu_fills_in_the_second_epoch(*args: object, **kwargs: object) -> float:
        if args[5] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return train_one_epoch(*args, **kwargs)

    train_one_epoch = train_eval_utils.train_one_epoch
    monkeypatch.setattr(train_eval_utils, "train_one_epoch", the_gpu_fills_in_the_second_epoch)
    out = tmp_path / "run"
    result = run_single_in_this_process(["--data-path", str(data), "--output-dir", str(out), *TINY_FLAGS,
                                         "--epochs", "2", "--accum-steps", "2"])
    assert result.returncode == 2
    one_line_error(result, f"error: out of memory on the GPU with --batch-size 4 and --image-size 16: lower one of "
                           f"them (half the --batch-size with --accum-steps 4 trains on the same batch per step); the "
                           f"last checkpoint, {out / 'checkpoint.pth'}, is kept")
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 0
