"""One command that checks this project on a GPU machine, within a time budget, and writes what it found as JSON.

    python bench/gpu_check.py --output results/gpu_check.json

It first records the machine (GPU, driver, memory, CPUs, /dev/shm, C compilers, Python.h, the versions of
Python, torch, torchvision and triton), prints each part's estimate and limit (PARTS, below), then runs the
parts in order of value, each in processes of its own:

  decode         torchvision's batched CUDA decode_jpeg against the CPU decode of the same files, pixel by
                 pixel, and whether the decoder overwrites memory that GPU work queued before it still reads
  tests          the tests marked `gpu` but the compiling ones and the benchmark's (the benchmark part measures
                 the same): each test's result as it finishes, so that a part cut short still reports them
  demo           the demo run under torchrun on NCCL, from scratch, against the CPU run's accuracy
  benchmark      ResNet-34 at 224 px, bf16, channels-last, on synthetic tensors and on an image folder, the
                 loader's workers sized to what /dev/shm holds
  benchmark_decode_gpu  the image folder again, its JPEGs decoded on the GPU (--decode-on gpu)
  tests_compile  the torch.compile tests; skipped, saying why, without a C compiler or Python.h

A part starts only if what is left of --budget-s covers its estimate; the whole command ends within the
budget. The JSON (--output) is rewritten after every part, and on SIGTERM, SIGINT or SIGHUP the running part
is stopped (all its processes, those in sessions of their own too) and the JSON of what finished is written
before the exit (status 128 + the signal's number). Each invocation works in a fresh folder, removed at the
end; the parts' logs and result files go to a folder beside the JSON (NAME_logs).
Without a GPU it prints one line saying so and exits 0.

For the tests only: GPU_CHECK_FAKE_PARTS='{"PART": {"argv": [...], "estimate_s": S, "limit_s": L}}' runs
those commands in place of the named parts, on any machine (tests/test_gpu_check.py fakes a hung part, a
killed part and a killed pytest with it). A part's command writes its results to the file named by
GPU_CHECK_PART_JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata, util
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/gpu_check.py` from anywhere; the imports below need it

import torch

from multi_train_utils.versions import require_supported_pytorch

require_supported_pytorch()  # on an older PyTorch: one line, before any part starts and fails on it

# The demo run on this repository's 2-core CPU (README, "One process or two"): 0.967, and 0.925-0.967 over
# its last six epochs, so a GPU run within that spread has learnt the same.
CPU_DEMO_ACCURACY = 0.967
DEMO_TOLERANCE = 0.05
PHOTO_COPIES = 10  # the benchmark's 600 photos, 10 times over: enough for several batches of 256 an epoch
DEFAULT_BUDGET_S = 520.0  # with the GPU machine's start-up, one 10-minute command
STOP_GRACE_S = 3.0  # a stopped part's processes get this long after SIGTERM before SIGKILL
STOP_RESERVE_S = 10.0  # kept back from each part's limit: stopping it, reading its results, writing the JSON
PER_TEST_TIMEOUT_S = 150  # one hung test must not take the whole tests part
BENCHMARK_TEST = "tests/test_gpu.py::test_the_benchmark_on_one_gpu"
PREFETCH = 2  # DataLoader's prefetch_factor: batches each worker keeps in /dev/shm
SHM_SHARE = 0.5  # of /dev/shm's free space, what the loader may fill (NCCL and the rest need some too)
PART_JSON_ENV = "GPU_CHECK_PART_JSON"
FAKE_PARTS_ENV = "GPU_CHECK_FAKE_PARTS"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_CHILD_SUBREAPER = 36
# Rounding: nvjpeg's inverse DCT differs from libjpeg-turbo's by a level or two. Pixels read before they were
# written, or overwritten, are tens of levels off over large areas.
MEAN_LEVELS, FAR_LEVELS, FAR_SHARE = 2.0, 32, 0.01
BUSY_CYCLES = 100_000_000  # torch.cuda._sleep: 50 ms of a GPU at 2 GHz kept busy, so unordered work shows
OVERWRITE_ROUNDS = 20


@dataclasses.dataclass
class Check:
    """What every part needs: where to write, how much time is left, what the machine has."""

    work_dir: Path  # fresh for this invocation
    log_dir: Path
    batch_size: int
    deadline: float
    machine: dict

    def left_s(self) -> float:
        return self.deadline - time.monotonic() - STOP_RESERVE_S


class Launch(NamedTuple):
    """A part's command, the file it writes its results to, and how to read them into the part's result."""

    argv: list[str]
    output: Path
    read: Callable[[dict], dict]
    env: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    estimate_s: float
    limit_s: float
    launch: Callable[[Check], Launch | str]  # the command, or why the part is skipped
    blocker: Callable[[dict], str | None] = lambda machine: None  # a reason known before anything runs


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None, help="write the JSON here (after every part), and the parts' "
                        "logs to the folder NAME_logs beside it")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "gpu_check"),
                        help="each invocation works in a fresh folder inside it, removed at the end")
    parser.add_argument("--batch-size", type=int, default=256, help="benchmark batch per GPU")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--parts", default=",".join(part.name for part in PARTS),
                        help="which parts to run, comma-separated, in the order given")
    # Internal: the decode and tests parts run this file again.
    parser.add_argument("--decode-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pytest", nargs=argparse.REMAINDER, default=None, help=argparse.SUPPRESS)
    return parser


def python_script(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


# ---- the machine ---------------------------------------------------------------------------------------------

def nvidia_smi() -> list[dict] | None:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [[field.strip() for field in line.split(",")] for line in lines if line.strip()]
    return [{"name": name, "driver": driver, "memory_mib": int(memory)} for name, driver, memory in gpus]


def free_mib(path: str) -> dict | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return {"total_mib": stats.f_blocks * stats.f_frsize // 2**20, "free_mib": stats.f_bavail * stats.f_frsize // 2**20}


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_facts(work_dir: Path) -> dict:
    """What the GPU session's command used to gather by hand before running the check."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "gpus": nvidia_smi(), "visible_gpus": torch.cuda.device_count() if cuda else 0,
        "cpus": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "shm": free_mib("/dev/shm"), "work_disk": free_mib(str(work_dir)),
        "compilers": {name: shutil.which(name) for name in ("cc", "gcc", "clang")} | {"CC": os.environ.get("CC")},
        "python_h": str(headers) if headers.is_file() else None,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "torchvision": installed("torchvision"), "triton": installed("triton"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def compile_blocker(machine: dict) -> str | None:
    """torch.compile's GPU kernels go through triton, which builds a small C module when it first runs."""
    if not any(machine["compilers"].values()):
        return "skipped: no C compiler (none of CC, cc, gcc, clang)"
    if machine["python_h"] is None:
        return f"skipped: no Python.h in {sysconfig.get_paths()['include']} (the Python development headers)"
    return None


def fit_loader(shm: dict | None, workers: int, batch_size: int, image_bytes: int, processes: int,
               ) -> tuple[int, str | None]:
    """Loader workers whose batches fit in /dev/shm (each worker keeps PREFETCH batches there), and a line
    saying so where that is fewer than wanted (containers often give /dev/shm 64 MB: a Bus error otherwise)."""
    if shm is None:
        return workers, None
    per_worker = PREFETCH * batch_size * image_bytes * processes
    fits = int(shm["free_mib"] * 2**20 * SHM_SHARE // per_worker)
    if fits >= workers:
        return workers, None
    need = f"{PREFETCH} batches of {batch_size} x {image_bytes / 2**10:.0f} KiB each"
    if fits == 0:
        return 0, f"/dev/shm has {shm['free_mib']} MiB free: not enough for one loader worker ({need})"
    return fits, f"/dev/shm has {shm['free_mib']} MiB free: {fits} loader workers instead of {workers} ({need})"


# ---- the parts -----------------------------------------------------------------------------------------------

def read_json(path: Path) -> dict:
    """A part's results file; {} if it wrote none (it failed first, or was stopped)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def decode_launch(check: Check) -> Launch:
    output = check.log_dir / "decode.json"
    return Launch(python_script("--decode-check"), output, lambda result: result | read_json(output))


def tests_launch(check: Check, selection: list[str], name: str) -> Launch:
    output = check.log_dir / f"{name}.jsonl"
    argv = python_script("--pytest", "tests", "-m", "gpu", *selection, "-q", "-p", "no:cacheprovider")
    if util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={PER_TEST_TIMEOUT_S}")  # the compiling tests' own markers override it
    return Launch(argv, output, lambda result: result | summarize_tests(output))


def demo_launch(check: Check) -> Launch:
    """The demo run through torchrun on NCCL: one process per GPU, at most two; from scratch, in this
    invocation's own folder."""
    processes = min(2, check.machine["visible_gpus"])
    out = check.work_dir / "demo"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            str(REPO / "train_multi_gpu_using_launch.py"), "--output-dir", str(out)]

    def read(result: dict) -> dict:
        log = (check.log_dir / "demo.log").read_text(errors="replace")
        result |= {"processes": processes, "nccl_group": f"(torchrun, nccl): rank 0/{processes}" in log,
                   "nccl_version_printed": "NCCL version" in log}
        if (out / "metrics.jsonl").is_file():
            shutil.copy(out / "metrics.jsonl", check.log_dir / "demo_metrics.jsonl")
            result |= demo_figures((out / "metrics.jsonl").read_text())
        return result

    return Launch(argv, out / "metrics.jsonl", read, env={"NCCL_DEBUG": "VERSION"})


def demo_figures(metrics: str) -> dict:
    epochs = []
    for line in metrics.splitlines():
        with contextlib.suppress(ValueError):  # the last line of a stopped run may be cut short
            epochs.append(json.loads(line))
    if not epochs:
        return {}
    last = epochs[-1]
    return {"epochs": len(epochs), "val_acc": last["val_acc"], "val_total": last["val_total"],
            "images_per_s": last["images_per_s"], "cpu_val_acc": CPU_DEMO_ACCURACY,
            "reaches_cpu_accuracy": last["val_acc"] >= CPU_DEMO_ACCURACY - DEMO_TOLERANCE}


def photo_folder(work_dir: Path) -> Path:
    """The benchmark's photo folder, linked PHOTO_COPIES times: real JPEG decoding, several batches an epoch."""
    from bench.benchmark import ensure_photo_folder

    source = ensure_photo_folder()
    target = work_dir / "photos"
    for photo in sorted(source.glob("*/*.jpg")):
        (target / photo.parent.name).mkdir(parents=True, exist_ok=True)
        for copy in range(PHOTO_COPIES):
            link = target / photo.parent.name / f"{photo.stem}_{copy}.jpg"
            if link.exists():  # made for the other benchmark part
                continue
            try:
                os.link(photo, link)
            except OSError:  # another file system: a symbolic link reads the same
                link.symlink_to(photo)
    return target


def benchmark_launch(check: Check, decode_on: str) -> Launch | str:
    """The benchmark on both sources with the workers decoding; with decode_on "gpu", the image folder
    alone, decoded by nvjpeg, to compare with the first run's synthetic figure."""
    name = "benchmark" if decode_on == "cpu" else "benchmark_decode_gpu"
    processes = min(2, check.machine["visible_gpus"])
    photos = photo_folder(check.work_dir)
    # What one image takes in a batch: pixels at 224 px where the workers decode, the file where the GPU does.
    files = list(photos.glob("*/*.jpg"))
    image_bytes = 3 * 224 * 224 if decode_on == "cpu" else sum(f.stat().st_size for f in files) // len(files)
    wanted = max(1, check.machine["cpus"] // processes - 1)
    workers, shm_note = fit_loader(check.machine["shm"], wanted, check.batch_size, image_bytes, processes)
    if shm_note:
        print(f"gpu_check: {name}: {shm_note}", file=sys.stderr, flush=True)
    sources = "synthetic,folder" if decode_on == "cpu" else "folder"
    if workers == 0:
        if decode_on == "gpu":
            return f"skipped: {shm_note}"
        sources = "synthetic"
    output = check.log_dir / f"{name}.json"
    argv = [sys.executable, str(REPO / "bench" / "benchmark.py"), "--device", "cuda", "--nproc", str(processes),
            "--model", "resnet34", "--image-size", "224", "--batch-size", str(check.batch_size), "--amp", "bf16",
            "--channels-last", "--steps", "30", "--warmup-steps", "15", "--repeats", "3", "--rounds", "1",
            "--workers", str(workers), "--skip-launch", "--data-path", str(photos), "--decode-on", decode_on,
            "--sources", sources, "--output", str(output)]
    keys = ("single_images_per_s", "folder_single_images_per_s", "pipeline_ratio_single", "ddp_images_per_s",
            "folder_ddp_images_per_s", "pipeline_ratio", "scaling_efficiency", "peak_memory_mb", "spread")

    def read(result: dict) -> dict:
        figures = read_json(output)
        return result | {"workers_per_process": workers, "shm_note": shm_note} | {
            key: figures[key] for key in keys if key in figures}

    return Launch(argv, output, read)


# In order of value. Estimates and limits in seconds on one H200 with 16 cores, reckoned from the CPU runs, not
# yet measured there: each part's "seconds" in the JSON says what it took.
PARTS = [
    Part("decode", 40, 90, decode_launch),
    Part("tests", 150, 240, lambda check: tests_launch(
        check, ["-k", "not compile", "--deselect", BENCHMARK_TEST], "tests")),
    Part("demo", 60, 150, demo_launch),
    Part("benchmark", 90, 200, lambda check: benchmark_launch(check, "cpu")),
    Part("benchmark_decode_gpu", 60, 150, lambda check: benchmark_launch(check, "gpu")),
    Part("tests_compile", 150, 360, lambda check: tests_launch(check, ["-k", "compile"], "tests_compile"),
         compile_blocker),
]


# ---- the tests parts: each result as it comes ----------------------------------------------------------------

class TestLog:
    """A pytest plugin writing one JSON line per event as the run goes, so that a run stopped half-way still
    tells which tests passed, failed or were skipped, which one was running and how many never started."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **event: object) -> None:
        with open(self.path, "a") as events:
            events.write(json.dumps(event) + "\n")

    def pytest_collection_finish(self, session: object) -> None:
        self.write(collected=[item.nodeid for item in session.items])

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.write(started=nodeid)

    def pytest_runtest_logreport(self, report: object) -> None:
        if report.when == "call" or report.outcome != "passed":
            why = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else report.longreprtext
            self.write(test=report.nodeid, outcome=report.outcome, why=why[-800:])

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        self.write(finished=nodeid)


def run_pytest(args: list[str]) -> int:
    import pytest

    return int(pytest.main(args, plugins=[TestLog(Path(os.environ[PART_JSON_ENV]))]))


def summarize_tests(events_file: Path) -> dict:
    """Counts and names from TestLog's lines: a failure in any phase fails the test."""
    collected, started, finished, outcomes, why = [], [], set(), {}, {}
    lines = events_file.read_text().splitlines() if events_file.is_file() else []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # the last line of a killed run may be cut short
            continue
        collected = event.get("collected", collected)
        started += [event["started"]] if "started" in event else []
        finished |= {event["finished"]} if "finished" in event else set()
        if "test" in event and outcomes.get(event["test"]) != "failed":
            outcomes[event["test"]], why[event["test"]] = event["outcome"], event["why"]
    counts = {kind: sum(outcome == kind for outcome in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    return counts | {
        "failures": {test: why[test] for test, outcome in outcomes.items() if outcome == "failed"},
        "skips": {test: why[test] for test, outcome in outcomes.items() if outcome == "skipped"},
        "unfinished": [test for test in started if test not in finished],
        "not_started": [test for test in collected if test not in started],
    }


# ---- the decode part ------------------------------------------------------------------------------------------

def compare_pixels(decoded: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    """Each decoded image against its reference: rounding passes, anything larger does not."""
    mismatched, worst_mean, worst_far = [], 0.0, 0.0
    for index, (image, expected) in enumerate(zip(decoded, reference, strict=True)):
        if image.shape != expected.shape:
            mismatched.append(index)
            continue
        levels = (image.int() - expected.int()).abs()
        mean, far = levels.float().mean().item(), (levels > FAR_LEVELS).float().mean().item()
        worst_mean, worst_far = max(worst_mean, mean), max(worst_far, far)
        if mean >= MEAN_LEVELS or far >= FAR_SHARE:
            mismatched.append(index)
    return {"images": len(decoded), "pixels_match": not mismatched, "mismatched_images": mismatched,
            "worst_mean_levels": round(worst_mean, 3), "worst_share_far_off": round(worst_far, 5)}


def overwritten_reads(decode: Callable[[], object], images: int, image_bytes: int, device: torch.device) -> int:
    """In how many of OVERWRITE_ROUNDS decodes the decoder wrote into memory that reads queued before it had
    not yet read (pytorch/vision PR 9606): blocks of the decoded images' size are filled, summed behind a
    long kernel, freed while those sums wait, and the decoder's outputs are then given the same blocks."""
    expected = torch.arange(1, images + 1, dtype=torch.float32) * (image_bytes // 4)
    overwritten = 0
    for _ in range(OVERWRITE_ROUNDS):
        blocks = [torch.full((image_bytes // 4,), float(i + 1), device=device) for i in range(images)]
        torch.cuda.synchronize(device)
        torch.cuda._sleep(BUSY_CYCLES)
        sums = torch.stack([block.sum() for block in blocks])
        del blocks
        decode()
        overwritten += not torch.equal(sums.cpu(), expected)
    return overwritten


def decode_check(device: torch.device) -> dict:
    """torchvision's batched CUDA decode through gpu_decode.decode_batch against the CPU decode of the same
    files, read as soon as the call returns; then the overwrite count, for decode_jpeg alone (whether this
    GPU and torchvision show the fault) and for decode_batch (which must not)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.benchmark import ensure_photo_folder
    from multi_train_utils.gpu_decode import EncodedImages, decode_batch
    from my_dataset import MyDataSet, build_transforms

    photos = sorted(str(path) for path in ensure_photo_folder().glob("*/*.jpg"))
    paths = photos[:: max(1, len(photos) // 64)]  # every class
    dataset = EncodedImages(MyDataSet(paths, [0] * len(paths), build_transforms(224)[0]))
    batch, _ = dataset.collate_fn([dataset[i] for i in range(len(paths))])
    reference = decode_batch(batch, torch.device("cpu"))
    result = compare_pixels([image.cpu() for image in decode_batch(batch, device)], reference)
    few = dataset.collate_fn([dataset[i] for i in range(16)])[0]
    files = [few.data[start:end] for start, end in itertools.pairwise(few.offsets.tolist())]
    image_bytes = reference[0].numel()  # the photos are all of one size

    def count(decode: Callable[[], object]) -> int:
        return overwritten_reads(decode, len(files), image_bytes, device)

    result["overwritten_reads"] = {
        "decode_jpeg": count(lambda: decode_jpeg(files, mode=ImageReadMode.RGB, device=device)),
        "decode_batch": count(lambda: decode_batch(few, device)), "rounds": OVERWRITE_ROUNDS}
    return result


def write_decode_check() -> int:
    result = decode_check(torch.device("cuda"))
    Path(os.environ[PART_JSON_ENV]).write_text(json.dumps(result) + "\n")
    return 0 if result["pixels_match"] and result["overwritten_reads"]["decode_batch"] == 0 else 1


# ---- running the parts ----------------------------------------------------------------------------------------

class StopSignal:
    """The first stop signal that reached gpu_check. The handler only records it: the part being waited for
    is then stopped, the parts after it are not started, and the JSON is written."""

    signum: int | None = None

    @classmethod
    def record(cls, signum: int, frame: object) -> None:
        cls.signum = cls.signum or signum

    @classmethod
    def name(cls) -> str:
        return signal.Signals(cls.signum).name


def adopt_orphans() -> None:
    """Processes a part leaves behind in sessions of their own (torchrun's workers, the tests' runs) become
    this process's children when their parents end, so that end_strays finds them. Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def end_strays(wait_s: float = 10.0) -> None:
    """Kill every process still below this one, and reap them."""
    deadline = time.monotonic() + wait_s
    while (strays := descendants(os.getpid())) and time.monotonic() < deadline:
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        time.sleep(0.05)


def wait_for(process: subprocess.Popen, limit_s: float) -> int | None:
    """The part's exit code, or None once limit_s has passed or a stop signal has come."""
    deadline = time.monotonic() + limit_s
    while StopSignal.signum is None and time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
    return process.poll()


def stop_part(process: subprocess.Popen) -> None:
    """SIGTERM to the part's process group, SIGKILL after STOP_GRACE_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # end_strays tries again
            process.wait(timeout=STOP_GRACE_S)


def status_of(code: int | None, limit_s: float) -> str:
    if code is None:
        return f"stopped by {StopSignal.name()}" if StopSignal.signum else f"timed out after {limit_s:.0f} s"
    if code < 0:
        return f"failed (killed by {signal.Signals(-code).name})"
    return "passed" if code == 0 else f"failed (exit {code})"


def run_part(name: str, launch: Launch, limit_s: float, check: Check) -> dict:
    """Run one part in a session of its own, its output in log_dir/<name>.log, until it ends, limit_s passes
    or a stop signal comes; then end whatever it left running, and read what it wrote."""
    log = check.log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PART_JSON_ENV: str(launch.output), **(launch.env or {})}
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(launch.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    code = wait_for(process, limit_s)
    if code is None:
        stop_part(process)
    end_strays()
    result = {"status": status_of(code, limit_s), "seconds": round(time.monotonic() - started, 1),
              "limit_s": round(limit_s)}
    if code != 0:
        result["output_tail"] = log.read_text(errors="replace")[-1500:]
    return launch.read(result)


def run_one(part: Part, check: Check) -> dict:
    """The part's result, or why it did not run."""
    blocked = part.blocker(check.machine)
    if blocked:
        return {"status": blocked}
    if check.left_s() < part.estimate_s:
        return {"status": f"skipped: {max(0.0, check.left_s()):.0f} s of the budget left, it needs about "
                          f"{part.estimate_s:.0f} s"}
    launch = part.launch(check)
    if isinstance(launch, str):
        return {"status": launch}
    if StopSignal.signum:  # came while the part was being prepared
        return {"status": f"not run: stopped by {StopSignal.name()}"}
    return run_part(part.name, launch, min(part.limit_s, check.left_s()), check)


# ---- the whole check ------------------------------------------------------------------------------------------

def chosen_parts(names: str, fakes: dict) -> list[Part]:
    by_name = {part.name: part for part in PARTS}
    for name in names.split(","):
        if name not in by_name:
            raise SystemExit(f"error: --parts {name}: no such part (the parts: {', '.join(by_name)})")
    return [fake_part(by_name[name], fakes[name]) if name in fakes else by_name[name] for name in names.split(",")]


def fake_part(part: Part, spec: dict) -> Part:
    """The part with a command of the tests' own (GPU_CHECK_FAKE_PARTS), read as the real one is read."""
    def launch(check: Check) -> Launch:
        tests = part.name.startswith("tests")
        output = check.log_dir / f"{part.name}.{'jsonl' if tests else 'json'}"
        read = summarize_tests if tests else read_json
        return Launch(spec["argv"], output, lambda result: result | read(output))

    return dataclasses.replace(part, estimate_s=spec["estimate_s"], limit_s=spec["limit_s"], launch=launch)


def plan(parts: list[Part], machine: dict, left_s: float, budget_s: float) -> dict:
    """Each part's estimate and limit, or why it will not run; printed before anything starts."""
    rows = {part.name: {"skipped": part.blocker(machine)} if part.blocker(machine) else
            {"estimate_s": part.estimate_s, "limit_s": part.limit_s} for part in parts}
    total = sum(row.get("estimate_s", 0) for row in rows.values())
    lines = [f"gpu_check: {budget_s:.0f} s budget; the parts in order of value, each stopped at its limit:",
             f"  {'part':<22}{'estimate':>10}{'limit':>9}"]
    for name, row in rows.items():
        lines.append(f"  {name:<22}{row['skipped']}" if "skipped" in row else
                     f"  {name:<22}{row['estimate_s']:>8.0f} s{row['limit_s']:>7.0f} s")
    lines.append(f"  {'total':<22}{total:>8.0f} s" + ("" if total <= left_s else
                 f"  (over the {left_s:.0f} s the parts have: the last run only if the first end early)"))
    print("\n".join(lines), file=sys.stderr, flush=True)
    return rows


def fresh_log_dir(output: str | None, work_root: Path) -> Path:
    """NAME_logs beside the JSON (without --output, logs in the work folder), emptied of an earlier check's
    files. A folder of that name that gpu_check did not make is left alone."""
    log_dir = Path(output).with_name(Path(output).stem + "_logs") if output else work_root / "logs"
    marker = log_dir / ".gpu_check"
    if log_dir.is_dir() and any(log_dir.iterdir()) and not marker.exists():
        raise SystemExit(f"error: {log_dir}: not empty and not made by gpu_check; move it or choose another --output")
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    marker.touch()
    return log_dir


def save(report: dict, output: str | None) -> None:
    """Written whole or not at all, after every part: a check killed outright still leaves what finished."""
    if output:
        scratch = Path(output).with_name(Path(output).name + ".partial")
        scratch.write_text(json.dumps(report) + "\n")
        scratch.replace(output)


def check_all(args: argparse.Namespace, fakes: dict) -> int:
    started = time.monotonic()
    for sig in STOP_SIGNALS:
        signal.signal(sig, StopSignal.record)
    adopt_orphans()
    parts = chosen_parts(args.parts, fakes)
    work_root = Path(args.work_dir)
    work_root.mkdir(parents=True, exist_ok=True)
    log_dir = fresh_log_dir(args.output, work_root)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=datetime.now().strftime("%Y%m%d-%H%M%S-"), dir=work_root))
    check = Check(work_dir, log_dir, args.batch_size, started + args.budget_s, machine_facts(work_dir))
    report = {"machine": check.machine, "budget_s": args.budget_s, "logs": str(log_dir),
              "plan": plan(parts, check.machine, check.left_s(), args.budget_s)}
    try:
        for part in parts:
            if StopSignal.signum:
                report[part.name] = {"status": f"not run: stopped by {StopSignal.name()}"}
                continue
            report[part.name] = {"status": "running", "started_after_s": round(time.monotonic() - started, 1)}
            save(report, args.output)
            try:
                report[part.name] = run_one(part, check)
            except Exception:  # a broken part is a finding to report, not a reason to lose the others
                traceback.print_exc()
                report[part.name] = {"status": "error", "traceback": traceback.format_exc()[-3000:]}
            print(f"gpu_check: {part.name}: {report[part.name]['status']} after "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["stopped_by"] = StopSignal.signum and StopSignal.name()
    save(report, args.output)
    print(json.dumps(report), flush=True)
    return 128 + StopSignal.signum if StopSignal.signum else 0


def main() -> None:
    args = get_args_parser().parse_args()
    if args.pytest is not None:
        sys.exit(run_pytest(args.pytest))
    if args.decode_check:
        sys.exit(write_decode_check())
    fakes = json.loads(os.environ.get(FAKE_PARTS_ENV) or "{}")
    if not torch.cuda.is_available() and not fakes:
        print("gpu_check: no CUDA GPU is visible here, so there is nothing to check; run it on a GPU machine")
        return
    sys.exit(check_all(args, fakes))


if __name__ == "__main__":
    main()
