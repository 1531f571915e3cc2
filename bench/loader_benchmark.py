"""How many images per second one data-loader worker prepares: the default pipeline against the tutorial's.

    python bench/benchmark.py --loader-only --data-path DIR --image-size 224 [--workers N]
    python bench/loader_benchmark.py --make-photos data/photos_500x375 --from a.jpg b.jpg ...

The default pipeline: JPEGs decoded by torchvision (libjpeg-turbo) into uint8 tensors, cropped and
flipped by transforms.v2 on uint8, collated by default_collate (normalised later, on the training
device). The tutorial's: Pillow, then ToTensor and Normalize into float32, collated by torch.stack.
Both read the same files in the same order with the same training augmentation; the repeats alternate
between them, so that whatever else the machine does falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python bench/loader_benchmark.py` from anywhere

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from multi_train_utils.data import loader_start_method
from multi_train_utils.launch import usable_cpus
from multi_train_utils.optim import IMAGENET_MEAN, IMAGENET_STD
from my_dataset import MyDataSet, build_transforms, collate_fn, load_rgb
from utils import read_split_data

PHOTO_SIZE = (500, 375)
PHOTOS_PER_SOURCE = 40


class TutorialDataSet(MyDataSet):
    """The tutorial's pipeline: a PIL image in, a normalised float32 tensor out."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(load_rgb(self.images_path[index])), self.images_class[index]


def tutorial_transforms(image_size: int) -> transforms.Compose:
    """The tutorial's training transform (what this repository used before its uint8 pipeline)."""
    return transforms.Compose([transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def tutorial_collate(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*batch, strict=True)
    return torch.stack(images), torch.as_tensor(labels)


def time_loader(dataset: MyDataSet, collate: object, workers: int, batch_size: int, images: int) -> float:
    """Images per second per worker (or of this process alone with 0 workers), after one warm-up batch."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
                        multiprocessing_context=loader_start_method(workers), drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    next(batches)  # the workers have started and filled their queues
    started, seen = time.perf_counter(), 0
    for batch_images, _ in batches:
        seen += len(batch_images)
        if seen >= images:
            break
    return seen / (time.perf_counter() - started) / max(1, workers)


def loader_benchmark(data_path: str, image_size: int, workers: int, repeats: int = 5, batch_size: int = 32,
                     images: int = 256) -> dict:
    """Both pipelines timed `repeats` times each, alternating; the medians and their ratio."""
    split = read_split_data(data_path)
    paths, labels = split.train_images_path, split.train_images_label
    images = min(images, len(paths) - batch_size)  # one warm-up batch, then at most one pass over the files
    new = MyDataSet(paths, labels, build_transforms(image_size)[0])
    old = TutorialDataSet(paths, labels, tutorial_transforms(image_size))
    # Data-loader workers run one thread each; the loading process alone is timed the same way.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs: dict[str, list[float]] = {"default": [], "tutorial": []}
        for _ in range(repeats):
            runs["default"].append(time_loader(new, collate_fn, workers, batch_size, images))
            runs["tutorial"].append(time_loader(old, tutorial_collate, workers, batch_size, images))
    finally:
        torch.set_num_threads(threads)
    default, tutorial = statistics.median(runs["default"]), statistics.median(runs["tutorial"])
    return {"loader_images_per_s_per_worker": default, "loader_images_per_s_per_worker_tutorial": tutorial,
            "loader_speedup": default / tutorial,
            "runs": runs, "workers": workers, "image_size": image_size, "images_per_run": images,
            "data_path": str(data_path), "usable_cpus": usable_cpus(), "torch": torch.__version__}


def make_photos(target: Path, sources: Sequence[Path], per_source: int = PHOTOS_PER_SOURCE, seed: int = 0,
                size: tuple[int, int] = PHOTO_SIZE) -> Path:
    """A folder of JPEGs of `size`, one class per source photograph: random crops (a half to all of the
    picture, at 4:3), flips and rescalings of it, saved at quality 90. Enlarged past the source's own size
    (to a camera's 4032 x 3024, say), a picture gets the grain of a camera's sensor (noise of 3 levels), or
    it would be smoother, and quicker to decode, than any photograph."""
    rng, grain = random.Random(seed), np.random.default_rng(seed)
    width, height = size
    for source in sources:
        with Image.open(source) as photo:
            photo = photo.convert("RGB")
        for i in range(per_source):
            side = rng.uniform(0.7, 1.0)  # of the largest 4:3 box that fits
            box_w = min(photo.width, photo.height * width / height) * side
            box_h = box_w * height / width
            left, top = rng.uniform(0, photo.width - box_w), rng.uniform(0, photo.height - box_h)
            picture = photo.resize(size, Image.BICUBIC, box=(left, top, left + box_w, top + box_h))
            if width > box_w:
                noisy = np.asarray(picture, dtype=np.float32) + grain.normal(0, 3, (height, width, 3))
                picture = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
            if rng.random() < 0.5:
                picture = picture.transpose(Image.FLIP_LEFT_RIGHT)
            out = target / Path(source).stem / f"{Path(source).stem}_{i:03d}.jpg"
            out.parent.mkdir(parents=True, exist_ok=True)
            picture.save(out, quality=90)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-photos", required=True, help="folder to write")
    parser.add_argument("--from", dest="sources", nargs="+", required=True, help="photographs to make them from")
    parser.add_argument("--per-source", type=int, default=PHOTOS_PER_SOURCE, help="pictures made from each one")
    parser.add_argument("--size", default="x".join(map(str, PHOTO_SIZE)), help="WIDTHxHEIGHT of each picture")
    args = parser.parse_args()
    size = tuple(int(side) for side in args.size.lower().split("x"))
    root = make_photos(Path(args.make_photos), [Path(s) for s in args.sources], args.per_source, size=size)
    print(json.dumps({"written": str(root), "images": len(args.sources) * args.per_source}))


if __name__ == "__main__":
    main()
