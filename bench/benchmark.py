"""How fast does the engine train, in one process and in N, and what holds N processes back?

    python bench/benchmark.py                                   # about 3 minutes on a 2-core CPU
    python bench/benchmark.py --model resnet34 --image-size 128 --batch-size 16 --nproc 2
    python bench/benchmark.py --device cuda --image-size 224 --amp bf16 --channels-last

Every figure comes from the real engine (`train_one_epoch`, the real DDP wrapper, the real data
pipeline), timed over --steps batches after --warmup-steps, each configuration in fresh processes:

  single  one process using every core (or one GPU)
  ddp     --nproc DDP processes, the cores split between them
  nosync  the same N processes with DDP's no_sync on every step: nothing is all-reduced, so this is
          what N processes would reach if communication were free
  checked (with --check-collectives) the ddp processes under the training scripts' --check-collectives:
          PyTorch checks every collective against the other ranks' first; check_overhead is its cost

each on (a) synthetic tensors already in memory and (b) an image folder through the real loader. Then
the time from launch to the first finished step, for torchrun and for spawn. The last line of stdout is
one JSON object with every figure; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/benchmark.py` from anywhere; the imports below need it

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from bench.loader_benchmark import loader_benchmark
from model import build_criterion, build_model
from multi_train_utils.cli import OneLineErrorParser, at_least, default_config, positive_float, str2bool
from multi_train_utils.data import build_loaders
from multi_train_utils.distributed_utils import (
    COMM_HOOKS,
    DistContext,
    barrier,
    cleanup,
    init_distributed_mode,
    single_process,
    wrap_ddp,
)
from multi_train_utils.errors import UserInputError, one_line, report
from multi_train_utils.launch import CHECK_COLLECTIVES_VARIABLE, cpu_share
from multi_train_utils.optim import AMP_CHOICES, StepOptions, build_optimizer
from multi_train_utils.spawn_utils import meeting_on_a_free_port
from multi_train_utils.train_eval_utils import train_one_epoch
from utils import build_datasets, ensure_demo_data, read_data

PHOTOS_ROOT = REPO / "data" / "bench_photos"
PHOTO_SIZE = (400, 300)  # about the size of the photographs in the tutorial's flower_photos
MODES = ("single", "ddp", "nosync")
SOURCES = ("synthetic", "folder")
PROBE_TIMEOUT_S = 600
CRITERION = build_criterion()  # the scripts' loss: any model they train, the benchmark measures


def get_args_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--nproc", type=at_least(1), default=2, help="DDP processes to compare with one process (1: one process "
        "only, as on a machine with one GPU)")
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--model", default="resnet34")
    add("--image-size", type=at_least(16), default=64)
    add("--batch-size", type=at_least(1), default=16, help="images per batch in each process")
    add("--steps", type=at_least(1), default=None, help="timed batches per process in each repeat (default: 6 "
        "on a CPU, 50 on a GPU, where a step takes milliseconds)")
    add("--warmup-steps", type=at_least(0), default=None, help="batches before the clock starts (default: 2 on a "
        "CPU, 20 on a GPU; the image folder adds two per data-loader worker, to drain the batches they made early)")
    add("--repeats", type=at_least(1), default=2, help="timed runs of --steps in each start of a configuration, "
        "one after the other from the same data iterator")
    add("--rounds", type=at_least(1), default=2, help="starts of every configuration, taken in turn (single, ddp, "
        "nosync, single, ...), so that a slow spell of the machine hits all of them alike")
    add("--data-path", default=None, help="image folder for (b); default: the demo data at photo size, "
        f"{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEGs, written once to {PHOTOS_ROOT.relative_to(REPO)}")
    add("--workers", type=at_least(0), default=None, help="data-loader processes per process (default: the "
        "training scripts' default)")
    add("--amp", default="off", choices=AMP_CHOICES)
    add("--channels-last", type=str2bool, nargs="?", const=True, default=False)
    add("--compile", type=str2bool, nargs="?", const=True, default=False,
        help="torch.compile the model; give --warmup-steps enough to cover the compiling")
    add("--accum-steps", type=at_least(1), default=1, help="batches per optimizer step (and per all-reduce)")
    add("--bucket-cap-mb", type=positive_float, default=25.0)
    add("--comm-hook", default="none", choices=COMM_HOOKS)
    add("--decode-on", choices=("cpu", "gpu"), default="cpu", help="where the image folder's JPEGs are decoded")
    add("--sources", default=",".join(SOURCES), choices=("synthetic,folder", "synthetic", "folder"), metavar="SOURCES",
        help="what to train on: tensors already in memory, the image folder, or both")
    add("--skip-launch", action="store_true", help="do not measure the time to the first step")
    add("--check-collectives", action="store_true", help="also time the ddp processes under the training scripts' "
        "--check-collectives (mode checked), for check_overhead: what the check of every collective costs")
    add("--loader-only", action="store_true", help="time the data loader alone, no model: images/s per worker "
        "(--workers, default 1; 0: this process alone) of the default pipeline and of the tutorial's, on "
        "--data-path's training images with the training augmentation at --image-size")
    add("--output", default=None, help="also write the JSON, indented, to this file")
    # Internal: the time-to-first-step probe runs this file again, under torchrun or as a spawn parent.
    add("--probe", choices=("torchrun", "spawn"), default=None, help=argparse.SUPPRESS)
    add("--probe-dir", default=None, help=argparse.SUPPRESS)
    return parser


class Batches:
    """`count` batches from `loader`, going on into further epochs if one epoch holds fewer."""

    def __init__(self, loader: torch.utils.data.DataLoader, count: int) -> None:
        self.loader, self.count = loader, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator:
        given, epoch = 0, 0
        while given < self.count:
            if hasattr(self.loader.sampler, "set_epoch"):
                self.loader.sampler.set_epoch(epoch)
            for batch in self.loader:
                yield batch
                given += 1
                if given == self.count:
                    return
            epoch += 1


def ensure_photo_folder(root: Path = PHOTOS_ROOT) -> Path:
    """The demo pictures enlarged to photo size and saved as JPEGs, so that decoding and resizing cost
    what they cost on photographs, not on 64-pixel tiles."""
    if (root / ".complete").is_file():
        return root
    for source in sorted(ensure_demo_data().glob("*/*")):
        target = root / source.parent.name / (source.stem + ".jpg")
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(source) as image:
            image.convert("RGB").resize(PHOTO_SIZE, Image.BICUBIC).save(target, quality=90)
    (root / ".complete").touch()
    return root


def synthetic_loader(args: argparse.Namespace, ctx: DistContext, num_classes: int, count: int) -> list:
    """One batch made once and handed out `count` times: no decoding, no copying, nothing to wait for.
    uint8 pixels like the real loader's, so the step converts and normalises them as it does those."""
    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8)
    labels = torch.randint(0, num_classes, (args.batch_size,))
    if ctx.device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    return [(images, labels)] * count


