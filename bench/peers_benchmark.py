"""The same job done by this project and by what a user would pick instead, side by side:

    python bench/peers_benchmark.py --output bench/results/peers_cpu.json     # about 9 minutes on 2 cores

Contestants: this project under torchrun; a plain DDP script (bench/peers/plain_ddp.py); Lightning's Trainer
and Hugging Face Accelerate (bench/peers/), each only where it is installed. The job: ResNet-18 from scratch,
--nproc processes on gloo, --workers data-loader workers each, one thread each, the project's own split of
photo-sized JPEGs (bench/benchmark.py's folder, each photo --copies times, unless --data-path names one).
Each round starts every contestant once, fresh, in turn; each figure is the median over the rounds:

  wall_s            from starting the command to its end
  cpu_s             CPU seconds of every process it started
  images_per_s      per epoch, as each contestant times its training loop
  first_step_s      from starting the command to the end of the first optimizer step
  after_last_line_s from the run's last line of output to its end: what a run costs after its work

The last line of stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "bench" / "peers"
sys.path.insert(0, str(REPO))  # run as `python bench/peers_benchmark.py` from anywhere

from bench.benchmark import ensure_photo_folder, machine
from utils import read_split_data

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# tqdm's bar passes 1/N when the loop asks for its second batch: the first step is done.
PROJECT_FIRST_STEP = re.compile(r"\[epoch 0\] train:.*\| 1/\d+")


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--data-path", default=None, help="a folder of class folders (default: bench/benchmark.py's photos, "
        "--copies times)")
    add("--copies", type=int, default=4, help="without --data-path: each photo this many times (hard links), "
        "so that an epoch is long enough to time")
    add("--nproc", type=int, default=2)
    add("--workers", type=int, default=2, help="data-loader workers per process")
    add("--epochs", type=int, default=2)
    add("--batch-size", type=int, default=32, help="per process")
    add("--image-size", type=int, default=64)
    add("--lr", type=float, default=0.001, help="per process; the contestants scale it by the process count")
    add("--rounds", type=int, default=3)
    add("--only", nargs="*", default=None, help="the contestants to run (default: every one installed)")
    add("--output", default=None, help="also write the JSON here")
    return parser


def contestants(args: argparse.Namespace, job_file: Path, output_dir: Path) -> dict[str, list[str]]:
    """The command of each contestant that can run here."""
    project = [*TORCHRUN, f"--nproc_per_node={args.nproc}", str(REPO / "train_multi_gpu_using_launch.py"),
               "--data-path", str(args.data_path), "--model", "resnet18", "--epochs", str(args.epochs),
               "--batch-size", str(args.batch_size), "--image-size", str(args.image_size), "--lr", str(args.lr),
               "--workers", str(args.workers), "--device", "cpu", "--output-dir", str(output_dir)]
    commands = {"project": project,
                "plain_ddp": [*TORCHRUN, f"--nproc_per_node={args.nproc}", str(PEERS / "plain_ddp.py"),
                              str(job_file)]}
    if importlib.util.find_spec("lightning"):
        commands["lightning"] = [sys.executable, str(PEERS / "lightning_job.py"), str(job_file)]
    if importlib.util.find_spec("accelerate"):
        commands["accelerate"] = [*TORCHRUN, f"--nproc_per_node={args.nproc}", str(PEERS / "accelerate_job.py"),
                                  str(job_file)]
    chosen = args.only or list(commands)
    return {name: commands[name] for name in chosen if name in commands}


def write_job(args: argparse.Namespace, folder: Path) -> Path:
    """The job every peer reads: the project's own split of the photos, and the flags."""
    split = read_split_data(Path(args.data_path), seed=0)
    job = {"root": str(args.data_path), "classes": split.class_names, "seed": 0, "epochs": args.epochs,
           "batch_size": args.batch_size, "image_size": args.image_size, "lr": args.lr, "workers": args.workers,
           "processes": args.nproc, "output_dir": str(folder / "peer_output"),
           "train": list(split.train_images_path.relative()), "val": list(split.val_images_path.relative())}
    (folder / "peer_output").mkdir(exist_ok=True)
    path = folder / "job.json"
    path.write_text(json.dumps(job))
    return path


