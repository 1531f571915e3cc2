"""--decode-on gpu: the loader workers only read the training JPEGs; the GPU decodes each batch (nvjpeg, all
images in one call), then applies the dataset's own training transform to every image, on the GPU.

Decoding is most of what a worker does (about two thirds of its time on 500 x 375 photos), so this frees the
CPU where there are too few cores per GPU. The transform is the dataset's, the one the workers would apply
(torchvision's transforms.v2 run on GPU tensors too): an augmentation added to it applies on both paths, and on
the same seed the same images get the same crops (tests/test_pipeline.py checks it on the CPU).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from .data import JPEG_SUFFIXES
from .distributed_utils import print_main

EXIF_ORIENTATION = 0x0112
PREVIEW_SIDE = 64  # pixels: the side of a whole picture shown by whole_images


class EncodedBatch(NamedTuple):
    """A batch of images in one flat uint8 tensor (one shared-memory block, not one per image).
    Image i is data[offsets[i]:offsets[i + 1]]: JPEG file bytes where shapes[i] is (0, 0, 0), else
    pixels of that (3, H, W) shape, decoded by the worker."""

    data: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor]

    def decode_and_augment(self, device: torch.device) -> torch.Tensor:
        """The uint8 training batch (N, 3, S, S) on `device`, as the workers' pipeline would have made it."""
        return torch.stack([self.transform(image) for image in decode_batch(self, device)])

    def whole_images(self) -> torch.Tensor:
        """The batch's pictures uncropped and unflipped, decoded on the CPU: to look at, without drawing random
        numbers that training would otherwise have drawn."""
        return torch.stack([F.resize(image, [PREVIEW_SIDE, PREVIEW_SIDE], antialias=True)
                            for image in decode_batch(self, torch.device("cpu"))])


def gpu_decodable(path: str) -> bool:
    """Whether nvjpeg can decode this file as it should look: a colour or grayscale JPEG without an
    EXIF rotation (nvjpeg ignores EXIF). Reads only the header."""
    try:
        with Image.open(path) as img:
            return (img.format == "JPEG" and img.mode in ("RGB", "L")
                    and img.getexif().get(EXIF_ORIENTATION, 1) == 1)
    except (OSError, SyntaxError, ValueError):
        return False  # the dataset's own decoder names the file


class EncodedImages(Dataset):
    """The training images for --decode-on gpu: file bytes where the GPU can decode them, else the pixels the
    wrapped dataset decodes. `images` is a dataset of image files as my_dataset.MyDataSet is one: it has
    images_path, images_class, transform, and decode(path) -> uint8 pixels (3, H, W)."""

    def __init__(self, images: Any) -> None:
        self.images = images
        # Whether nvjpeg takes each file, read from its header once per worker, not once per epoch.
        self.decodable: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.images.images_path[index]
        if index not in self.decodable:
            self.decodable[index] = gpu_decodable(path)
        if self.decodable[index]:
            return torch.from_numpy(np.fromfile(path, dtype=np.uint8)), self.images.images_class[index]
        return self.images.decode(path), self.images.images_class[index]

    @property
    def collate_fn(self) -> functools.partial:
        return functools.partial(collate_encoded, transform=self.images.transform)


def decoded_on_the_gpu(images: Any, device: torch.device) -> EncodedImages | None:
    """The training images for --decode-on gpu; None where training does not run on a GPU (said in one line)."""
    if device.type != "cuda":
        print_main(f"--decode-on gpu: training on {device.type}, so the loader workers decode the images")
        return None
    others = sum(not path.lower().endswith(JPEG_SUFFIXES) for path in images.images_path)
    if others:
        print_main(f"--decode-on gpu: {others} of {len(images)} training images are not JPEGs; the loader "
                   "workers decode those")
    return EncodedImages(images)


def collate_encoded(batch: Sequence[tuple[torch.Tensor, int]],
                    transform: Callable[[torch.Tensor], torch.Tensor]) -> tuple[EncodedBatch, torch.Tensor]:
    items, labels = zip(*batch, strict=True)
    sizes = torch.tensor([0, *(item.numel() for item in items)])
    shapes = torch.tensor([item.shape if item.dim() == 3 else (0, 0, 0) for item in items], dtype=torch.long)
    data = torch.cat([item.flatten() for item in items])
    return EncodedBatch(data, sizes.cumsum(0), shapes, transform), torch.as_tensor(labels)


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
