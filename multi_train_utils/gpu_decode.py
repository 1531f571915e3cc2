"""--decode-on gpu: the loader workers only read the JPEG files; the GPU decodes each batch (nvjpeg, all
images in one call), then crops, resizes and flips every image as the CPU pipeline would.

Decoding is most of what a worker does (about two thirds of its time on 500 x 375 photos), so this frees
the CPU where there are too few cores per GPU. The random crop boxes and flips are drawn on the CPU from
torch's random numbers, in the same order as transforms.v2 draws them, so on the same seed the same
images get the same crops as with the workers' pipeline (tests/test_pipeline.py checks it on the CPU).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from my_dataset import MyDataSet, decode_rgb, read_file
from utils import SplitData

from .distributed_utils import print_main

EXIF_ORIENTATION = 0x0112


class Crop(NamedTuple):
    top: int
    left: int
    height: int
    width: int
    flip: bool


class EncodedBatch(NamedTuple):
    """A batch of images in one flat uint8 tensor (one shared-memory block, not one per image).
    Image i is data[offsets[i]:offsets[i + 1]]: JPEG file bytes where shapes[i] is (0, 0, 0), else
    pixels of that (3, H, W) shape, decoded by the worker."""

    data: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor
    image_size: int

    def decode_and_augment(self, device: torch.device) -> torch.Tensor:
        """The uint8 training batch (N, 3, S, S) on `device`, as the workers' pipeline would have made it."""
        images = decode_batch(self, device)
        crops = sample_crops([tuple(image.shape[-2:]) for image in images], self.image_size)
        return apply_crops(images, crops, self.image_size)

    def whole_images(self) -> torch.Tensor:
        """The batch's pictures uncropped and unflipped, resized to the square, decoded on the CPU: to look
        at, without drawing random numbers that training would otherwise have drawn."""
        images = decode_batch(self, torch.device("cpu"))
        return apply_crops(images, [Crop(0, 0, *image.shape[-2:], flip=False) for image in images], self.image_size)


def gpu_decodable(path: str) -> bool:
    """Whether nvjpeg can decode this file as it should look: a colour or grayscale JPEG without an
    EXIF rotation (nvjpeg ignores EXIF). Reads only the header."""
    try:
        with Image.open(path) as img:
            return (img.format == "JPEG" and img.mode in ("RGB", "L")
                    and img.getexif().get(EXIF_ORIENTATION, 1) == 1)
    except (OSError, SyntaxError, ValueError):
        return False  # decode_rgb will name the file


class EncodedImages(MyDataSet):
    """The training images for --decode-on gpu: file bytes where the GPU can decode them, else pixels."""

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int], image_size: int) -> None:
        super().__init__(images_path, images_class)
        self.image_size = image_size
        # Whether nvjpeg takes each file, read from its header once per worker, not once per epoch.
        self.decodable: dict[int, bool] = {}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.images_path[index]
        if index not in self.decodable:
            self.decodable[index] = gpu_decodable(path)
        return (read_file(path) if self.decodable[index] else decode_rgb(path)), self.images_class[index]

    @property
    def collate_fn(self) -> functools.partial:
        return functools.partial(collate_encoded, image_size=self.image_size)


def gpu_training_set(split: SplitData, image_size: int, device: torch.device,
                     decode_on: str = "gpu") -> EncodedImages | None:
    """The training images for --decode-on gpu; None for --decode-on cpu, or where the GPU cannot decode them
    (said in one line)."""
    if decode_on != "gpu":
        return None
    if device.type != "cuda":
        print_main(f"--decode-on gpu: training on {device.type}, so the loader workers decode the images")
        return None
    paths = split.train_images_path
    others = sum(not path.lower().endswith((".jpg", ".jpeg")) for path in paths)
    if others:
        print_main(f"--decode-on gpu: {others} of {len(paths)} training images are not JPEGs; the loader "
                   "workers decode those")
    return EncodedImages(paths, split.train_images_label, image_size)


def collate_encoded(batch: Sequence[tuple[torch.Tensor, int]], image_size: int) -> tuple[EncodedBatch, torch.Tensor]:
    items, labels = zip(*batch, strict=True)
    sizes = torch.tensor([0, *(item.numel() for item in items)])
    shapes = torch.tensor([item.shape if item.dim() == 3 else (0, 0, 0) for item in items], dtype=torch.long)
    data = torch.cat([item.flatten() for item in items])
    return EncodedBatch(data, sizes.cumsum(0), shapes, image_size), torch.as_tensor(labels)


def decode_batch(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
    """Every image of the batch as uint8 RGB pixels (3, H, W) on `device`, the JPEGs decoded there in one call."""
    items = [batch.data[start:end] for start, end in itertools.pairwise(batch.offsets.tolist())]
    shapes = batch.shapes.tolist()
    encoded = [i for i, shape in enumerate(shapes) if shape == [0, 0, 0]]
    images = [item.view(*shape).to(device, non_blocking=True) if shape != [0, 0, 0] else None
              for item, shape in zip(items, shapes, strict=True)]
    if encoded:
        if device.type == "cuda":
            # torchvision decodes on a stream of its own into memory taken from this stream, without waiting
            # for the work queued here: memory freed by that work, which it has yet to read, can be overwritten
            # (pytorch/vision PR 9606). Its stream is waited for after the decode; ours must be before it.
            torch.cuda.current_stream(device).synchronize()
        decoded = decode_jpeg([items[i] for i in encoded], mode=ImageReadMode.RGB, device=device)
        for i, image in zip(encoded, decoded, strict=True):
            images[i] = image
    return images


def sample_crops(sizes: Sequence[tuple[int, int]], image_size: int) -> list[Crop]:
    """A RandomResizedCrop box and a coin flip for each (height, width), drawn as transforms.v2 draws them."""
    crop, crops = v2.RandomResizedCrop(image_size), []
    for height, width in sizes:
        box = crop.make_params([torch.empty(3, height, width, dtype=torch.uint8, device="meta")])
        crops.append(Crop(**box, flip=bool(torch.rand(1) < 0.5)))
    return crops


def apply_crops(images: Sequence[torch.Tensor], crops: Sequence[Crop], image_size: int) -> torch.Tensor:
    """Each image cropped to its box, resized (antialiased) to image_size square, flipped if drawn so; stacked."""
    out = []
    for image, crop in zip(images, crops, strict=True):
        image = F.resized_crop(image, crop.top, crop.left, crop.height, crop.width, [image_size, image_size],
                               antialias=True)
        out.append(image.flip(-1) if crop.flip else image)
    return torch.stack(out)

