"""bench/benchmark.py and bench/plot_benchmark.py in pieces; the README test runs both whole, as the README says."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from conftest import REPO, make_image_folder

REQUIRED_KEYS = {"single_images_per_s", "ddp_images_per_s", "nosync_images_per_s", "world_size", "scaling_efficiency",
                 "comm_overhead", "pipeline_ratio", "time_to_first_step_s", "peak_memory_mb", "workload"}


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so that spawn and pickle find the functions it defines
    spec.loader.exec_module(module)
    return module


benchmark = load_script("benchmark")


def plot_benchmark() -> ModuleType:
    """bench/plot_benchmark.py, which needs matplotlib (optional: requirements-plot.txt); its tests skip without it."""
    pytest.importorskip("matplotlib")
    return sys.modules.get("plot_benchmark") or load_script("plot_benchmark")


def bench_args(**overrides: object) -> argparse.Namespace:
    argv = ["--model", "resnet18", "--image-size", "16", "--batch-size", "2", "--steps", "2", "--warmup-steps", "1",
            "--rounds", "1"]
    args = benchmark.get_args_parser().parse_args(argv)
    return argparse.Namespace(**{**vars(args), **overrides})


def made_up_results() -> dict[str, dict[str, dict]]:
    """Two repeats of each configuration: the median of two is their mean."""
    def figures(images_per_s: float) -> dict:
        return {"images_per_s": [images_per_s - 1, images_per_s + 1], "peak_memory_mb": 900.0,
                "allreduce_s": [0.1, 0.3]}

    return {"synthetic": {"single": figures(40.0), "ddp": figures(38.0), "nosync": figures(50.0)},
            "folder": {"single": figures(36.0), "ddp": figures(34.2), "nosync": figures(45.0)}}


def test_the_summary_holds_every_figure_and_the_ratios_between_them() -> None:
    summary = benchmark.summarize(bench_args(), made_up_results(), {"torchrun": 9.0, "spawn": 11.0}, 81.2, 480)
    assert set(summary) >= REQUIRED_KEYS
    # Ratios pair each repeat with the other configuration's repeat of the same round.
    assert summary["scaling_efficiency"] == pytest.approx((37 / 39 + 39 / 41) / 2)
    assert summary["comm_overhead"] == pytest.approx(1 - (37 / 49 + 39 / 51) / 2)
    assert summary["pipeline_ratio"] == pytest.approx((33.2 / 37 + 35.2 / 39) / 2)
    assert summary["epoch_time_s"] == {"images": 480, "single": 480 / 36.0, "ddp": 480 / 34.2}
    assert summary["single_images_per_s"] == 40.0 and summary["allreduce_s"] == pytest.approx(0.2)
    assert summary["spread"]["ddp_images_per_s"] == [37.0, 38.0, 39.0]
    assert summary["spread"]["scaling_efficiency"] == pytest.approx([37 / 39, (37 / 39 + 39 / 41) / 2, 39 / 41])
    assert summary["step_time_s"]["ddp"] == pytest.approx(2 * 2 / 38.0), "2 processes x batch 2 per step"
    assert summary["workload"]["model"] == "resnet18" and "probe" not in summary["workload"]
    json.dumps(summary)  # printable as the last line


def test_the_check_of_the_collectives_is_timed_against_the_same_processes_without_it() -> None:
    """--check-collectives: the ddp processes again, under PyTorch's check, paired repeat by repeat with plain ddp."""
    results = made_up_results()
    assert benchmark.summarize(bench_args(), results, {}, 81.2, 480)["check_overhead"] is None, "not measured"
    results["synthetic"]["checked"] = {"images_per_s": [29.0, 31.0], "peak_memory_mb": 950.0}
    summary = benchmark.summarize(bench_args(check_collectives=True), results, {}, 81.2, 480)
    assert summary["check_overhead"] == pytest.approx(1 - (29 / 37 + 31 / 39) / 2)
    assert summary["checked_images_per_s"] == 30.0 and summary["step_time_s"]["checked"] == pytest.approx(4 / 30.0)


