"""Find the learning rate: a few dozen steps of the real training step, the lr growing from tiny to huge, and the
--lr to train with (the lr range test, Smith 2017). It takes the training scripts' flags (the model, the data,
--batch-size, --accum-steps, --amp, --clip-grad-norm, ...) and writes nothing.

    python examples/find_lr.py --model resnet18 --steps 50
    torchrun --standalone --nproc_per_node=2 examples/find_lr.py --model resnet18 --steps 50

Each step is train_one_epoch's own (its `max_steps`): precision, accumulation, DDP's averaging, clipping. The
suggestion is an lr of one process's batch, as --lr takes it: the scripts scale it by processes x accumulated
batches (optim.scaled_lr), and so does this search.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import torch

from model import build_criterion, build_model
from multi_train_utils.cli import OneLineErrorParser, at_least, positive_float, run_cli
from multi_train_utils.config import RunConfig
from multi_train_utils.data import build_loaders, seed_everything
from multi_train_utils.distributed_utils import (
    batchnorm_batch_size,
    cleanup,
    init_distributed_mode,
    print_main,
    reduce_value,
    wrap_ddp,
)
from multi_train_utils.errors import UserInputError
from multi_train_utils.optim import Hook, Hooks, StepEnd, StepOptions, build_optimizer, scaled_lr
from multi_train_utils.train_eval_utils import train_one_epoch
from utils import build_datasets, read_data


class Diverged(Exception):
    """The loss ran away: the lrs from here on are too large to tell anything."""


class LossPerStep(Hook):
    """Each step's loss, averaged over the processes (so that every rank decides alike), beside its lr."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def on_step_end(self, step: StepEnd) -> None:
        loss = reduce_value(step.figures["loss"].float().clone()).item()
        self.lrs.append(step.figures["lr"])
        self.losses.append(loss)
        if not math.isfinite(loss) or loss > 4 * min(self.losses):
            raise Diverged


def suggested_lr(lrs: list[float], losses: list[float], smoothing: float = 0.8) -> float:
    """A tenth of the lr where the smoothed loss is lowest: a large lr that still learns steadily. The first
    tenth of the steps is left out: their average rests on too few losses."""
    average, smoothed = 0.0, []
    for count, loss in enumerate(losses, start=1):
        average = smoothing * average + (1 - smoothing) * loss
        smoothed.append(average / (1 - smoothing**count))  # without the pull towards 0 of its first steps
    settled = range(len(smoothed) // 10, len(smoothed))
    return lrs[min(settled, key=smoothed.__getitem__)] / 10


def main(args: RunConfig, finder: argparse.Namespace) -> None:
    ctx = init_distributed_mode(args.device, args.dist_url, args.dist_timeout)
    seed_everything(args.seed, ctx.rank)
    data = read_data(args.data_path, ctx, args.seed, args.num_classes)
    train_set, val_set = build_datasets(data, args.image_size, args.decode_on, ctx.device)
    train_loader, _ = build_loaders(train_set, val_set, args.batch_size, ctx, args.workers, args.seed)
    model = build_model(args.model, data.num_classes, args.weights,
                        trains_on=(batchnorm_batch_size(args.batch_size, ctx, args.syncBN), args.image_size))
    options = StepOptions.from_args(args, ctx.device, data.num_classes)
    model = wrap_ddp(model.to(ctx.device, memory_format=options.memory_format), ctx, args.syncBN, args.compile)
    # The lrs tried are those of one process's batch, as --lr takes them; the step's own is scaled as the scripts do.
    scale = scaled_lr(1.0, ctx.world_size, args.accum_steps)
    optimizer = build_optimizer(model, args.opt, finder.lr_from * scale, args.weight_decay)
    growth = (finder.lr_to / finder.lr_from) ** (1 / max(1, finder.steps - 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: growth**step)
    criterion, record, epoch = build_criterion(args.label_smoothing), LossPerStep(), 0
    try:
        while len(record.losses) < finder.steps:  # as many epochs as the steps take
            train_loader.sampler.set_epoch(epoch)
            train_one_epoch(model, criterion, optimizer, train_loader, ctx.device, epoch, scheduler, options,
                            Hooks([record]), max_steps=finder.steps - len(record.losses))
            epoch += 1
    except Diverged:
        print_main(f"The loss ran away at lr {record.lrs[-1] / scale:.2e}: the search ends there")
    for lr, loss in list(zip(record.lrs, record.losses, strict=True))[::max(1, len(record.losses) // 10)]:
        print_main(f"  --lr {lr / scale:.2e}  loss {loss:.4f}")
    print_main(f"Suggested: --lr {suggested_lr(record.lrs, record.losses) / scale:.2g} (of one process's batch; "
               f"the scripts take steps {scale:g} times larger: {ctx.world_size} process(es) x {args.accum_steps} "
               "accumulated batch(es))")
    cleanup()


def finder_flags() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description="The lr range test; besides these flags, every flag of "
                                "train_multi_gpu_using_launch.py (python train_multi_gpu_using_launch.py --help)")
    parser.add_argument("--steps", type=at_least(2), default=100, help="optimizer steps to try (default 100)")
    parser.add_argument("--lr-from", type=positive_float, default=1e-6, help="the first --lr tried (default 1e-6)")
    parser.add_argument("--lr-to", type=positive_float, default=1.0, help="the last --lr tried (default 1)")
    return parser


def parse_finder_flags() -> tuple[argparse.Namespace, list[str]]:
    """The finder's own flags, and the training flags left for run_cli; a wrong one ends in one line."""
    try:
        finder, training_flags = finder_flags().parse_known_args()
        if finder.lr_from >= finder.lr_to:
            raise UserInputError(f"--lr-from {finder.lr_from:g}: must be below --lr-to {finder.lr_to:g}")
    except UserInputError as err:
        sys.exit(f"error: {err}")
    return finder, training_flags


if __name__ == "__main__":
    finder, training_flags = parse_finder_flags()
    run_cli(functools.partial(main, finder=finder), "launch", training_flags)
