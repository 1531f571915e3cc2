"""Train an image classifier in one process, on one GPU or on the CPU.

    python train_single_gpu.py                                  # the built-in demo data
    python train_single_gpu.py --data-path flower_photos --weights resnet34-333f7ec4.pth

The two multi-process scripts are this recipe plus what DDP adds; diff them against this one.
"""

import argparse

import torch

from model import build_model
from multi_train_utils.checkpoint import find_saved_run
from multi_train_utils.cli import run_cli
from multi_train_utils.data import build_loaders, load_datasets, seed_everything
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.fit import fit
from multi_train_utils.optim import build_optimizer, build_scheduler, optimizer_steps_per_epoch
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.step_options import StepOptions
from multi_train_utils.train_eval_utils import evaluate_only


def main(args: argparse.Namespace) -> None:
    ctx = single_process(args.device)
    print(f"Training in one process on {ctx.device}")
    seed_everything(args.seed)
    saved = find_saved_run(args.resume, args.output_dir, ctx)  # a resumed run keeps its classes and split
    data = load_datasets(args.data_path, args.image_size, ctx, args.num_classes, args.seed, args.decode_on,
                         saved.split)
    train_loader, val_loader = build_loaders(data, args.batch_size, ctx, args.workers, args.seed)
    options = StepOptions.from_args(args, ctx.device)  # --amp, --channels-last, --accum-steps
    model = build_model(args.model, data.num_classes, args.weights, args.freeze_layers, strict=args.eval_only)
    model = model.to(ctx.device, memory_format=options.memory_format)
    if args.compile:
        model = torch.compile(model)
    if args.eval_only:  # validate the weights once and print the figures; nothing is trained or written
        evaluate_only(model, val_loader, ctx.device, options, data.class_names)
        return
    # Each optimizer step now learns from accum_steps batches (see the multi-process scripts for why).
    optimizer = build_optimizer(model, args.opt, args.lr * args.accum_steps, args.weight_decay)
    steps_per_epoch = optimizer_steps_per_epoch(len(train_loader), args.accum_steps)  # the lr moves every step
    scheduler = build_scheduler(optimizer, args.sched, args.epochs, steps_per_epoch, args.warmup_epochs, args.lrf)
    with RunRecorder(args.output_dir, ctx, data.split, vars(args), saved) as recorder:
        fit(model, optimizer, scheduler, train_loader, val_loader, recorder, ctx.device, options, saved)


if __name__ == "__main__":
    run_cli(main, "single")