@pytest.mark.benchmarks
def test_the_checked_processes_run_under_the_check_and_the_others_do_not(tmp_path: Path) -> None:
    """The whole benchmark with --check-collectives, tiny: every rank of each configuration says whether PyTorch
    checked its collectives (DETAIL), and the benchmark stops where that is not what the configuration is."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "benchmark.py"), "--check-collectives",
                             "--sources", "synthetic", "--skip-launch", "--model", "resnet18", "--image-size", "16",
                             "--batch-size", "2", "--steps", "2", "--warmup-steps", "1", "--repeats", "1", "--rounds",
                             "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["checked_images_per_s"] > 0 and summary["check_overhead"] < 1
    assert "checked synthetic:" in result.stderr


def test_with_one_process_only_its_own_figures_are_given() -> None:
    """--nproc 1, as on a machine with one GPU: nothing to compare with, so the ratios are None."""
    one = {source: {"single": figures} for source, figures in
           ((source, made_up_results()[source]["single"]) for source in ("synthetic", "folder"))}
    summary = benchmark.summarize(bench_args(nproc=1), one, {}, 81.2, 480)
    assert summary["single_images_per_s"] == 40.0
    assert summary["pipeline_ratio_single"] == pytest.approx((35 / 39 + 37 / 41) / 2)
    assert summary["ddp_images_per_s"] is summary["scaling_efficiency"] is summary["comm_overhead"] is None
    assert summary["epoch_time_s"]["ddp"] is None and set(summary["peak_memory_mb"]) == {"single"}
    json.dumps(summary)
    speed, _ = plot_benchmark().draw([summary]).axes
    assert [bar.get_height() for bar in speed.patches] == [36.0, 0, 0]


def test_batches_go_on_into_the_next_epoch_with_a_new_shuffle() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(6))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    batches = benchmark.Batches(DataLoader(data, batch_size=2, sampler=sampler), count=5)
    seen = [batch[0].tolist() for batch in batches]
    assert len(batches) == len(seen) == 5
    first_epoch = [i for batch in seen[:3] for i in batch]
    second_epoch = [i for batch in seen[3:] for i in batch]
    assert sorted(first_epoch) == list(range(6)) and sampler.epoch == 1
    assert second_epoch != first_epoch[:4], "set_epoch(1) gives the second pass another order"


@pytest.mark.parametrize("source", ["synthetic", "folder"])
def test_one_process_measures_images_per_second_and_memory(tmp_path: Path, source: str) -> None:
    data = make_image_folder(tmp_path / "images", {"a": 6, "b": 6})
    args = bench_args(mode="single", source=source, result_dir=str(tmp_path), data_path=str(data), workers=0)
    benchmark.measure(0, 1, args)
    figures = json.loads((tmp_path / f"single_{source}_rank0.json").read_text())
    assert figures["images"] == 2 * 2
    assert len(figures["seconds"]) == args.repeats and min(figures["seconds"]) > 0


def test_repeats_go_on_from_one_iterator_after_a_warm_up_that_drains_the_workers_queue(tmp_path: Path) -> None:
    """A new iterator per repeat would time the workers refilling their queue instead of training."""
    data = make_image_folder(tmp_path / "images", {"a": 6, "b": 6})
    args = bench_args(source="folder", data_path=str(data), workers=2, repeats=3)
    batches, num_classes, warmup = benchmark.training_batches(args, benchmark.single_process("cpu"))
    assert (num_classes, warmup) == (2, 1 + 2 * 2)
    taken = [len(list(benchmark.Take(batches, count))) for count in (warmup, 2, 2, 2)]
    assert taken == [5, 2, 2, 2] and next(batches, None) is None, "one iterator, exactly as long as needed"


def test_the_picture_is_drawn_from_result_files(tmp_path: Path) -> None:
    summary = benchmark.summarize(bench_args(), made_up_results(), {}, 81.2, 480)
    tuned = {**summary, "workload": {**summary["workload"], "accum_steps": 4, "comm_hook": "bf16"}}
    figure = plot_benchmark().draw([summary, tuned])
    speed, epoch = figure.axes
    assert sorted(bar.get_height() for bar in speed.patches) == sorted([36.0, 34.2, 45.0] * 2)
    assert {round(bar.get_height(), 3) for bar in epoch.patches} == {round(480 / 36.0, 3), round(480 / 34.2, 3)}
    labels = [label.get_text() for label in speed.get_xticklabels()]
    assert labels[0] == "resnet18 16px, batch 2" and "--accum-steps 4" in labels[1]
    machine = summary["machine"]
    assert (machine["gpu"] or f"{machine['cores']}-core CPU") in figure.get_suptitle(), "the machine is named"


def test_a_file_that_is_not_a_result_is_one_line_naming_it(tmp_path: Path) -> None:
    wrong = tmp_path / "metrics.json"
    wrong.write_text('{"epoch": 0}')
    with pytest.raises(SystemExit, match=r"^error: .*metrics\.json: not a benchmark result"):
        plot_benchmark().read_results(wrong)


def test_the_image_folder_alone_is_summarised_without_the_synthetic_figures() -> None:
    """--sources folder (gpu_check's run with --decode-on gpu): the folder's figures, None for the rest."""
    folder_only = {"synthetic": {}, "folder": made_up_results()["folder"]}
    summary = benchmark.summarize(bench_args(sources="folder"), folder_only, {}, 81.2, 480)
    assert summary["folder_single_images_per_s"] == 36.0 and summary["folder_ddp_images_per_s"] == pytest.approx(34.2)
    assert summary["single_images_per_s"] is summary["pipeline_ratio"] is summary["allreduce_s"] is None
    json.dumps(summary)
