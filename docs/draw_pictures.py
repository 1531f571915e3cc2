"""The pictures of README.md and docs/using-a-run.md, drawn from two demo runs, one process and two, by the
commands a learner runs (plot_runs.py and show_batch.py), so that what the pages show is what those draw:

    python train_single_gpu.py --output-dir runs/single
    torchrun --standalone --nproc_per_node=2 train_multi_gpu_using_launch.py --output-dir runs/ddp2
    python docs/draw_pictures.py runs/single runs/ddp2

tests/test_plot_runs.py runs it on two small runs. It needs matplotlib (requirements-plot.txt).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import plot_runs  # noqa: E402 (from the checkout, wherever this runs from)
import show_batch  # noqa: E402

LABELS = ["1 process", "2 processes (torchrun)"]


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("single", help="the --output-dir of the one-process run")
    parser.add_argument("ddp2", help="the --output-dir of the two-process run")
    parser.add_argument("--out-dir", default=str(REPO / "docs"), help="where the pictures go")
    args = parser.parse_args(argv)
    written = plot_runs.main([args.single, args.ddp2, "--labels", *LABELS, "--out-dir", args.out_dir])
    batch = Path(args.out_dir) / "first_batch.png"
    show_batch.main(["--out", str(batch)])
    return [*written, batch]


if __name__ == "__main__":
    main()
