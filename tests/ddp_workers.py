"""Functions that run inside processes started by the DDP tests (top-level, so that spawn can pickle them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multi_train_utils.data import UnpaddedDistributedSampler
from multi_train_utils.distributed_utils import DistContext, cleanup, init_distributed_mode, unwrap_model, wrap_ddp
from multi_train_utils.optim import StepOptions, build_optimizer, build_scheduler
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch

EPOCHS = 3
CROSS_ENTROPY = nn.CrossEntropyLoss()


def small_net(batchnorm: bool = False) -> nn.Module:
    """Without BatchNorm by default: on a CPU, BatchNorm statistics stay per process (no SyncBatchNorm)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm2d(6)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(3, 6, 3), *norm, nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(24, 3))


def exact_gpu_math() -> None:
    """Full float32 on GPUs, with fixed convolution algorithms, so that GPU results compare to 1e-5: TF32
    rounds matrix products to 10 bits, and cudnn.benchmark may pick a different algorithm per process."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def fixed_data(count: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(count, 3, 8, 8, generator=generator),
                         torch.randint(0, 3, (count,), generator=generator))


def count_all_reduces(model: nn.Module) -> list[int]:
    """Make DDP count the gradient all-reduces it runs; returns the one-element counter."""
    calls = [0]

    # No annotations: DDP checks them, and `from __future__ import annotations` turns them into strings.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    return calls


def train_fixed_order(ctx: DistContext, batch_size: int, samples: int, sync_bn: bool = False,
                      options: StepOptions | None = None, comm_hook: str = "none",
                      count: bool = False) -> tuple[nn.Module, int]:
    """Train with the engine's own loop on samples dealt in a fixed order: step k of rank r takes
    indices r, r+N, r+2N, ... of block k, so the N ranks together see exactly what one process with
    batch N*b sees in its step k (and with K accumulated batches, what it sees in K of its steps).
    Returns the plain model and, with `count`, the number of gradient all-reduces DDP ran (counting puts
    a hook in place of DDP's built-in all-reduce; 0 without `count`)."""
    dataset = fixed_data(samples)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = wrap_ddp(small_net(batchnorm=sync_bn).to(ctx.device), ctx, sync_bn=sync_bn, comm_hook=comm_hook)
    all_reduces = count_all_reduces(model) if count else [0]
    optimizer = build_optimizer(model, lr=0.05)
    scheduler = build_scheduler(optimizer, epochs=EPOCHS)  # stepped once an epoch here
    for epoch in range(EPOCHS):
        train_one_epoch(model, CROSS_ENTROPY, optimizer, loader, ctx.device, epoch, options=options)
        scheduler.step()
    return unwrap_model(model), all_reduces[0]


@dataclass(frozen=True)
class Case:
    """One way to train the small net in the equal-weights worker."""

    batch_size: int = 4
    accum_steps: int = 1
    comm_hook: str = "none"
    sync_gradients: bool = True
    sync_bn: bool = False
    count_all_reduces: bool = False


def equal_weights_worker(rank: int, world_size: int, samples: int, out: str, cases: dict[str, Case],
                         device: str = "cpu") -> None:
    """Train each case in turn in one process group (one start-up for them all); save rank{r}_{name}.pth."""
    ctx = init_distributed_mode(device, spawn_rank=rank, spawn_world_size=world_size)
    exact_gpu_math()
    try:
        for name, case in cases.items():
            options = StepOptions(ctx.device.type, accum_steps=case.accum_steps, sync_gradients=case.sync_gradients)
            model, all_reduces = train_fixed_order(ctx, case.batch_size, samples, case.sync_bn, options,
                                                   case.comm_hook, case.count_all_reduces)
            torch.save({"weights": {k: v.cpu() for k, v in model.state_dict().items()}, "all_reduces": all_reduces},
                       Path(out) / f"rank{rank}_{name}.pth")
    finally:
        cleanup()


def evaluation_loader(ctx: DistContext, count: int) -> DataLoader:
    dataset = fixed_data(count)
    return DataLoader(dataset, batch_size=2, sampler=UnpaddedDistributedSampler(count, ctx.world_size, ctx.rank))


def skew_batchnorm(model: nn.Module, rank: int) -> nn.Module:
    """Running statistics of this rank's own, as each rank's BatchNorm has after training on its own batches."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.fill_(0.1 + 2.0 * rank)
            module.running_var.fill_(1.0 + rank)
    return model


def exact_evaluation_worker(rank: int, world_size: int, sizes: list[int], out: str) -> None:
    ctx = init_distributed_mode("cpu", spawn_rank=rank, spawn_world_size=world_size)
    try:
        model = wrap_ddp(small_net(batchnorm=True), ctx)
        skew_batchnorm(unwrap_model(model), rank)
        results = {count: evaluate(model, CROSS_ENTROPY, evaluation_loader(ctx, count), ctx.device, num_classes=3)
                   for count in sizes}
        torch.save({count: (r.figures(), r.sums["confusion"].tolist()) for count, r in results.items()},
                   Path(out) / f"eval_rank{rank}.pth")
    finally:
        cleanup()


def all_reduce_worker(rank: int, world_size: int, args: object) -> None:
    """The smallest real job: join the group, add up the ranks, leave."""
    init_distributed_mode("cpu", spawn_rank=rank, spawn_world_size=world_size)
    try:
        total = torch.tensor([float(rank)])
        torch.distributed.all_reduce(total)
        assert total.item() == sum(range(world_size))
    finally:
        cleanup()


def listing_worker(rank: int, world_size: int, data: str, out: str) -> None:
    """utils.read_data on every rank, counting who reads the folder."""
    import utils

    ctx = init_distributed_mode("cpu", spawn_rank=rank, spawn_world_size=world_size)
    reads = []
    real = utils.read_split_data
    utils.read_split_data = lambda *args, **kwargs: reads.append(1) or real(*args, **kwargs)
    try:
        split = utils.read_data(data, ctx)
        seen = {"reads": len(reads), "train": list(split.train_images_path)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        cleanup()
