"""Train an image classifier in one process, on one GPU or on the CPU.

    python train_single_gpu.py                                  # the built-in demo data
    python train_single_gpu.py --data-path flower_photos --weights resnet34-333f7ec4.pth

The two multi-process scripts are this recipe plus what DDP adds; diff them against this one.
"""

from multi_train_utils.errors import quiet_ctrl_c_while_starting

quiet_ctrl_c_while_starting()  # first: the imports below take seconds, and Ctrl-C meanwhile says one line

import torch

from model import build_criterion, build_model
from multi_train_utils.cli import run_cli
from multi_train_utils.config import RunConfig
from multi_train_utils.data import build_loaders, seed_everything
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.optim import StepOptions, build_optimizer, build_scheduler, optimizer_steps_per_epoch, scaled_lr
from multi_train_utils.recorder import RunRecorder, find_saved_run
from multi_train_utils.train_eval_utils import evaluate_only, fit
from utils import build_datasets, read_data


def main(args: RunConfig) -> None:
    ctx = single_process(args.device)
    print(f"Running in one process on {ctx.runs_on}")
    seed_everything(args.seed)
    saved = find_saved_run(args.resume, args.output_dir)  # a resumed run keeps its classes and split
    data = read_data(args.data_path, ctx, args.seed, args.num_classes, saved.split)
    train_set, val_set = build_datasets(data, args.image_size, args.decode_on, ctx.device)
    train_loader, val_loader = build_loaders(train_set, val_set, args.batch_size, ctx, args.workers, args.seed)
    # Checked first: the model trains on batches of this size (BatchNorm needs 2 images) and images this large.
    model = build_model(args.model, data.num_classes, args.weights, strict=args.eval_only,
                        trains_on=(args.batch_size, args.image_size))
    options = StepOptions.from_args(args, ctx.device, data.num_classes)  # --amp, --accum-steps, MixUp, ...
    model = model.to(ctx.device, memory_format=options.memory_format)
    if args.compile:
        model = torch.compile(model)
    criterion = build_criterion(args.label_smoothing)  # for training and validation
    if args.eval_only:  # validate the weights once and print the figures; nothing is trained or written
        evaluate_only(model, criterion, val_loader, ctx.device, options, data.class_names)
        return
    # Each optimizer step now learns from accum_steps batches (see the multi-process scripts for why).
    optimizer = build_optimizer(model, args.opt, scaled_lr(args.lr, 1, args.accum_steps), args.weight_decay)
    steps_per_epoch = optimizer_steps_per_epoch(len(train_loader), args.accum_steps)  # the lr moves every step
    scheduler = build_scheduler(optimizer, args.sched, args.epochs, steps_per_epoch, args.warmup_epochs, args.lrf)
    with RunRecorder(args, ctx, data, saved) as run:
        fit(model, criterion, optimizer, train_loader, val_loader, ctx.device, args.epochs, scheduler, options, run)


if __name__ == "__main__":
    run_cli(main, "single")
