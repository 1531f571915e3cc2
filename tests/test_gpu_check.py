"""bench/gpu_check.py on the CPU: its parts faked (GPU_CHECK_FAKE_PARTS) to hang, die and be cut short, its
budget shrunk, a stop signal sent; and its pieces one by one."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from conftest import REPO, python, run, script_env

FAKE_TESTS = '''
import time

import pytest

def test_passes(): pass
def test_fails(): assert False, "on purpose"
@pytest.mark.skip(reason="not here")
def test_skipped(): pass
def test_hangs(): time.sleep(600)
def test_never_reached(): pass
'''
# Ignores SIGTERM, and leaves a process in a session of its own: what torchrun's workers and the tests' runs do.
HANGING_PART = '''
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(f"{os.getpid()} {stray.pid}")
time.sleep(600)
'''
WRITES_ITS_JSON = ("import json, os, sys; print('a line on stderr', file=sys.stderr); "
                   "open(os.environ['GPU_CHECK_PART_JSON'], 'w').write(json.dumps({'pixels_match': True}))")


def fake(argv: list[str], estimate_s: float = 1, limit_s: float = 20) -> dict:
    return {"argv": argv, "estimate_s": estimate_s, "limit_s": limit_s}


@pytest.fixture
def hanging_part(tmp_path: Path) -> Iterator[list[str]]:
    """The command of a part that hangs; afterwards, whatever of it is left is killed."""
    (tmp_path / "hang.py").write_text(HANGING_PART)
    yield [python(), str(tmp_path / "hang.py"), str(tmp_path / "pids")]
    for pid in pids_of_the_hanging_part(tmp_path):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def fake_parts(tmp_path: Path, hanging_part: list[str], hang_limit_s: float) -> dict:
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    return {
        "decode": fake([python(), "-c", WRITES_ITS_JSON]),
        "demo": fake(hanging_part, limit_s=hang_limit_s),
        "benchmark": fake([python(), "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
        # --rootdir: the test ids are relative to it, wherever the repository and the temporary folder are
        "tests": fake([python(), str(REPO / "bench" / "gpu_check.py"), "--pytest", str(tmp_path / "test_fake.py"),
                       "--rootdir", str(tmp_path), "-p", "no:cacheprovider"], limit_s=100),
        "benchmark_decode_gpu": fake([python(), "-c", "pass"], estimate_s=1000),
        "tests_compile": fake([python(), "-c", "pass"]),
    }


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def pids_of_the_hanging_part(tmp_path: Path) -> list[int]:
    pids = tmp_path / "pids"
    return [int(pid) for pid in pids.read_text().split()] if pids.is_file() else []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    result = run([python(), str(REPO / "bench" / "gpu_check.py"), "--output", str(tmp_path / "gpu.json")], timeout=120)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        "gpu_check: no CUDA GPU is visible here, so there is nothing to check; run it on a GPU machine"]
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
@pytest.mark.benchmarks
def test_a_hung_part_a_killed_part_and_a_cut_pytest_are_reported_within_the_budget(
        tmp_path: Path, hanging_part: list[str]) -> None:
    """The tests part runs last with a limit of its own far above what the 25 s budget leaves: the budget
    ends it, and the tests that finished are still counted. No C compiler on PATH: the compile part says so."""
    (tmp_path / "bin").mkdir()
    env = script_env(GPU_CHECK_FAKE_PARTS=json.dumps(fake_parts(tmp_path, hanging_part, 2)), PATH=str(tmp_path / "bin"))
    env.pop("CC", None)
    output, work = tmp_path / "out" / "gpu_check.json", tmp_path / "work"
    started = time.monotonic()
    result = run([python(), str(REPO / "bench" / "gpu_check.py"), "--budget-s", "25", "--output", str(output),
                  "--work-dir", str(work), "--parts", "decode,demo,benchmark,tests,benchmark_decode_gpu,tests_compile"],
                 env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 25
    report = json.loads(output.read_text())
    assert json.loads(result.stdout.splitlines()[-1]) == report
    assert report["decode"]["status"] == "passed" and report["decode"]["pixels_match"] is True
    assert report["demo"]["status"] == "timed out after 2 s"
    assert len(pids_of_the_hanging_part(tmp_path)) == 2, "the hanging part ran"
    assert not any(alive(pid) for pid in pids_of_the_hanging_part(tmp_path)), "the hung part left a process"
    assert report["benchmark"]["status"] == "failed (killed by SIGKILL)"
    tests = report["tests"]
    assert tests["status"].startswith("timed out") and tests["limit_s"] < 25
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert list(tests["failures"]) == ["test_fake.py::test_fails"] and "on purpose" in tests["failures"][
        "test_fake.py::test_fails"]
    assert tests["unfinished"] == ["test_fake.py::test_hangs"]
    assert tests["not_started"] == ["test_fake.py::test_never_reached"]
    assert report["benchmark_decode_gpu"]["status"].startswith("skipped: ")
    assert report["tests_compile"]["status"].startswith("skipped: no C compiler")
    assert "  tests_compile         skipped: no C compiler" in result.stderr
    assert "  benchmark_decode_gpu      1000 s" in result.stderr, "the plan is printed before the parts run"
    assert list(work.iterdir()) == [], "the invocation's work folder is removed"
    assert (output.parent / "gpu_check_logs" / "tests.log").is_file()


@pytest.mark.slow
@pytest.mark.benchmarks
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_running_part_and_writes_what_finished(tmp_path: Path, hanging_part: list[str],
                                                                      stop: signal.Signals) -> None:
    env = script_env(GPU_CHECK_FAKE_PARTS=json.dumps(fake_parts(tmp_path, hanging_part, 100)))
    output = tmp_path / "gpu_check.json"
    process = subprocess.Popen([python(), str(REPO / "bench" / "gpu_check.py"), "--output", str(output),
                                "--work-dir", str(tmp_path / "work"), "--parts", "decode,demo,tests"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)  # the pids are in the file
        os.kill(process.pid, stop)
        signalled = time.monotonic()
        stdout, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + stop
    assert time.monotonic() - signalled < gpu_check.STOP_GRACE_S + 10
    report = json.loads(output.read_text())
    assert json.loads(stdout.splitlines()[-1]) == report and report["stopped_by"] == stop.name
    assert report["decode"]["status"] == "passed"
    assert report["demo"]["status"] == f"stopped by {stop.name}"
    assert report["tests"]["status"] == f"not run: stopped by {stop.name}"
    assert len(pids_of_the_hanging_part(tmp_path)) == 2, "the hanging part ran"
    assert not any(alive(pid) for pid in pids_of_the_hanging_part(tmp_path)), "the stopped part left a process"


def test_the_tests_results_count_what_finished_before_the_run_was_killed(tmp_path: Path) -> None:
    events = tmp_path / "tests.jsonl"
    lines = [{"collected": ["a", "b", "c", "d", "e"]},
             {"started": "a"}, {"test": "a", "outcome": "passed", "why": ""}, {"finished": "a"},
             {"started": "b"}, {"test": "b", "outcome": "passed", "why": ""},
             {"test": "b", "outcome": "failed", "why": "teardown broke"}, {"finished": "b"},
             {"started": "c"}, {"test": "c", "outcome": "skipped", "why": "needs 2 CUDA GPUs"}, {"finished": "c"},
             {"started": "d"}]
    events.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"test": "d", "outc')
    assert gpu_check.summarize_tests(events) == {
        "passed": 1, "failed": 1, "skipped": 1, "failures": {"b": "teardown broke"},
        "skips": {"c": "needs 2 CUDA GPUs"}, "unfinished": ["d"], "not_started": ["e"]}
    assert gpu_check.summarize_tests(tmp_path / "never_written.jsonl")["passed"] == 0


def test_the_tests_part_leaves_out_the_benchmark_test_and_the_compile_tests_go_last() -> None:
    """Every test that runs --compile has "compile" in its name (the parts select by -k), and no other has."""
    tree = ast.parse((REPO / "tests" / "test_gpu.py").read_text())
    tests = {node.name: ast.unparse(node) for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    compiling = {name for name, source in tests.items() if "'--compile'" in source}
    assert compiling and compiling == {name for name in tests if "compile" in name}
    assert gpu_check.BENCHMARK_TEST.split("::")[1] in tests
    assert [part.name for part in gpu_check.PARTS][-1] == "tests_compile"


def test_compiling_needs_a_c_compiler_and_the_python_headers() -> None:
    none = {"cc": None, "gcc": None, "clang": None, "CC": None}
    assert gpu_check.compile_blocker({"compilers": none, "python_h": "/x/Python.h"}).startswith(
        "skipped: no C compiler")
    assert gpu_check.compile_blocker({"compilers": none | {"gcc": "/usr/bin/gcc"}, "python_h": None}).startswith(
        "skipped: no Python.h")
    assert gpu_check.compile_blocker({"compilers": none | {"CC": "clang-19"}, "python_h": "/x/Python.h"}) is None


def test_the_loader_is_sized_to_what_dev_shm_holds() -> None:
    image = 3 * 224 * 224  # two batches of 256 such images per worker: 77 MB
    assert gpu_check.fit_loader({"free_mib": 8192}, 15, 256, image, 1) == (15, None)
    workers, note = gpu_check.fit_loader({"free_mib": 512}, 15, 256, image, 1)
    assert workers == 3
    assert note == "/dev/shm has 512 MiB free: 3 loader workers instead of 15 (2 batches of 256 x 147 KiB each)"
    workers, note = gpu_check.fit_loader({"free_mib": 64}, 15, 256, image, 1)
    assert workers == 0 and note.startswith("/dev/shm has 64 MiB free: not enough for one loader worker")
    assert gpu_check.fit_loader({"free_mib": 512}, 15, 256, image, 2)[0] == 1, "two processes share it"


def test_pixels_off_by_rounding_match_and_anything_more_does_not() -> None:
    generator = torch.Generator().manual_seed(0)
    reference = [torch.randint(10, 240, (3, 30, 40), dtype=torch.uint8, generator=generator) for _ in range(3)]
    rounded = [image + torch.randint(-1, 2, image.shape, generator=generator).to(torch.uint8) for image in reference]
    assert gpu_check.compare_pixels(rounded, reference)["pixels_match"]
    unwritten = [image.clone() for image in rounded]
    unwritten[1][:, :3] = 0  # a tenth of the image never written
    wrong_size = [*rounded[:2], rounded[2][:, :20]]
    assert gpu_check.compare_pixels(unwritten, reference)["mismatched_images"] == [1]
    assert gpu_check.compare_pixels(wrong_size, reference)["mismatched_images"] == [2]


def test_the_decode_check_runs_through_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only its plumbing: the CPU decodes both sides and nothing runs out of order. The GPU run is the check."""
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(gpu_check, "OVERWRITE_ROUNDS", 2)
    result = gpu_check.decode_check(torch.device("cpu"))
    assert result["pixels_match"] and result["images"] >= 60 and result["worst_mean_levels"] == 0
    assert result["overwritten_reads"] == {"decode_jpeg": 0, "decode_batch": 0, "rounds": 2}


