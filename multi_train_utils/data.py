"""From an image folder to data loaders that give each process its own share."""

from __future__ import annotations

import multiprocessing.context
import random
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from demo_data import ensure_demo_data
from my_dataset import MyDataSet, header_problem
from utils import SplitData, read_split_data, reuse_split

from . import preemption
from .distributed_utils import DistContext, barrier, is_dist_avail_and_initialized, print_main
from .errors import UserInputError
from .gpu_decode import EncodedImages
from .launch import usable_cpus
from .transforms import build_transforms

# Enough workers for what one current GPU trains ResNet-34 on at 224 px (3,000-5,000 images/s, at about
# 500 images/s per worker); more only hold memory and take longer to start.
MAX_GPU_WORKERS = 16


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
    """Split the image folder (or keep the split a resumed run saved) and wrap both halves in datasets with
    their transforms. decode_on "gpu": the training images are decoded and augmented on the GPU
    (validation's stay on the workers)."""
    root = resolve_data_path(data_path, ctx)
    split = choose_split(root, seed, saved_split)
    if num_classes is not None and num_classes != split.num_classes:
        raise UserInputError(f"--num_classes {num_classes}: the data in {root} has {split.num_classes} "
                             f"classes ({', '.join(split.class_names)})")
    check_image_files(split.train_images_path + split.val_images_path, ctx)
    print_main(f"{root}: {split.num_classes} classes, {len(split.train_images_path)} images for training, "
               f"{len(split.val_images_path)} for validation")
    train_tf, val_tf = build_transforms(image_size)
    train = (EncodedImages(split.train_images_path, split.train_images_label, image_size)
             if decode_on == "gpu" and can_decode_on_gpu(split.train_images_path, ctx)
             else MyDataSet(split.train_images_path, split.train_images_label, train_tf))
    return DataSets(train, MyDataSet(split.val_images_path, split.val_images_label, val_tf), split.to_record(root))


def choose_split(root: Path, seed: int, saved_split: dict[str, list[str]] | None) -> SplitData:
    """A new split of the folder, or, for a resumed run, the one it started with (what changed is said)."""
    if saved_split is None:
        return read_split_data(root, seed=seed)
    split, changes = reuse_split(root, saved_split)
    if changes:
        print_main(f"{root}: {changes}; the run keeps its split for the other images")
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


def can_decode_on_gpu(paths: list[str], ctx: DistContext) -> bool:
    """Whether --decode-on gpu can run here; if not, or not for every file, one line says so."""
    if ctx.device.type != "cuda":
        print_main(f"--decode-on gpu: training on {ctx.device.type}, so the loader workers decode the images")
        return False
    others = sum(not path.lower().endswith((".jpg", ".jpeg")) for path in paths)
    if others:
        print_main(f"--decode-on gpu: {others} of {len(paths)} training images are not JPEGs; the loader "
                   "workers decode those")
    return True


class EpochSampler(Sampler[int]):
    """This process's share of each epoch's shuffled order, from any point in it.

    Each epoch is one permutation of the training set, drawn from (seed, epoch) as DistributedSampler
    draws it. Its samples are dealt round-robin (rank r takes r, r+N, r+2N, ...), so after any number of
    batches the processes together have taken the permutation's first `samples_seen` samples, and an epoch
    resumed from that point, by however many processes, deals out exactly the samples that are left.
    Unlike DistributedSampler, nothing is repeated to even out the shares: the up to N-1 samples that do
    not divide among the processes wait for the next epoch, as the tail that fills no batch does.
    """

    def __init__(self, dataset_size: int, num_replicas: int, rank: int, seed: int = 0) -> None:
        self.dataset_size, self.num_replicas, self.rank, self.seed = dataset_size, num_replicas, rank, seed
        self.epoch = self.samples_seen = 0

    def set_epoch(self, epoch: int, samples_seen: int = 0) -> None:
        """A new shuffle every epoch (without it every epoch repeats the first one's order), starting after
        the first `samples_seen` samples of it."""
        self.epoch, self.samples_seen = epoch, samples_seen

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        left = torch.randperm(self.dataset_size, generator=generator)[self.samples_seen:].tolist()
        return iter(left[self.rank:len(self) * self.num_replicas:self.num_replicas])

    def __len__(self) -> int:
        return max(0, self.dataset_size - self.samples_seen) // self.num_replicas


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


def default_workers(ctx: DistContext) -> int:
    """Data-loader processes per training process: this process's share of the usable CPUs, less one for
    the training process itself, which feeds the GPU.

    On a CPU the training itself wants every core, so the loaders get only what is left over.
    """
    per_process = max(1, usable_cpus() // ctx.local_world_size)
    if ctx.device.type == "cuda":
        return max(1, min(MAX_GPU_WORKERS, per_process - 1))
    return min(4, per_process // 4)


def build_loaders(datasets: DataSets, batch_size: int, ctx: DistContext, workers: int | None = None,
                  seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders for this process's share of the data."""
    per_process = len(datasets.train) // ctx.world_size
    if per_process < batch_size:
        raise UserInputError(f"--batch-size {batch_size}: larger than the {per_process} training images "
                             f"each of the {ctx.world_size} process(es) gets")
    # Each process trains on its own share of every epoch's shuffle. With one process it is just a
    # seeded shuffle; using it there too makes the order depend only on seed and epoch.
    train_sampler = EpochSampler(len(datasets.train), ctx.world_size, ctx.rank, seed)
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


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group, the loader workers too; each would print a
    KeyboardInterrupt traceback. A scheduler's SIGTERM reaches them too. The training process stops them
    itself, so they ignore both."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preemption.obey_only_the_trainer()


def loader_start_method(workers: int) -> multiprocessing.context.BaseContext | None:
    """Fork data-loader workers on Linux, even inside processes started by spawn (whose children would
    otherwise be spawned too, each importing torch again: seconds per worker)."""
    return preemption.WorkerForkContext() if workers > 0 and sys.platform == "linux" else None


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch; each rank gets its own stream so augmentations differ across ranks."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)

