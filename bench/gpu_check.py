"""One command that checks this project on a GPU machine and prints what it found as one JSON line.

    python bench/gpu_check.py --output results/gpu_check.json

Within about 8 minutes on one GPU it runs, each part in its own process with its own time limit (a part
that fails or runs out of time is reported, and the others still run):

  tests      the tests marked `gpu` (pass/fail counts, the names of failures)
  demo       the demo run under torchrun on the GPU: an NCCL process group through DDP (one process on a
             one-GPU machine, two where two GPUs are visible), with its final accuracy against the CPU run's
  benchmark  ResNet-34 at 224 px, bf16, channels-last, a batch that fills the GPU, on synthetic tensors
             and on an image folder: images/s, peak memory, pipeline ratio
  benchmark_decode_gpu  the image folder again, its JPEGs decoded on the GPU (--decode-on gpu)

Without a GPU it prints one line saying so and exits 0. It needs nothing but the working tree and an
installed torch and torchvision (plus pytest for the tests): it writes its own demo data and photo folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

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


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None, help="also write the JSON line to this file")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "gpu_check"),
                        help="folder for the runs' outputs and logs")
    parser.add_argument("--batch-size", type=int, default=256, help="benchmark batch per GPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all parts together")
    parser.add_argument("--parts", default="tests,demo,benchmark,benchmark_decode_gpu",
                        help="which parts to run, comma-separated")
    return parser


class Budget:
    """What is left of the overall time limit, shared out between the parts."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def allow(self, wanted_s: float) -> float:
        return max(0.0, min(wanted_s, self.deadline - time.monotonic()))


def run_part(name: str, cmd: list[str], timeout_s: float, log_dir: Path, env: dict[str, str] | None = None,
             ) -> tuple[int | None, str, float]:
    """Run one part in a session of its own; its output goes to log_dir/<name>.log. Returns (exit code or
    None on a time-out, the output, seconds). On a time-out the whole process tree is killed."""
    log = log_dir / f"{name}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            code: int | None = process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    return code, log.read_text(errors="replace"), time.monotonic() - started


def outcome(code: int | None, output: str, seconds: float) -> dict:
    status = "passed" if code == 0 else ("timed out" if code is None else f"failed (exit {code})")
    result = {"status": status, "seconds": round(seconds, 1)}
    if code != 0:
        result["output_tail"] = output[-1500:]
    return result


def check_tests(budget: Budget, log_dir: Path) -> dict:
    report = log_dir / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}"]
    code, output, seconds = run_part("tests", cmd, budget.allow(300), log_dir)
    return outcome(code, output, seconds) | (count_results(report) if report.is_file() else {})


def count_results(junit_xml: Path) -> dict:
    """Passed, failed and skipped tests in pytest's JUnit XML report, and the names of those that failed."""
    counts: dict = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            counts["failures"].append(case.get("name"))
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def check_demo(budget: Budget, log_dir: Path, work_dir: Path) -> dict:
    """The demo run through torchrun on NCCL: one process per GPU, at most two."""
    nproc = min(2, torch.cuda.device_count())
    out = work_dir / "demo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "train_multi_gpu_using_launch.py"), "--output-dir", str(out), "--resume", "auto"]
    code, output, seconds = run_part("demo", cmd, budget.allow(180), log_dir, env={"NCCL_DEBUG": "VERSION"})
    result = outcome(code, output, seconds) | {"processes": nproc,
                                                "nccl_group": f"(torchrun, nccl): rank 0/{nproc}" in output,
                                                "nccl_version_printed": "NCCL version" in output}
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        epochs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if epochs:
            last = epochs[-1]
            result.update(epochs=len(epochs), val_acc=last["val_acc"], val_total=last["val_total"],
                          images_per_s=last["images_per_s"], cpu_val_acc=CPU_DEMO_ACCURACY,
                          reaches_cpu_accuracy=last["val_acc"] >= CPU_DEMO_ACCURACY - DEMO_TOLERANCE)
    return result


def photo_folder(work_dir: Path) -> Path:
    """The benchmark's photo folder, hard-linked PHOTO_COPIES times: real JPEG decoding, several batches an epoch."""
    sys.path.insert(0, str(REPO / "bench"))
    from benchmark import ensure_photo_folder

    source = ensure_photo_folder()
    target = work_dir / "photos"
    for photo in sorted(source.glob("*/*.jpg")):
        for copy in range(PHOTO_COPIES):
            link = target / photo.parent.name / f"{photo.stem}_{copy}.jpg"
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                os.link(photo, link)
    return target


def check_benchmark(budget: Budget, log_dir: Path, work_dir: Path, batch_size: int, decode_on: str = "cpu") -> dict:
    """The benchmark on both sources with the workers decoding; with decode_on "gpu", the image folder
    alone, decoded by nvjpeg, to compare with the first run's synthetic figure."""
    workers = max(1, len(os.sched_getaffinity(0)) // min(2, torch.cuda.device_count()) - 1)
    name = f"benchmark_decode_{decode_on}"
    cmd = [sys.executable, str(REPO / "bench" / "benchmark.py"), "--device", "cuda",
           "--nproc", str(min(2, torch.cuda.device_count())), "--model", "resnet34", "--image-size", "224",
           "--batch-size", str(batch_size), "--amp", "bf16", "--channels-last", "--steps", "30",
           "--warmup-steps", "15", "--repeats", "3", "--rounds", "1", "--workers", str(workers), "--skip-launch",
           "--data-path", str(photo_folder(work_dir)), "--decode-on", decode_on,
           "--sources", "synthetic,folder" if decode_on == "cpu" else "folder",
           "--output", str(work_dir / f"{name}.json")]
    code, output, seconds = run_part(name, cmd, budget.allow(240), log_dir)
    result = outcome(code, output, seconds)
    if code == 0:
        figures = json.loads(output.strip().splitlines()[-1])
        keys = ("single_images_per_s", "folder_single_images_per_s", "pipeline_ratio_single", "ddp_images_per_s",
                "folder_ddp_images_per_s", "pipeline_ratio", "scaling_efficiency", "peak_memory_mb", "spread")
        result.update({key: figures.get(key) for key in keys}, workers_per_process=workers)
    return result


def machine() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpus": torch.cuda.device_count(), "memory_gib": round(props.total_memory / 2**30, 1),
            "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "python": platform.python_version()}


def main() -> None:
    args = get_args_parser().parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible here, so there is nothing to check; run it on a GPU machine")
        return
    work_dir = Path(args.work_dir)
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    parts = args.parts.split(",")
    started = time.monotonic()
    result: dict = {"machine": machine()}
    checks = {"tests": lambda: check_tests(budget, log_dir),
              "demo": lambda: check_demo(budget, log_dir, work_dir),
              "benchmark": lambda: check_benchmark(budget, log_dir, work_dir, args.batch_size),
              "benchmark_decode_gpu": lambda: check_benchmark(budget, log_dir, work_dir, args.batch_size, "gpu")}
    for name in parts:
        try:
            result[name] = checks[name]() if budget.allow(1) else {"status": "not run: out of time"}
        except Exception as err:  # a broken part is a finding to report, not a reason to lose the others
            result[name] = {"status": f"error: {type(err).__name__}: {err}"}
        print(f"gpu_check: {name}: {result[name]['status']}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.monotonic() - started, 1)
    line = json.dumps(result)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