def test_the_benchmark_parts_fit_their_loaders_into_a_64_mb_dev_shm(tmp_path: Path) -> None:
    """Their commands are the benchmark's own flags; the workers' pixels do not fit, the GPU's JPEG files do."""
    from bench.benchmark import ensure_photo_folder, get_args_parser

    machine = {"visible_gpus": 1, "cpus": 16, "shm": {"total_mib": 64, "free_mib": 64}}
    check = gpu_check.Check(tmp_path / "work", tmp_path / "logs", 256, time.monotonic() + 100, machine)
    on_cpu = get_args_parser().parse_args(gpu_check.benchmark_launch(check, "cpu").argv[2:])
    assert (on_cpu.sources, on_cpu.workers, on_cpu.device) == ("synthetic", 0, "cuda")
    on_gpu = get_args_parser().parse_args(gpu_check.benchmark_launch(check, "gpu").argv[2:])
    assert (on_gpu.sources, on_gpu.decode_on) == ("folder", "gpu") and 0 < on_gpu.workers < 15
    photos = len(list(ensure_photo_folder().glob("*/*.jpg")))
    assert len(list(Path(on_gpu.data_path).glob("*/*.jpg"))) == photos * gpu_check.PHOTO_COPIES


def test_the_logs_folder_is_emptied_only_if_gpu_check_made_it(tmp_path: Path) -> None:
    logs = gpu_check.fresh_log_dir(str(tmp_path / "gpu.json"), tmp_path / "work")
    assert logs == tmp_path / "gpu_logs"
    (logs / "demo.log").write_text("an earlier check's")
    assert list(gpu_check.fresh_log_dir(str(tmp_path / "gpu.json"), tmp_path / "work").iterdir()) == [
        logs / ".gpu_check"]
    (tmp_path / "mine_logs").mkdir()
    (tmp_path / "mine_logs" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match=r"^error: .*mine_logs: not empty and not made by gpu_check"):
        gpu_check.fresh_log_dir(str(tmp_path / "mine.json"), tmp_path / "work")
    assert (tmp_path / "mine_logs" / "notes.txt").read_text() == "keep"
