"""How long a stop for preemption takes: writing a checkpoint inside an epoch, and from the signal to the
exit of the last process, on every launcher.

    python bench/preemption_benchmark.py [--model resnet34] [--repeats 3] [--output FILE]

Prints one JSON object:
- `checkpoint_write_s`: building and writing the whole checkpoint of --model (weights, SGD momentum, the
  random states) into a fresh run folder, as a run does inside an epoch; [min, median, max] of --repeats.
- `signal_to_exit_s`: per launcher, a real run on the demo data (--model, 2 processes for torchrun and
  spawn) gets SIGTERM at its launcher in the middle of an epoch; the time until the launcher and every
  process it started have ended. `saved` is the position its checkpoint was written at.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/preemption_benchmark.py` from anywhere

import torch

from model import create_model
from multi_train_utils.checkpoint import Checkpointer
from multi_train_utils.cli import default_config
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.meeting import find_free_port
from multi_train_utils.optim import StepOptions, build_optimizer, build_scheduler
from multi_train_utils.recorder import RunRecorder

LAUNCHERS = {
    "single": [sys.executable, str(REPO / "train_single_gpu.py")],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"],
    "spawn": [sys.executable, str(REPO / "train_multi_gpu_using_spawn.py"), "--world-size", "2"],
}
STOP_LINE = re.compile(r"Stopped by SIGTERM (at epoch \d+, step \d+|after epoch \d+)")


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3)]


def write_figures(figures: dict[str, object], output: str | None) -> None:
    """The figures as one JSON line on stdout, and into `output` if given."""
    line = json.dumps(figures)
    print(line)
    if output:
        Path(output).write_text(line + "\n")


def time_checkpoint_write(model_name: str, repeats: int) -> dict[str, object]:
    """The checkpoint of a model whose optimizer has taken one step (so that its momentum exists)."""
    model = create_model(model_name, 5)
    optimizer = build_optimizer(model, lr=0.01)
    scheduler = build_scheduler(optimizer, epochs=10)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    split = {"class_names": [str(i) for i in range(5)], "train": [], "val": []}
    times, size = [], 0
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            with contextlib.redirect_stdout(io.StringIO()), \
                    RunRecorder(default_config(output_dir=str(Path(folder) / "run")), single_process("cpu"), split) \
                    as recorder:
                loader = torch.utils.data.DataLoader(range(10), batch_size=2)
                checkpoints = Checkpointer(model, optimizer, scheduler, StepOptions(), recorder, loader)
                started = time.perf_counter()
                checkpoints.save_epoch(0)  # built (weights and random states copied) and written
                times.append(time.perf_counter() - started)
                size = recorder.checkpoint_path.stat().st_size
    return {"checkpoint_write_s": spread(times), "checkpoint_mb": round(size / 2**20, 1)}


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def alive(pids: set[int]) -> bool:
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            return True
    return False


def time_signal_to_exit(launcher: str, model_name: str, folder: Path) -> dict[str, object]:
    """Start a run, SIGTERM its launcher a second into its second epoch, and time until everything ended."""
    cmd = list(LAUNCHERS[launcher])
    if launcher == "torchrun":
        cmd += [f"--master_port={find_free_port()}", str(REPO / "train_multi_gpu_using_launch.py")]
    out = folder / launcher
    folder.mkdir(parents=True, exist_ok=True)
    cmd += ["--model", model_name, "--epochs", "1000", "--device", "cpu", "--output-dir", str(out)]
    with open(folder / f"{launcher}.log", "w") as log:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not (out / "checkpoint.pth").exists():
            if run.poll() is not None:
                raise RuntimeError(f"{launcher} ended early:\n{(folder / f'{launcher}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # into the next epoch
        tree = descendants(run.pid)
        started = time.perf_counter()
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        while alive(tree):
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    stopped = STOP_LINE.search((folder / f"{launcher}.log").read_text())
    return {"seconds": round(elapsed, 3), "saved": stopped.group(1) if stopped else None, "exit_code": run.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet34")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=list(LAUNCHERS))
    parser.add_argument("--output", default=None, help="also write the JSON to this file")
    args = parser.parse_args()
    figures: dict[str, object] = {"model": args.model, "torch": torch.__version__, "cpus": os.cpu_count(),
                                  **time_checkpoint_write(args.model, args.repeats)}
    timings: dict[str, list[dict[str, object]]] = {launcher: [] for launcher in args.launchers}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for launcher in args.launchers:  # taking turns: whatever else the machine does falls on all alike
                timings[launcher].append(time_signal_to_exit(launcher, args.model, Path(folder) / str(repeat)))
    figures["signal_to_exit_s"] = {launcher: {"spread": spread([t["seconds"] for t in runs]), "runs": runs}
                                   for launcher, runs in timings.items()}
    write_figures(figures, args.output)


if __name__ == "__main__":
    main()
