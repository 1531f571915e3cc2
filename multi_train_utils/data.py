"""From --data-path to data loaders that give each process its own share: the split, the datasets, the samplers."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from demo_data import ensure_demo_data
from my_dataset import MyDataSet, header_problem
from utils import SplitData, data_root, read_split_data, reuse_split

from .distributed_utils import DistContext, barrier, is_dist_avail_and_initialized, print_main
from .errors import UserInputError
from .gpu_decode import gpu_training_set
from .loader_workers import default_workers, leave_signals_to_the_trainer, loader_start_method
from .transforms import build_transforms


@dataclass(frozen=True)
class DataSets:
    train: MyDataSet
    val: MyDataSet
    split: dict[str, list[str]]  # the classes and the split, as a run keeps them (SplitData.to_record)

    @property
    def class_names(self) -> list[str]:
        return self.split["class_names"]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def resolve_data_path(data_path: str | None, ctx: DistContext) -> Path:
    """`--data-path`, or the built-in demo data, written once by one process per machine."""
    if data_path:
        return Path(data_path)
    if ctx.local_rank == 0:
        print_main(f"No --data-path given: training on the built-in demo data in {ensure_demo_data()}")
    barrier()  # the other processes on this machine wait until the files are there
    return ensure_demo_data()  # written by now: finds the folder local rank 0 wrote


def load_datasets(data_path: str | None, image_size: int, ctx: DistContext, num_classes: int | None = None,
                  seed: int = 0, decode_on: str = "cpu", saved_split: dict[str, list[str]] | None = None,
                  ) -> DataSets:
    """Split the data (or keep the split a resumed run saved) and wrap both halves in datasets with their
    transforms. decode_on "gpu": the training images are decoded and augmented on the GPU (gpu_decode.py;
    validation's stay on the workers)."""
    path = resolve_data_path(data_path, ctx)
    split = choose_split(path, seed, saved_split)
    if num_classes is not None and num_classes != split.num_classes:
        raise UserInputError(f"--num_classes {num_classes}: the data in {path} has {split.num_classes} "
                             f"classes ({', '.join(split.class_names)})")
    check_image_files(split.train_images_path + split.val_images_path, ctx)
    print_main(f"{path}: {split.num_classes} classes, {len(split.train_images_path)} images for training, "
               f"{len(split.val_images_path)} for validation")
    train_tf, val_tf = build_transforms(image_size)
    train = MyDataSet(split.train_images_path, split.train_images_label, train_tf)
    train = gpu_training_set(split, image_size, ctx.device, decode_on) or train  # gpu_decode.py: --decode-on gpu
    val = MyDataSet(split.val_images_path, split.val_images_label, val_tf)
    return DataSets(train, val, split.to_record(data_root(path)))


def choose_split(path: Path, seed: int, saved_split: dict[str, list[str]] | None) -> SplitData:
    """A new split of the data, or, for a resumed run, the one it started with (what changed is said)."""
    if saved_split is None:
        return read_split_data(path, seed=seed)
    split, changes = reuse_split(path, saved_split)
    if changes:
        print_main(f"{path}: {changes}; the run keeps its split for the other images")
    return split


def check_image_files(paths: list[str], ctx: DistContext, shown: int = 5) -> None:
    """Stop before the first epoch if any image file is damaged, naming the bad files at once: otherwise a
    bad validation image is found only after a whole epoch of training. Each process checks the headers
    of its share of the files; the lists are gathered so that every process stops alike."""
    bad = [f"{path} ({problem})" for path in paths[ctx.rank::ctx.world_size] if (problem := header_problem(path))]
    if is_dist_avail_and_initialized():
        shares: list[list[str]] = [[] for _ in range(ctx.world_size)]
        dist.all_gather_object(shares, bad)
        bad = [entry for share in shares for entry in share]
    if bad:
        more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
        raise UserInputError(f"{len(bad)} image file(s) cannot be read: {', '.join(sorted(bad)[:shown])}{more}; "
                             "delete or replace them")


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler, which can also start an epoch part-way.

    As DistributedSampler does, each epoch is one permutation of the training set drawn from (seed, epoch),
    dealt round-robin (rank r takes r, r+N, r+2N, ...); drop_last=True: the fewer than N samples that do not
    divide among the N processes wait for the next epoch instead of being repeated. After any number of
    batches the processes together have taken the permutation's first samples, so an epoch resumed after
    `skip(samples_seen)`, by however many processes, deals out exactly the samples that are left.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.samples_seen = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.samples_seen = 0

    def skip(self, samples_seen: int) -> None:
        """Start this epoch after the first `samples_seen` samples of its permutation (all processes' together)."""
        self.samples_seen = samples_seen

    @property
    def skipped(self) -> int:
        """This process's share of the samples skipped."""
        return self.samples_seen // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        if not self.samples_seen:
            return super().__iter__()
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        left = torch.randperm(len(self.dataset), generator=generator)[self.samples_seen:].tolist()
        return iter(left[self.rank:len(self) * self.num_replicas:self.num_replicas])

    def __len__(self) -> int:
        return max(0, len(self.dataset) - self.samples_seen) // self.num_replicas


class UnpaddedDistributedSampler(Sampler[int]):
    """Deal indices round-robin (rank r gets r, r+N, r+2N, ...) without padding.

    DistributedSampler pads every rank to the same length by repeating samples (11 samples on 2 ranks
    become 12), which is right for training but would count the repeated images twice in validation.
    Here ranks may get one sample less, so correct/total summed over ranks is exact.
    """

    def __init__(self, dataset_size: int, num_replicas: int, rank: int) -> None:
        self.dataset_size, self.num_replicas, self.rank = dataset_size, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.num_replicas))


def build_loaders(datasets: DataSets, batch_size: int, ctx: DistContext, workers: int | None = None,
                  seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders for this process's share of the data."""
    per_process = len(datasets.train) // ctx.world_size
    if per_process < batch_size:
        raise UserInputError(f"--batch-size {batch_size}: larger than the {per_process} training images "
                             f"each of the {ctx.world_size} process(es) gets")
    # Each process trains on its own share of every epoch's shuffle. With one process it is just a
    # seeded shuffle; using it there too makes the order depend only on seed and epoch.
    train_sampler = ResumableDistributedSampler(datasets.train, ctx.world_size, ctx.rank, seed)
    val_sampler = UnpaddedDistributedSampler(len(datasets.val), ctx.world_size, ctx.rank)
    workers = default_workers(ctx) if workers is None else workers
    common = dict(num_workers=workers, pin_memory=ctx.device.type == "cuda", persistent_workers=workers > 0,
                  collate_fn=datasets.train.collate_fn, multiprocessing_context=loader_start_method(workers),
                  worker_init_fn=leave_signals_to_the_trainer,
                  # The loader's own seeds come from here, not from the random numbers the augmentations
                  # draw: a run resumed inside an epoch then draws the same augmentations as an unbroken one.
                  generator=torch.Generator().manual_seed(seed + ctx.rank))
    # drop_last: a last batch of one image breaks BatchNorm, and equal batches keep ranks in step.
    train_loader = DataLoader(datasets.train, batch_size=batch_size, sampler=train_sampler, drop_last=True,
                              **common)
    val_loader = DataLoader(datasets.val, batch_size=batch_size, sampler=val_sampler, **common)
    print_main(f"Using {workers} data-loader workers per process")
    return train_loader, val_loader


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch; each rank gets its own stream so augmentations differ across ranks."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
