"""ImageNet's shape and size without ImageNet: trees of 1000 class folders of .JPEG files laid out as torchvision's
references expect (train/<class>/, val/<class>/), made of hard links to a few small JPEGs, at 10k, 100k and
1.28M training files. For each, the training script's start-up (from the start of the process, imports
included, to its first optimizer step), its peak memory, and the size of the checkpoint of that step, beside
torchvision's ImageFolder listing the same tree; and, at one size, the loader workers' private memory at the
start and the end of a pass over the files. Prints one JSON object.

    python bench/imagenet_benchmark.py --sizes 10000 100000 1281167 --output bench/results/imagenet_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/imagenet_benchmark.py` from anywhere

import numpy as np
from PIL import Image

CLASSES = 1000
VAL_PER_CLASS = 50  # ImageNet's validation set: 50 images of each class
SOURCES = 64  # distinct small JPEGs that every file is a hard link to (ext4 allows 65,000 links to one file)
# The training script, started as a user would, told to stop at its first optimizer step with the checkpoint of
# that step (SIGTERM: it stops there and saves it), its first step timed from the start of the process.
PROBE = """
import os, signal, sys, time, runpy
from torch.optim.optimizer import register_optimizer_step_pre_hook
def first_step(*_):
    if not getattr(first_step, "done", False):
        first_step.done = True
        print(f"FIRST_STEP {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
register_optimizer_step_pre_hook(first_step)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# Runs a command and says the peak memory of the largest process it made (the run alone, not earlier ones).
MEASURED = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); sys.exit(code)")


def make_tree(root: Path, train_files: int) -> Path:
    """train/ and val/ of CLASSES class folders (n01000000, ...), train_files training files in all and
    VAL_PER_CLASS validation files each, every one a hard link to one of SOURCES small JPEGs. Made once."""
    done = root / ".complete"
    if done.is_file():
        return root
    rng = np.random.default_rng(0)
    sources = []
    for index in range(SOURCES):
        path = root / f".source{index}.JPEG"
        root.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(path, quality=80)
        sources.append(str(path))
    per_class = np.full(CLASSES, train_files // CLASSES)
    per_class[: train_files % CLASSES] += 1
    for split, counts in (("train", per_class), ("val", np.full(CLASSES, VAL_PER_CLASS))):
        for label, count in enumerate(counts.tolist()):
            folder = root / split / f"n{1000000 + label:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                os.link(sources[(label + index) % SOURCES], folder / f"n{1000000 + label:08d}_{index}.JPEG")
    done.write_text("")
    return root


def start_up(tree: Path, out: Path) -> dict:
    """The training script on the tree: seconds from its start to its first optimizer step, its peak memory (of
    the whole process tree), and the size of the checkpoint of that step."""
    cmd = [sys.executable, "-c", PROBE, str(REPO / "train_single_gpu.py"), "--data-path", str(tree), "--output-dir",
           str(out), "--model", "resnet18", "--image-size", "32", "--batch-size", "32", "--epochs", "1",
           "--workers", "0", "--device", "cpu"]
    started = time.time()
    result = subprocess.run([sys.executable, "-c", MEASURED, *cmd], capture_output=True, text=True, timeout=900)
    peak_mb = int(result.stdout.split("PEAK_KB ", 1)[1].split()[0]) / 1024
    if result.returncode != 128 + signal.SIGTERM or "FIRST_STEP" not in result.stdout:
        raise RuntimeError(f"the run did not reach its first step:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    first_step = float(result.stdout.split("FIRST_STEP ", 1)[1].split()[0])
    return {"seconds_to_first_step": round(first_step - started, 1), "peak_memory_mb": round(peak_mb),
            "checkpoint_mb": round((out / "checkpoint.pth").stat().st_size / 2**20, 2),
            "split_json_mb": round((out / "split.json").stat().st_size / 2**20, 1)}


def image_folder_listing(tree: Path) -> float:
    """Seconds torchvision's ImageFolder takes to list the tree's train/ (in a process of its own)."""
    code = (f"import time; from torchvision.datasets import ImageFolder; t = time.perf_counter(); "
            f"ImageFolder({str(tree / 'train')!r}); print(time.perf_counter() - t)")
    return round(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.split()[-1]), 1)


def private_mb(pid: int) -> float:
    """Memory of `pid` that no other process shares: what a loader worker has copied for itself."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[name].split()[0]) for name in ("Private_Clean", "Private_Dirty")) / 1024


def worker_memory(tree: Path, batches: int, workers: int = 2) -> dict:
    """Loader workers' private memory after their first batch and after `batches` batches, over the tree's
    training files, as the training script's loader holds them."""
    import torch

    from multi_train_utils.data import build_loaders
    from multi_train_utils.distributed_utils import single_process
    from utils import build_datasets, read_data

    ctx = single_process("cpu")
    train_set, val_set = build_datasets(read_data(str(tree), ctx), 32)
    loader, _ = build_loaders(train_set, val_set, 32, ctx, workers)
    loader.sampler.set_epoch(0)
    batches_left = iter(loader)
    next(batches_left)
    pids = [worker.pid for worker in batches_left._workers]
    start = [private_mb(pid) for pid in pids]
    for _ in range(batches):
        next(batches_left)
    end = [private_mb(pid) for pid in pids]
    del batches_left
    torch.cuda.empty_cache()
    return {"batches": batches, "workers": workers, "private_mb_at_start": [round(mb, 1) for mb in start],
            "private_mb_at_end": [round(mb, 1) for mb in end],
            "growth_mb_per_1000_batches": round(max(e - s for s, e in zip(start, end, strict=True))
                                                * 1000 / batches, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_281_167],
                        help="training files of each tree")
    parser.add_argument("--trees", default=str(Path(tempfile.gettempdir()) / "imagenet_shaped"),
                        help="folder where the trees are made (once) and kept")
    parser.add_argument("--worker-batches", type=int, default=1000,
                        help="batches the workers' memory is followed over (on the tree of the second size)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args()
    figures: dict = {"classes": CLASSES, "sizes": {}}
    for size in args.sizes:
        tree = make_tree(Path(args.trees) / f"train{size}", size)
        with tempfile.TemporaryDirectory() as out:
            figures["sizes"][str(size)] = {**start_up(tree, Path(out) / "run"),
                                           "imagefolder_listing_s": image_folder_listing(tree)}
        print(f"{size} files: {figures['sizes'][str(size)]}", file=sys.stderr, flush=True)
    worker_tree = Path(args.trees) / f"train{args.sizes[min(1, len(args.sizes) - 1)]}"
    figures["loader_workers"] = worker_memory(worker_tree, args.worker_batches)
    text = json.dumps(figures)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