def photos_times(photos: Path, copies: int) -> Path:
    """A folder with each of `photos` `copies` times, as hard links (copies where links cannot be made)."""
    if copies == 1:
        return photos
    folder = photos.with_name(f"{photos.name}_x{copies}")
    if (folder / ".complete").is_file():
        return folder
    for source in sorted(photos.glob("*/*.jpg")):
        (folder / source.parent.name).mkdir(parents=True, exist_ok=True)
        for copy in range(copies):
            target = folder / source.parent.name / f"{source.stem}_{copy}.jpg"
            if not target.exists():
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
    (folder / ".complete").touch()
    return folder


def timed_run(command: list[str], env: dict[str, str]) -> dict:
    """Start `command`, time it, and note when each piece of its output came (tqdm's bar ends pieces in \\r)."""
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    pieces: list[tuple[float, str]] = []

    def read() -> None:
        buffer = ""
        while chunk := process.stdout.read1(65536).decode(errors="replace"):
            buffer += chunk
            *done, buffer = re.split(r"[\r\n]", buffer)
            pieces.extend((time.time(), piece) for piece in done if piece.strip())

    reader = threading.Thread(target=read)
    reader.start()
    returncode = process.wait()
    ended = time.time()
    reader.join()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if returncode != 0:
        tail = "\n".join(piece for _, piece in pieces[-20:])
        raise SystemExit(f"{' '.join(command[:6])} ... failed with exit code {returncode}:\n{tail}")
    return {"started": started, "wall_s": ended - started, "pieces": pieces,
            "after_last_line_s": ended - pieces[-1][0] if pieces else None,
            "cpu_s": (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)}


def figures_of(name: str, run: dict, output_dir: Path) -> dict:
    """images/s per epoch and the first step's end, as the contestant reported them."""
    lines = [json.loads(piece) for _, piece in run["pieces"] if piece.startswith("{")]
    if name == "project":
        with open(output_dir / "metrics.jsonl") as file:
            lines = [json.loads(line) for line in file]
        first_step = next(at for at, piece in run["pieces"] if PROJECT_FIRST_STEP.search(piece))
    else:
        first_step = next(line["first_step_at"] for line in lines if "first_step_at" in line)
    return {"wall_s": run["wall_s"], "cpu_s": run["cpu_s"], "after_last_line_s": run["after_last_line_s"],
            "first_step_s": first_step - run["started"],
            "images_per_s": [line["images_per_s"] for line in lines if "images_per_s" in line]}


def median_figures(rounds: list[dict]) -> dict:
    per_epoch = list(zip(*(figures["images_per_s"] for figures in rounds), strict=True))
    medians = {key: statistics.median(figures[key] for figures in rounds)
               for key in ("wall_s", "cpu_s", "first_step_s", "after_last_line_s")}
    return {**medians, "images_per_s": [statistics.median(epoch) for epoch in per_epoch],
            "spread_wall_s": [min(f["wall_s"] for f in rounds), max(f["wall_s"] for f in rounds)]}


def main() -> None:
    args = get_args_parser().parse_args()
    args.data_path = Path(args.data_path or photos_times(ensure_photo_folder(), args.copies)).resolve()
    # One thread per process for every contestant, as the project itself chooses on 2 cores with 2 processes.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc)),
           "PYTHONPATH": str(PEERS)}
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        job_file = write_job(args, Path(folder))
        for round_number in range(args.rounds):
            output_dir = Path(folder) / f"project-{round_number}"  # a fresh run each round
            for name, command in contestants(args, job_file, output_dir).items():
                print(f"round {round_number + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                results.setdefault(name, []).append(figures_of(name, timed_run(command, env), output_dir))
    medians = {name: median_figures(rounds) for name, rounds in results.items()}
    for figures in medians.values():
        figures["wall_ratio_to_project"] = figures["wall_s"] / medians["project"]["wall_s"]
    report = {"job": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                      if key not in ("output", "only")},
              "medians": medians, "rounds": results, "machine": machine()}
    print_report(report, args.output)


def print_report(report: dict, output: str | None) -> None:
    """The figures as the last line of stdout, and into `output` too where it is given."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