def training_setup(args: argparse.Namespace, ctx: DistContext, num_classes: int,
                   ) -> tuple[torch.nn.Module, torch.optim.Optimizer, StepOptions]:
    """Model, optimizer and step options, built as the training scripts build them, from the benchmark's flags."""
    options = StepOptions.from_args(default_config(amp=args.amp, channels_last=args.channels_last,
                                                   accum_steps=args.accum_steps, comm_hook=args.comm_hook), ctx.device)
    model = build_model(args.model, num_classes).to(ctx.device, memory_format=options.memory_format)
    model = wrap_ddp(model, ctx, compile_model=args.compile, bucket_cap_mb=args.bucket_cap_mb,
                     comm_hook=args.comm_hook)
    optimizer = build_optimizer(model, lr=1e-3)
    return model, optimizer, options


def measure(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Train --warmup-steps, then --repeats times --steps batches, all from one data iterator, in one
    configuration; write this rank's figures."""
    if args.mode == "single":
        ctx = single_process(args.device)
        if ctx.device.type == "cpu":
            torch.set_num_threads(cpu_share(1))
    else:
        if args.mode == "checked":  # as the flag sets it for the training scripts; read where the processes meet
            os.environ[CHECK_COLLECTIVES_VARIABLE] = "DETAIL"
        ctx = init_distributed_mode(args.device, spawn_rank=rank, spawn_world_size=world_size)
    try:
        torch.manual_seed(rank)
        batches, num_classes, warmup_steps = training_batches(args, ctx)
        model, optimizer, options = training_setup(args, ctx, num_classes)
        options.sync_gradients = args.mode != "nosync"
        if warmup_steps:
            train_one_epoch(model, CRITERION, optimizer, Take(batches, warmup_steps), ctx.device, epoch=0,
                            options=options)
        seconds = []
        for repeat in range(args.repeats):
            synchronize(ctx)
            started = time.perf_counter()
            train_one_epoch(model, CRITERION, optimizer, Take(batches, args.steps), ctx.device, epoch=1 + repeat,
                            options=options)
            synchronize(ctx)
            seconds.append(time.perf_counter() - started)
        figures = {"seconds": seconds, "images": args.steps * args.batch_size, "peak_memory_mb": peak_memory_mb(ctx),
                   "checked": dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL}
        if args.mode == "ddp":
            figures["allreduce_s"] = time_all_reduce(model, args.comm_hook)
        (Path(args.result_dir) / f"{args.mode}_{args.source}_rank{rank}.json").write_text(json.dumps(figures))
    finally:
        cleanup()


def training_batches(args: argparse.Namespace, ctx: DistContext) -> tuple[Iterator, int, int]:
    """One iterator over every batch this configuration trains on, the number of classes, and the
    warm-up steps. Data-loader workers start by filling their queue (two batches each) while the model is
    built; the warm-up drains those, so the clock sees the workers' steady pace, not their head start."""
    total = args.warmup_steps + args.repeats * args.steps
    if args.source == "synthetic":
        return iter(synthetic_loader(args, ctx, 5, total)), 5, args.warmup_steps
    data = read_data(args.data_path, ctx)
    train_set, val_set = build_datasets(data, args.image_size, args.decode_on, ctx.device)
    loader, _ = build_loaders(train_set, val_set, args.batch_size, ctx, args.workers)
    warmup_steps = args.warmup_steps + 2 * loader.num_workers
    return iter(Batches(loader, total + 2 * loader.num_workers)), data.num_classes, warmup_steps


class Take:
    """The next `count` batches of `batches`, with a length, as the training loop wants a loader."""

    def __init__(self, batches: Iterator, count: int) -> None:
        self.batches, self.count = batches, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator:
        return itertools.islice(self.batches, self.count)


def synchronize(ctx: DistContext) -> None:
    """Wait for the GPU and for the other processes, so the clock brackets everyone's work."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    barrier()


def time_all_reduce(model: torch.nn.Module, comm_hook: str, repeats: int = 3) -> float:
    """Seconds to all-reduce one step's worth of gradients once, alone (no compute beside it), in the
    dtype the communication hook sends."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[comm_hook]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    dist.all_reduce(flat)  # the first one sets up the connection buffers
    if flat.is_cuda:
        torch.cuda.synchronize()  # NCCL returns before the all-reduce is done
    barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flat)
    if flat.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def peak_memory_mb(ctx: DistContext) -> float:
    if ctx.device.type == "cuda":
        return torch.cuda.max_memory_allocated(ctx.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def run_configuration(args: argparse.Namespace, mode: str, source: str, result_dir: Path) -> dict:
    """Start fresh processes for one configuration and combine their figures: images/s of each repeat
    (every process's images over the time of the slowest), peak memory, all-reduce time."""
    nprocs = 1 if mode == "single" else args.nproc
    config = argparse.Namespace(**vars(args), mode=mode, source=source, result_dir=str(result_dir))
    # fork on a Linux CPU: the processes start in a moment instead of importing torch again (what they time
    # starts after start-up either way; the launch probes time the real spawn). CUDA does not survive a fork.
    fork = sys.platform == "linux" and args.device == "cpu"
    with meeting_on_a_free_port():
        mp.start_processes(measure, args=(nprocs, config), nprocs=nprocs, start_method="fork" if fork else "spawn")
    ranks = [json.loads((result_dir / f"{mode}_{source}_rank{r}.json").read_text()) for r in range(nprocs)]
    if any(rank["checked"] != (mode == "checked") for rank in ranks):  # or check_overhead would compare like with like
        raise RuntimeError(f"mode {mode}: PyTorch's check of the collectives is {'off' if mode == 'checked' else 'on'}")
    images = sum(r["images"] for r in ranks)
    figures = {"images_per_s": [images / max(times) for times in zip(*(r["seconds"] for r in ranks), strict=True)],
               "peak_memory_mb": max(r["peak_memory_mb"] for r in ranks)}
    if mode == "ddp":
        figures["allreduce_s"] = [max(r["allreduce_s"] for r in ranks)]
    print(f"{mode:>6} {source:>9}: {statistics.median(figures['images_per_s']):7.1f} images/s "
          f"({', '.join(f'{x:.1f}' for x in figures['images_per_s'])}), peak {figures['peak_memory_mb']:.0f} MB "
          "per process", file=sys.stderr, flush=True)
    return figures


def add_round(results: dict[str, dict], round_figures: dict[str, dict]) -> None:
    """Add one round's figures of every configuration to those of the rounds before."""
    for mode, figures in round_figures.items():
        if mode not in results:
            results[mode] = {"images_per_s": [], "allreduce_s": [], "peak_memory_mb": 0.0}
        results[mode]["images_per_s"] += figures["images_per_s"]
        results[mode]["allreduce_s"] += figures.get("allreduce_s", [])
        results[mode]["peak_memory_mb"] = max(results[mode]["peak_memory_mb"], figures["peak_memory_mb"])


def probe_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One training step under a real launcher; records when it finished."""
    ctx = init_distributed_mode(args.device, spawn_rank=rank if args.probe == "spawn" else None,
                                spawn_world_size=world_size if args.probe == "spawn" else None)
    try:
        model, optimizer, options = training_setup(args, ctx, num_classes=5)
        train_one_epoch(model, CRITERION, optimizer, synthetic_loader(args, ctx, 5, count=1), ctx.device, 0,
                        options=options)
        synchronize(ctx)
        (Path(args.probe_dir) / f"rank{ctx.rank}").write_text(str(time.time()))
    finally:
        cleanup()


def time_to_first_step(args: argparse.Namespace, launcher: str, probe_dir: Path) -> float:
    """Seconds from starting the launcher's command to the first step finished on every process."""
    own_flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("device", "model", "image_size", "batch_size", "amp", "channels_last", "compile",
                          "bucket_cap_mb", "comm_hook")]
    probe = [__file__, *own_flags, f"--probe={launcher}", f"--probe-dir={probe_dir}"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               *probe]
    else:
        cmd = [sys.executable, *probe, f"--nproc={args.nproc}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    started = time.time()
    launcher_process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        exit_code = launcher_process.wait(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        exit_code = None
    finally:
        # SIGTERM first: torchrun and the spawn script then stop their workers, which a SIGKILL would orphan.
        stop_process(launcher_process)
    if exit_code != 0:
        raise SystemExit(f"error: the {launcher} probe " + (f"ran past {PROBE_TIMEOUT_S} s" if exit_code is None
                                                             else f"failed (exit {exit_code})"))
    seconds = max(float(path.read_text()) for path in probe_dir.iterdir()) - started
    print(f"{launcher:>8}: first step done {seconds:.1f} s after launch", file=sys.stderr, flush=True)
    return seconds


def stop_process(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def machine() -> dict:
    """What the figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor(), "cores": cpu_share(1),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version()}


def benchmark(args: argparse.Namespace) -> dict:
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise UserInputError(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPU(s) visible "
                             "(NCCL needs one GPU per process)")
    if args.data_path is None:
        args.data_path = str(ensure_photo_folder())
    on_gpu = args.device == "cuda"
    args.steps = args.steps or (50 if on_gpu else 6)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (20 if on_gpu else 2)
    results: dict[str, dict[str, dict]] = {source: {} for source in SOURCES}
    with tempfile.TemporaryDirectory() as scratch:
        modes = (*MODES, *["checked"] * args.check_collectives) if args.nproc > 1 else ("single",)
        for _ in range(args.rounds):
            for source in args.sources.split(","):
                add_round(results[source], {mode: run_configuration(args, mode, source, Path(scratch))
                                            for mode in modes})
        launch = {}
        if not args.skip_launch:
            for launcher in ("torchrun", "spawn"):
                probe_dir = Path(scratch) / launcher
                probe_dir.mkdir()
                launch[launcher] = time_to_first_step(args, launcher, probe_dir)
    gradient_mb = sum(p.numel() * 4 for p in build_model(args.model, 5).parameters()) / 2**20
    train_images = len(read_data(args.data_path, single_process("cpu")).train_images_path)
    return summarize(args, results, launch, gradient_mb, train_images)


def spread(values: list[float] | None) -> list[float] | None:
    """[min, median, max]: a difference smaller than this spread is noise."""
    return [min(values), statistics.median(values), max(values)] if values else None


def paired_ratios(numerators: list[float] | None, denominators: list[float] | None) -> list[float] | None:
    """The ratio of each repeat to the repeat of the other configuration taken at the same point of the
    same round: the two ran minutes apart at most, so drift of the machine cancels out."""
    if not numerators or not denominators:
        return None
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def images_per_step(args: argparse.Namespace, mode: str) -> int:
    return args.batch_size * (1 if mode == "single" else args.nproc)


def summarize(args: argparse.Namespace, results: dict[str, dict[str, dict]], launch: dict[str, float],
              gradient_mb: float, train_images: int) -> dict:
    """The median figures of every configuration, the ratios between them, and the spread of each, as one
    JSON-ready dict; None for what was not measured (ddp and nosync with --nproc 1)."""
    synthetic, folder = results["synthetic"], results["folder"]

    def speeds(figures: dict[str, dict], mode: str) -> list[float] | None:
        return figures[mode]["images_per_s"] if mode in figures else None

    lists = {
        "single_images_per_s": speeds(synthetic, "single"), "ddp_images_per_s": speeds(synthetic, "ddp"),
        "nosync_images_per_s": speeds(synthetic, "nosync"),
        "scaling_efficiency": paired_ratios(speeds(synthetic, "ddp"), speeds(synthetic, "single")),
        "comm_overhead": [1 - r for r in paired_ratios(speeds(synthetic, "ddp"), speeds(synthetic, "nosync")) or []],
        "pipeline_ratio": paired_ratios(speeds(folder, "ddp"), speeds(synthetic, "ddp")),
        "pipeline_ratio_single": paired_ratios(speeds(folder, "single"), speeds(synthetic, "single")),
        "folder_single_images_per_s": speeds(folder, "single"), "folder_ddp_images_per_s": speeds(folder, "ddp"),
        "folder_nosync_images_per_s": speeds(folder, "nosync"),
        "folder_scaling_efficiency": paired_ratios(speeds(folder, "ddp"), speeds(folder, "single")),
        "checked_images_per_s": speeds(synthetic, "checked"),
        "check_overhead": [1 - r for r in paired_ratios(speeds(synthetic, "checked"), speeds(synthetic, "ddp")) or []],
    }
    medians = {key: statistics.median(values) if values else None for key, values in lists.items()}

    def epoch_time(mode: str) -> float | None:
        speed = medians[f"folder_{mode}_images_per_s"]
        return train_images / speed if speed else None

    return {
        **medians,
        "world_size": args.nproc,
        "time_to_first_step_s": launch,
        "peak_memory_mb": {mode: figures["peak_memory_mb"] for mode, figures in synthetic.items()},
        "step_time_s": {mode: images_per_step(args, mode) / medians[f"{mode}_images_per_s"] for mode in synthetic},
        # What the README's explanation of the limit needs: the bytes each step all-reduces, and how long
        # one all-reduce of them takes alone.
        "gradient_mb": gradient_mb,
        "allreduce_s": statistics.median(synthetic["ddp"]["allreduce_s"]) if "ddp" in synthetic else None,
        # An epoch of the image folder's training split, at the folder's speed.
        "epoch_time_s": {"images": train_images, "single": epoch_time("single"), "ddp": epoch_time("ddp")},
        # Every figure above as [min, median, max] over all repeats of all rounds.
        "spread": {key: spread(values) for key, values in lists.items()},
        "workload": {k: v for k, v in vars(args).items() if k not in ("probe", "probe_dir", "skip_launch", "output")},
        "machine": machine(),
    }


def main() -> None:
    try:
        args = get_args_parser().parse_args()
        if args.probe == "torchrun":
            probe_worker(0, 0, args)
        elif args.probe == "spawn":
            with meeting_on_a_free_port():
                mp.spawn(probe_worker, args=(args.nproc, args), nprocs=args.nproc)
        elif args.loader_only:
            data_path = args.data_path or str(ensure_photo_folder())
            figures = loader_benchmark(data_path, args.image_size, 1 if args.workers is None else args.workers,
                                       args.repeats)
            print(json.dumps(figures), flush=True)
        else:
            figures = benchmark(args)
            if args.output:
                Path(args.output).parent.mkdir(parents=True, exist_ok=True)
                Path(args.output).write_text(json.dumps(figures, indent=2) + "\n")
            print(json.dumps(figures), flush=True)
    except UserInputError as err:
        report(f"error: {one_line(err)}")
        sys.exit(2)


if __name__ == "__main__":
    main()
