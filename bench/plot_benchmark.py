"""Draw what bench/benchmark.py measured: images/s and time per epoch, one process against N.

    python bench/plot_benchmark.py bench/results/cpu_128px.json bench/results/cpu_32px_tuned.json \\
        --out docs/benchmark.png

One group of bars per JSON file (a workload); the machine is named in the title. Needs matplotlib
(pip install -r requirements-plot.txt).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import matplotlib
except ImportError:
    sys.exit("error: plot_benchmark.py needs matplotlib: pip install -r requirements-plot.txt")

matplotlib.use("Agg")  # files only: no window, no display needed
from matplotlib import pyplot as plt  # after use(): the backend is chosen first
from matplotlib.figure import Figure

BARS = (  # (label, key in the JSON) for the images/s panel
    ("1 process", "folder_single_images_per_s"),
    ("N processes (DDP)", "folder_ddp_images_per_s"),
    ("N processes, no all-reduce", "folder_nosync_images_per_s"),
)


def read_results(path: str | Path) -> dict:
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {path}: not a benchmark result ({err})") from None
    if not isinstance(results, dict) or "workload" not in results or "epoch_time_s" not in results:
        raise SystemExit(f"error: {path}: not a benchmark result (no workload or epoch_time_s)")
    return results


def workload_label(results: dict) -> str:
    """The settings that tell two workloads apart, in the benchmark's own flag names."""
    work = results["workload"]
    extras = [f"--{name.replace('_', '-')} {work[name]}" for name, plain in
              (("amp", "off"), ("accum_steps", 1), ("comm_hook", "none")) if work.get(name, plain) != plain]
    extras += ["--channels-last"] if work.get("channels_last") else []
    return "\n".join([f"{work['model']} {work['image_size']}px, batch {work['batch_size']}", *extras])


def draw(all_results: list[dict]) -> Figure:
    machine = all_results[0]["machine"]
    device = machine["gpu"] or f"{machine['cores']}-core CPU ({machine['cpu']})"
    figure, (speed, epoch) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = [workload_label(results) for results in all_results]
    width = 0.8 / len(BARS)
    for i, (name, key) in enumerate(BARS):
        positions = [g + (i - (len(BARS) - 1) / 2) * width for g in range(len(all_results))]
        values = [results[key] for results in all_results]  # None: not measured (--nproc 1)
        bars = speed.bar(positions, [v or 0 for v in values], width,
                         label=name.replace("N", str(all_results[0]["world_size"])))
        speed.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in values], fontsize=8)
    speed.set_ylabel("images / s (image folder, all processes)")
    speed.set_title("Training speed")
    epoch_width = 0.8 / 2
    for i, mode in enumerate(("single", "ddp")):
        positions = [g + (i - 0.5) * epoch_width for g in range(len(all_results))]
        values = [results["epoch_time_s"][mode] for results in all_results]
        name = "1 process" if mode == "single" else f"{all_results[0]['world_size']} processes (DDP)"
        bars = epoch.bar(positions, [v or 0 for v in values], epoch_width, label=name)
        epoch.bar_label(bars, labels=[f"{v:.0f} s" if v else "" for v in values], fontsize=8)
    epoch.set_ylabel(f"seconds per epoch of {all_results[0]['epoch_time_s']['images']} images")
    epoch.set_title("Time per epoch")
    for axes in (speed, epoch):
        axes.set_xticks(range(len(all_results)), labels, fontsize=8)
        axes.legend(fontsize=8)
        axes.margins(y=0.15)
    figure.suptitle(f"bench/benchmark.py on {device}, torch {machine['torch']}", fontsize=10)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files written by bench/benchmark.py --output")
    parser.add_argument("--out", default="docs/benchmark.png", help="PNG file to write")
    args = parser.parse_args()
    figure = draw([read_results(path) for path in args.results])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
