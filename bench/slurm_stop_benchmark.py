"""How long SLURM's stops take, on a real one-node SLURM cluster started for the purpose (as root, where
slurmctld and slurmd are installed: `.ci/install-slurm`), running the requeue scripts of docs/clusters.md
(srun alone, and srun + torchrun) on the demo data.

    python bench/slurm_stop_benchmark.py [--model resnet34] [--repeats 3] [--output FILE]

Each job gets its stop one second into its second epoch. Prints one JSON object; per launcher:
- `scancel_to_exit_s`: from `scancel JOB` (what the time limit and preemption do) until the last process
  of the job step has ended, its checkpoint written;
- `warning_to_requeue_s`: from the time-limit warning (`scancel --signal=USR1 --batch JOB`, what
  `--signal=B:USR1@90` sends) until the batch script has run `scontrol requeue`, and
  `warning_to_exit_s`, until the last process of the job step had ended before it;
each [min, median, max] of --repeats, with every run's figures and where it saved.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/slurm_stop_benchmark.py` from anywhere
sys.path.insert(0, str(REPO / "tests"))

from preemption_benchmark import spread, write_figures

from slurm_cluster import SlurmCluster, for_this_machine, processes_of, sbatch_scripts, start_cluster, why_no_cluster
from utils import ensure_demo_data

PAGE = REPO / "docs" / "clusters.md"
STOP_LINE = re.compile(r"Stopped by SIGTERM (at epoch \d+, step \d+|after epoch \d+)")


def start_job(cluster: SlurmCluster, script: str, folder: Path, flags: list[str]) -> tuple[int, Path]:
    """Submit the script and wait until it is a second into its second epoch; its id and output folder."""
    out = folder / "run"
    folder.mkdir(parents=True)
    (folder / "job.sh").write_text(for_this_machine(script, ensure_demo_data(), out, flags))
    env = {**cluster.env, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    job = cluster.sbatch(f"--chdir={REPO}", f"--output={folder / 'log'}", str(folder / "job.sh"), env=env)
    deadline = time.monotonic() + 600
    while not (out / "checkpoint.pth").exists():  # written after the first epoch
        if time.monotonic() > deadline or job not in cluster.jobs():
            raise RuntimeError(f"job {job} did not finish its first epoch:\n{(folder / 'log').read_text()[-2000:]}")
        time.sleep(0.1)
    time.sleep(1.0)
    return job, out


def time_stop(cluster: SlurmCluster, script: str, folder: Path, flags: list[str], warning: bool) -> dict:
    job, out = start_job(cluster, script, folder, flags)
    started = time.perf_counter()
    cluster.command("scancel", *(["--signal=USR1", "--batch"] if warning else []), str(job))
    exited = requeued = None
    deadline = time.monotonic() + 300
    while exited is None or (warning and requeued is None):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job}: no exit or requeue within 300 s:\n{(folder / 'log').read_text()[-2000:]}")
        if exited is None and not processes_of(out):
            exited = time.perf_counter() - started
        if warning and requeued is None and cluster.job(job)["Restarts"] != "0":
            requeued = time.perf_counter() - started
        time.sleep(0.02)
    cluster.cancel(job)  # the requeued job would start again: not wanted here
    cluster.wait_until_gone(job)
    stopped = STOP_LINE.search((folder / "log").read_text())
    figures = {"exit_s": round(exited, 3), "saved": stopped.group(1) if stopped else None}
    return {**figures, "requeue_s": round(requeued, 3)} if warning else figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet34")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the JSON to this file")
    args = parser.parse_args()
    why = why_no_cluster()
    if why:
        sys.exit(f"slurm_stop_benchmark: {why}")
    # The demo data's sizes; more epochs than the run will reach.
    flags = ["--model", args.model, "--image-size", "32", "--batch-size", "32", "--lr", "0.002", "--epochs", "1000",
             "--workers", "0", "--device", "cpu"]
    scripts = {("torchrun" if "srun torchrun" in script else "srun"): script
               for script in sbatch_scripts(PAGE) if "--signal=B:USR1" in script}
    runs: dict[str, dict[str, list[dict]]] = {launcher: {"scancel": [], "warning": []} for launcher in scripts}
    with tempfile.TemporaryDirectory() as folder:
        cluster = start_cluster(Path(folder) / "cluster", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        try:
            version = cluster.command("sinfo", "--version").strip()
            for repeat in range(args.repeats):
                for launcher, script in scripts.items():  # taking turns: the machine's drift falls on all alike
                    for stop in ("scancel", "warning"):
                        runs[launcher][stop].append(time_stop(cluster, script, Path(folder) / f"{launcher}-{stop}-"
                                                              f"{repeat}", flags, warning=stop == "warning"))
        finally:
            cluster.stop()
    figures = {"model": args.model, "cpus": os.cpu_count(), "slurm": version}
    for launcher, stops in runs.items():
        figures[launcher] = {
            "scancel_to_exit_s": spread([run["exit_s"] for run in stops["scancel"]]),
            "warning_to_requeue_s": spread([run["requeue_s"] for run in stops["warning"]]),
            "warning_to_exit_s": spread([run["exit_s"] for run in stops["warning"]]),
            "runs": stops,
        }
    write_figures(figures, args.output)


if __name__ == "__main__":
    main()
