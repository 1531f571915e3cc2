"""The same job on one machine and across two, timed in turn:

    python bench/two_hosts_benchmark.py --output bench/results/two_hosts_cpu.json    # about 5 minutes, as root

One machine: `torchrun --standalone --nproc_per_node=2` on this machine's first two cores. Two machines: the
two hosts of tests/two_hosts.py (network namespaces on one virtual cable, each with its own address, host
name and core), one process each, started with docs/clusters.md's static rendezvous (--nnodes=2
--node-rank --master-addr). Both train the same job: the given model from scratch on bench/benchmark.py's
photo-sized JPEGs (each --copies times) or --data-path, --batch-size per process, no loader workers (each host has one
core). Each round runs both once, fresh; each figure is the median over the rounds:

  wall_s          from starting the command (both commands, across two hosts) to the end of the last one
  images_per_s    per epoch, from the run's metrics.jsonl (every process's images over the loop's time)
  speed_ratio     images_per_s of the last epoch, two machines over one: what crossing the cable costs

Needs root and iproute2; where two hosts cannot be made, it prints why and exits 2. The last line of stdout is
one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # run as `python bench/two_hosts_benchmark.py` from anywhere

import pytest

from bench.benchmark import ensure_photo_folder, machine
from bench.peers_benchmark import photos_times, print_report, timed_run
from two_hosts import two_hosts

SCRIPT = REPO / "train_multi_gpu_using_launch.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
MASTER_PORT = 29611
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--data-path", default=None, help="a folder of class folders (default: bench/benchmark.py's photos, "
        "--copies times)")
    add("--copies", type=int, default=2, help="without --data-path: each photo this many times (hard links)")
    add("--model", default="resnet18")
    add("--epochs", type=int, default=2)
    add("--batch-size", type=int, default=32, help="per process")
    add("--image-size", type=int, default=64)
    add("--rounds", type=int, default=3)
    add("--output", default=None, help="also write the JSON here")
    return parser


def training_flags(args: argparse.Namespace, data: Path, output_dir: Path) -> list[str]:
    return ["--data-path", str(data), "--model", args.model, "--epochs", str(args.epochs), "--batch-size",
            str(args.batch_size), "--image-size", str(args.image_size), "--workers", "0", "--device", "cpu",
            "--output-dir", str(output_dir)]


def on_one_machine(args: argparse.Namespace, data: Path, output_dir: Path) -> dict:
    command = ["taskset", "-c", "0,1", *TORCHRUN, "--standalone", "--nproc_per_node=2", str(SCRIPT),
               *training_flags(args, data, output_dir)]
    return {"wall_s": timed_run(command, env=launcher_free_environ())["wall_s"], **epoch_figures(output_dir)}


def across_two_machines(args: argparse.Namespace, data: Path, output_dir: Path, folder: Path) -> dict:
    with two_hosts(loopback_names=False) as hosts:
        started = time.time()
        jobs = []
        for rank, host in enumerate(hosts):
            command = [*TORCHRUN, "--nnodes=2", f"--node-rank={rank}", f"--master-addr={hosts[0].address}",
                       f"--master-port={MASTER_PORT}", "--nproc_per_node=1", str(SCRIPT),
                       *training_flags(args, data, output_dir)]
            jobs.append(host.start(command, folder / f"host{rank}.log", launcher_free_environ(), REPO))
        codes = [job.wait(timeout=1800) for job in jobs]
        wall_s = time.time() - started
    if codes != [0, 0]:
        tails = "\n".join((folder / f"host{rank}.log").read_text()[-2000:] for rank in range(2))
        raise SystemExit(f"the two-machine run failed with exit codes {codes}:\n{tails}")
    return {"wall_s": wall_s, **epoch_figures(output_dir)}


def launcher_free_environ() -> dict[str, str]:
    """This environment without launcher variables: each run's torchrun sets its own."""
    return {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}


def epoch_figures(output_dir: Path) -> dict:
    with open(output_dir / "metrics.jsonl") as file:
        lines = [json.loads(line) for line in file]
    return {"images_per_s": [line["images_per_s"] for line in lines], "world_size": lines[-1]["world_size"]}


def medians(rounds: list[dict]) -> dict:
    per_epoch = zip(*(figures["images_per_s"] for figures in rounds), strict=True)
    return {"wall_s": statistics.median(figures["wall_s"] for figures in rounds),
            "images_per_s": [statistics.median(epoch) for epoch in per_epoch]}


def main() -> None:
    args = get_args_parser().parse_args()
    data = Path(args.data_path or photos_times(ensure_photo_folder(), args.copies)).resolve()
    results: dict[str, list[dict]] = {"one_machine": [], "two_machines": []}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for round_number in range(args.rounds):
                print(f"round {round_number + 1}/{args.rounds}: one machine", file=sys.stderr, flush=True)
                results["one_machine"].append(on_one_machine(args, data, Path(folder) / f"one-{round_number}"))
                print(f"round {round_number + 1}/{args.rounds}: two machines", file=sys.stderr, flush=True)
                results["two_machines"].append(
                    across_two_machines(args, data, Path(folder) / f"two-{round_number}", Path(folder)))
    except pytest.skip.Exception as why:  # two_hosts says what this machine lacks
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)
    figures = {name: medians(rounds) for name, rounds in results.items()}
    report = {"job": {key: value for key, value in vars(args).items() if key != "output"} | {"processes": 2},
              "medians": figures,
              "speed_ratio": figures["two_machines"]["images_per_s"][-1] / figures["one_machine"]["images_per_s"][-1],
              "wall_ratio": figures["two_machines"]["wall_s"] / figures["one_machine"]["wall_s"],
              "rounds": results, "machine": machine()}
    print_report(report, args.output)


if __name__ == "__main__":
    main()
