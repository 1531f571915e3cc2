"""Functions that run inside processes started by the DDP tests (top-level, so that spawn can pickle them)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from multi_train_utils.data import UnpaddedDistributedSampler
from multi_train_utils.distributed_utils import DistContext, cleanup, init_distributed_mode, wrap_ddp
from multi_train_utils.train_eval_utils import build_optimizer, evaluate, train_one_epoch

EPOCHS = 3


def small_net(batchnorm: bool = False) -> nn.Module:
    """Without BatchNorm by default: on a CPU, BatchNorm statistics stay per process (no SyncBatchNorm)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm2d(6)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(3, 6, 3), *norm, nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(24, 3))


def fixed_data(count: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(count, 3, 8, 8, generator=generator),
                         torch.randint(0, 3, (count,), generator=generator))


def train_fixed_order(ctx: DistContext, batch_size: int, samples: int, sync_bn: bool = False) -> nn.Module:
    """Train with the engine's own loop on samples dealt in a fixed order: step k of rank r takes
    indices r, r+N, r+2N, ... of block k, so the N ranks together see exactly what one process with
    batch N*b sees in its step k."""
    dataset = fixed_data(samples)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = wrap_ddp(small_net(batchnorm=sync_bn).to(ctx.device), ctx, sync_bn=sync_bn)
    optimizer, scheduler = build_optimizer(model, lr=0.05, epochs=EPOCHS)
    for epoch in range(EPOCHS):
        train_one_epoch(model, optimizer, loader, ctx.device, epoch)
        scheduler.step()
    return model.module if ctx.distributed else model


def equal_weights_worker(rank: int, world_size: int, batch_size: int, samples: int, out: str,
                         device: str = "cpu", sync_bn: bool = False) -> None:
    ctx = init_distributed_mode(device, spawn_rank=rank, spawn_world_size=world_size)
    try:
        model = train_fixed_order(ctx, batch_size, samples, sync_bn)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(out) / f"rank{rank}.pth")
    finally:
        cleanup()


def evaluation_loader(ctx: DistContext, count: int) -> DataLoader:
    dataset = fixed_data(count)
    return DataLoader(dataset, batch_size=2, sampler=UnpaddedDistributedSampler(count, ctx.world_size, ctx.rank))


def exact_evaluation_worker(rank: int, world_size: int, sizes: list[int], out: str) -> None:
    ctx = init_distributed_mode("cpu", spawn_rank=rank, spawn_world_size=world_size)
    try:
        model = wrap_ddp(small_net(), ctx)
        results = {count: evaluate(model, evaluation_loader(ctx, count), ctx.device) for count in sizes}
        torch.save({count: (r.correct, r.total, r.loss) for count, r in results.items()},
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
