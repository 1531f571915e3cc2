"""Train with DistributedDataParallel, one process per GPU (or several on a CPU), started by a launcher.

    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --data-path flower_photos
    python -m torch.distributed.launch --nproc_per_node=2 --use_env train_multi_gpu_using_launch.py
    srun --ntasks-per-node=8 --gpus-per-node=8 python train_multi_gpu_using_launch.py   # SLURM
    python train_multi_gpu_using_launch.py                                       # one process

The launcher starts the processes and tells each its rank through RANK, WORLD_SIZE and LOCAL_RANK.
"""

from multi_train_utils.errors import quiet_ctrl_c_while_starting

quiet_ctrl_c_while_starting()  # first: the imports below take seconds, and Ctrl-C meanwhile says one line

from model import build_criterion, build_model
from multi_train_utils.cli import run_cli
from multi_train_utils.config import RunConfig
from multi_train_utils.data import build_loaders, seed_everything
from multi_train_utils.distributed_utils import (
    DistContext,
    batchnorm_batch_size,
    cleanup,
    init_distributed_mode,
    print_main,
    wrap_ddp,
)
from multi_train_utils.optim import StepOptions, build_optimizer, build_scheduler, optimizer_steps_per_epoch, scaled_lr
from multi_train_utils.recorder import RunRecorder, find_saved_run
from multi_train_utils.train_eval_utils import evaluate_only, fit
from utils import build_datasets, read_data


def main(args: RunConfig) -> None:
    ctx = init_distributed_mode(args.device, args.dist_url, args.dist_timeout)
    train(args, ctx)
    cleanup()  # should train() fail, run_cli leaves the process group instead, and no rank is left waiting


def train(args: RunConfig, ctx: DistContext) -> None:
    print_main(f"Running in {ctx.world_size} process(es) on {ctx.runs_on}")
    # Each rank seeds differently so that their augmentations differ; DDP gives them the same weights.
    seed_everything(args.seed, ctx.rank)
    saved = find_saved_run(args.resume, args.output_dir)  # a resumed run keeps its classes and split
    data = read_data(args.data_path, ctx, args.seed, args.num_classes, saved.split)
    train_set, val_set = build_datasets(data, args.image_size, args.decode_on, ctx.device)
    # Each process trains on its own 1/world_size of every epoch (a DistributedSampler).
    train_loader, val_loader = build_loaders(train_set, val_set, args.batch_size, ctx, args.workers, args.seed)
    # Checked first: BatchNorm normalises this process's batch (with --syncBN on GPUs, every process's).
    model = build_model(args.model, data.num_classes, args.weights, strict=args.eval_only,
                        trains_on=(batchnorm_batch_size(args.batch_size, ctx, args.syncBN), args.image_size))
    options = StepOptions.from_args(args, ctx.device, data.num_classes)  # --amp, --accum-steps, MixUp, ...
    model = model.to(ctx.device, memory_format=options.memory_format)
    # DDP's own keyword arguments go through: a body frozen while DDP all-reduces leaves unused parameters.
    model = wrap_ddp(model, ctx, args.syncBN, args.compile, args.comm_hook, bucket_cap_mb=args.bucket_cap_mb,
                     find_unused_parameters=args.freeze_layers)
    criterion = build_criterion(args.label_smoothing)  # for training and validation
    if args.eval_only:  # validate the weights once and print the figures; nothing is trained or written
        evaluate_only(model, criterion, val_loader, ctx.device, options, data.class_names)
        return
    # A step learns from world_size x accum_steps batches: a proportionally larger lr (Goyal et al. 2017).
    lr = scaled_lr(args.lr, ctx.world_size, args.accum_steps)
    print_main(f"lr {args.lr} x {ctx.world_size} process(es) x {args.accum_steps} accumulated batch(es) = {lr:g}")
    optimizer = build_optimizer(model, args.opt, lr, args.weight_decay)
    steps_per_epoch = optimizer_steps_per_epoch(len(train_loader), args.accum_steps)  # the lr moves every step
    scheduler = build_scheduler(optimizer, args.sched, args.epochs, steps_per_epoch, args.warmup_epochs, args.lrf)
    with RunRecorder(args, ctx, data, saved) as run:
        fit(model, criterion, optimizer, train_loader, val_loader, ctx.device, args.epochs, scheduler, options, run)


if __name__ == "__main__":
    run_cli(main, "launch")
