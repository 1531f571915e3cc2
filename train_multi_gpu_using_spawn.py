"""Train with DistributedDataParallel, one process per GPU (or several on a CPU), started by this script.

    python train_multi_gpu_using_spawn.py --world-size 2 --data-path flower_photos

This script starts the processes itself (torch.multiprocessing.spawn) and hands each its rank.
"""

import argparse

from model import build_model
from multi_train_utils.checkpoint import find_saved_run, resume
from multi_train_utils.cli import parse_args, run_cli
from multi_train_utils.data import build_loaders, load_datasets, seed_everything
from multi_train_utils.ddp import wrap_ddp
from multi_train_utils.distributed_utils import (
    DistContext,
    init_distributed_mode,
    leave_process_group_at_exit,
    print_main,
)
from multi_train_utils.ema import build_ema
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.spawn_utils import processes_to_start, spawn_workers
from multi_train_utils.step_options import StepOptions
from multi_train_utils.train_eval_utils import build_optimizer, evaluate_only, fit, optimizer_steps_per_epoch


def main(args: argparse.Namespace) -> None:
    world_size = processes_to_start(args.world_size, args.device)
    spawn_workers(worker, world_size, args)  # runs worker(rank, world_size, args) in each new process


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    ctx = init_distributed_mode(args.device, args.dist_url, args.dist_timeout, rank, world_size)
    with leave_process_group_at_exit(ctx):  # however train() ends, no rank is left waiting
        train(args, ctx)


def train(args: argparse.Namespace, ctx: DistContext) -> None:
    print_main(f"Training in {ctx.world_size} process(es) on {ctx.device.type}")
    # Each rank seeds differently so that their augmentations differ; DDP gives them the same weights.
    seed_everything(args.seed, ctx.rank)
    saved = find_saved_run(args.resume, args.output_dir, ctx)  # a resumed run keeps its classes and split
    data = load_datasets(args.data_path, args.image_size, ctx, args.num_classes, args.seed, args.decode_on,
                         saved.split)
    # Each process trains on its own 1/world_size of every epoch (EpochSampler).
    train_loader, val_loader = build_loaders(data, args.batch_size, ctx, args.workers, args.seed)
    options = StepOptions.from_args(args, ctx.device)  # --amp, --channels-last, --accum-steps
    model = build_model(args.model, data.num_classes, args.weights, args.freeze_layers, strict=args.eval_only)
    model = model.to(ctx.device, memory_format=options.memory_format)
    model = wrap_ddp(model, ctx, args.syncBN, args.compile, args.bucket_cap_mb, args.comm_hook)
    if args.eval_only:  # validate the weights once and print the figures; nothing is trained or written
        evaluate_only(model, val_loader, ctx.device, options, data.class_names)
        return
    # One step now learns from world_size x accum_steps x --batch-size images, so it may take a
    # proportionally larger step (the linear scaling rule, Goyal et al. 2017).
    lr = args.lr * ctx.world_size * args.accum_steps
    print_main(f"lr {args.lr} x {ctx.world_size} process(es) x {args.accum_steps} accumulated batch(es) = {lr:g}")
    steps_per_epoch = optimizer_steps_per_epoch(train_loader, args.accum_steps)  # the lr moves every step
    optimizer, scheduler = build_optimizer(model, lr, args.epochs, args.lrf, args.warmup_epochs, steps_per_epoch)
    # --model-ema: its decay per step, too, follows the batches of one step.
    ema = build_ema(model, args.model_ema, args.model_ema_decay, ctx.world_size * args.accum_steps, saved.state)
    start, best_acc = resume(saved, ctx, model, optimizer, scheduler, options)  # an epoch, or a step inside one
    with RunRecorder(args.output_dir, ctx, data.split, vars(args), start.epoch) as recorder:
        fit(model, optimizer, scheduler, train_loader, val_loader, recorder, args.epochs, ctx.device, start,
            best_acc, options, ema)


if __name__ == "__main__":
    run_cli(main, parse_args("spawn"))
