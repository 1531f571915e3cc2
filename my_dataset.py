"""A dataset over a list of image files and their class indices, and the augmentations its images get.

Images are decoded to uint8 tensors (3, H, W) and augmented as such (torchvision's transforms.v2): a quarter of
the bytes of float32 through the loader workers' shared memory, the pin-memory thread and the copy to the GPU.
Turning them into normalised floats is one cheap elementwise pass on the training device, inside the step.

Decoding reads each file once. JPEGs, nearly every photograph, are decoded by torchvision's libjpeg-turbo straight
into a tensor: the same pixels as Pillow (grayscale, CMYK and progressive files too), without Pillow's image
object and its conversion to an array. Everything else (PNG, GIF, 16-bit, palette, transparency) and any JPEG
torchvision refuses goes through Pillow (`load_rgb`), which reads them all or names the file.

A JPEG much larger than the transform needs is decoded smaller, at 1/2, 1/4 or 1/8 of its width and height:
libjpeg then scales each 8 x 8 block of the compressed picture itself (Pillow's `draft`), at a fraction of the
cost of decoding every pixel. A 12-megapixel phone photo cropped to 224 pixels needs a quarter of its pixels or
fewer; its validation crop, a sixty-fourth. Only where the transform's first step brings every image to a size
of its own (RandomResizedCrop, Resize; another first step may count pixels, a crop of so many), and no smaller
than that step needs (`decode_reduction`): the photo ends the same, within rounding, and the later steps never
see a difference. A random crop is drawn for the photo's full size, by RandomResizedCrop itself (the same random
numbers as when every pixel is decoded), then cut from the smaller picture (`decode_transformed`).

The paths are held as one numpy array (`Paths`), not as a list of str: 1.28 million str objects take some
150 MB, and a loader worker that reads one (touching its reference count) copies the memory page it lives on,
until every worker holds a copy of them all (PyTorch issue 13246). An array is one object, which reading leaves
alone; it also pickles in one piece, for the other ranks.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from multi_train_utils.errors import UserInputError

WHITE = (255, 255, 255)
JPEG_START = b"\xff\xd8\xff"  # every JPEG file begins with these bytes, whatever its name says
# (width, height) of an upright photo -> by how much smaller it may be decoded: 1, 2, 4 or 8
Reduction = Callable[[int, int], int]
JPEG_REDUCTIONS = (8, 4, 2)  # what libjpeg decodes at directly: 1/8, 1/4 or 1/2 of each side
# The smallest crop stays this many times the output's side: each output pixel is still an average of several
# decoded ones, and ends within a level or two of one decoded from every pixel.
REDUCTION_MARGIN = 1.5
EXIF_ORIENTATION, SIDEWAYS = 0x0112, (5, 6, 7, 8)  # the orientations that turn the picture by 90 degrees

# Pillow warns of more than MAX_IMAGE_PIXELS and refuses twice as many, against files made to fill the memory;
# its default, 89 million, is less than the 108 and 200 megapixels that phones take photos at.
Image.MAX_IMAGE_PIXELS = 250_000_000
# torchvision 0.29 warns on every decode that its decoders move to TorchCodec; they are still the fastest
# JPEG decoder a plain torch install has, and the warning would flood the output of every run.
warnings.filterwarnings("ignore", message=r".*decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


def file_problem(path: str, err: BaseException) -> str:
    """Why an image file cannot be read, in a few words (Pillow's own message would repeat the file's name)."""
    if isinstance(err, OSError) and err.errno is not None:
        return os.strerror(err.errno).lower()
    if isinstance(err, Image.DecompressionBombError):
        return f"more than {2 * Image.MAX_IMAGE_PIXELS // 10**6} million pixels (a decompression bomb?)"
    try:
        if os.stat(path).st_size == 0:
            return "empty"
    except OSError as stat_err:
        return os.strerror(stat_err.errno).lower()
    return "not an image (damaged, cut short, or another kind of file)"


def header_problem(path: str) -> str | None:
    """What an image file's header (not its pixels: cheap) shows is wrong with it, or None."""
    try:
        with Image.open(path) as img:
            return None if min(img.size) > 0 else f"{img.width} x {img.height} pixels"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return "gone" if isinstance(err, FileNotFoundError) else file_problem(path, err)


def decode_rgb(path: str) -> torch.Tensor:
    """An image file as uint8 RGB pixels (3, H, W), upright as the camera meant it."""
    return decode_reduced(path)[0]


class UnreadableImageError(UserInputError):
    """An image file that Pillow cannot decode; the message names the file."""


def load_rgb(path: str, data: np.ndarray | None = None) -> Image.Image:
    """Any image Pillow reads (the file at `path`, or its bytes `data` where they are read already) as 8-bit RGB,
    upright as the camera meant it."""
    try:
        with Image.open(path if data is None else io.BytesIO(data)) as img:
            img.load()
            with contextlib.suppress(Exception):  # a broken EXIF block should not cost an otherwise good photo
                img = ImageOps.exif_transpose(img)
            if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # Pillow's conversion would clip them at 255
                pixels = np.asarray(img, dtype=np.float64)
                img = Image.fromarray((pixels / (pixels.max() or 1.0) * 255).clip(0, 255).astype(np.uint8))
            if img.has_transparency_data:  # transparent pixels hold arbitrary colours: white, as a viewer shows
                rgba, img = img.convert("RGBA"), Image.new("RGB", img.size, WHITE)
                img.paste(rgba, mask=rgba)
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImageError(f"cannot read image {path}: {file_problem(path, err)}") from None


def decode_reduced(path: str, reduction: Reduction | None = None) -> tuple[torch.Tensor, int, int]:
    """decode_rgb's pixels, smaller where `reduction` says so, and the whole picture's upright height and width."""
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError:
        data = None  # load_rgb names what is wrong with the file
    if data is not None and data[:3].tobytes() == JPEG_START:
        reduced = reduced_jpeg(data, reduction) if reduction else None
        if reduced is not None:
            return reduced
        try:
            pixels = decode_jpeg(torch.from_numpy(data), mode=ImageReadMode.RGB, apply_exif_orientation=True)
            return pixels, *pixels.shape[1:]
        except RuntimeError:
            pass  # a damaged file: Pillow reads it anyway, or names it
    pixels = pil_to_tensor(load_rgb(path, data))
    return pixels, *pixels.shape[1:]


def reduced_jpeg(data: np.ndarray, reduction: Reduction) -> tuple[torch.Tensor, int, int] | None:
    """The JPEG `data` decoded at 1/2, 1/4 or 1/8 of each side by libjpeg itself (Pillow's draft) where
    `reduction` allows it, with the whole picture's upright height and width; None where it needs every pixel."""
    try:
        with Image.open(io.BytesIO(data)) as img:  # its header: the size and the EXIF orientation
            width, height = img.size[::-1] if img.getexif().get(EXIF_ORIENTATION) in SIDEWAYS else img.size
            factor = reduction(width, height)
            if factor == 1:
                return None
            img.draft("RGB", (img.width // factor, img.height // factor))
            return pil_to_tensor(ImageOps.exif_transpose(img).convert("RGB")), height, width
    except Exception:  # whatever this shortcut trips on (odd EXIF, a cut file): the full decode decides, or names it
        return None


def decode_reduction(transform: Callable | None) -> Reduction | None:
    """By how much smaller a JPEG may be decoded for `transform`, or None (see the module's docstring)."""
    first = transform.transforms[0] if isinstance(transform, v2.Compose) else transform
    resizes = isinstance(first, v2.RandomResizedCrop) or (isinstance(first, v2.Resize) and first.max_size is None)
    return functools.partial(reduction_factor, first) if resizes else None


def reduction_factor(step: v2.RandomResizedCrop | v2.Resize, width: int, height: int) -> int:
    """By how much smaller a picture of `width` x `height` (upright) may be decoded for `step`: 8, 4, 2 or 1."""
    out_h, out_w = step.size * 2 if len(step.size) == 1 else step.size  # Resize([side]): the shorter side to it
    if isinstance(step, v2.RandomResizedCrop):  # its smallest crop, at its widest and at its tallest
        area = min(step.scale) * width * height
        width, height = math.sqrt(area * step.ratio[0]), math.sqrt(area / step.ratio[1])
    for factor in JPEG_REDUCTIONS:
        if max(out_w / width, out_h / height) * factor * REDUCTION_MARGIN <= 1:
            return factor
    return 1


def decode_transformed(path: str, transform: Callable, reduction: Reduction) -> torch.Tensor:
    """`transform` of the image at `path`, decoded no larger than its first step needs (`reduction`)."""
    img, height, width = decode_reduced(path, reduction)
    steps = transform.transforms if isinstance(transform, v2.Compose) else [transform]
    if isinstance(steps[0], v2.RandomResizedCrop):  # drawn for the whole picture, cut from the one decoded
        box = steps[0].make_params([torch.empty(0, height, width, dtype=torch.uint8)])
        scale_y, scale_x = img.shape[1] / height, img.shape[2] / width
        top, left = round(box["top"] * scale_y), round(box["left"] * scale_x)
        box = {"top": top, "left": left, "height": min(img.shape[1] - top, max(1, round(box["height"] * scale_y))),
               "width": min(img.shape[2] - left, max(1, round(box["width"] * scale_x)))}
        img, steps = steps[0].transform(img, box), steps[1:]
    for step in steps:
        img = step(img)
    return img


def collate_fn(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (image, label) pairs into one image tensor and one label tensor."""
    images, labels = default_collate(batch)  # inside a loader worker, straight into shared memory
    return images, labels


class Paths(Sequence[str]):
    """File paths held as one numpy array of their bytes (os.fsencode: names that are not UTF-8 too), relative to
    `root` (see the module's docstring)."""

    def __init__(self, paths: Sequence[str] | np.ndarray = (), root: str = "") -> None:
        if isinstance(paths, Paths):
            paths, root = paths.array, paths.root
        self.root = root
        self.array = paths if isinstance(paths, np.ndarray) else np.array([*map(os.fsencode, paths)], dtype=bytes)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: Any) -> Any:
        """A path (str) for a number; a Paths for a slice, a mask or an array of indices."""
        if isinstance(index, (int, np.integer)):
            return os.path.join(self.root, os.fsdecode(self.array[index]))
        return Paths(self.array[index], self.root)

    def __add__(self, other: Sequence[str]) -> Paths:
        if isinstance(other, Paths) and other.root == self.root:
            return Paths(np.concatenate([self.array, other.array]), self.root)
        return Paths([*self, *other])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(other) == list(self)

    def relative(self) -> list[str]:
        """The paths relative to `root` (as a run's split.json keeps them)."""
        return [*map(os.fsdecode, self.array.tolist())]

    def __repr__(self) -> str:
        return f"Paths({len(self)} under {self.root or '.'})"


class MyDataSet(torch.utils.data.Dataset):
    """Image files with class indices. Each image is decoded to uint8 RGB pixels (3, H, W); `transform`
    (torchvision.transforms.v2 works on such tensors) crops and flips them."""

    decode = staticmethod(decode_rgb)  # path -> uint8 pixels (3, H, W); one of your own is used as it is
    # The tutorial's `collate_fn=dataset.collate_fn` keeps working. The function itself lives at the top
    # level, so data-loader workers started with spawn can pickle it by name.
    collate_fn = staticmethod(collate_fn)

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = Paths(images_path)  # one array: the loader workers share it, without copies
        self.images_class, self.transform = list(images_class), transform
        self.reduction = decode_reduction(transform)  # large JPEGs decoded no larger than the transform needs

    def __len__(self) -> int:
        return len(self.images_path)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.images_path[index], self.images_class[index]
        if self.reduction and self.decode is decode_rgb:
            return decode_transformed(path, self.transform, self.reduction), label
        img = self.decode(path)
        return (img if self.transform is None else self.transform(img)), label


def build_transforms(image_size: int) -> tuple[v2.Compose, v2.Compose]:
    """The tutorial's augmentation at 224 px, scaled to `image_size`, on uint8 tensors, for every decode path."""
    # antialias=True: bilinear resizing averages over the pixels it shrinks, as Pillow does (tests/test_pipeline.py)
    train = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])
    val = v2.Compose([v2.Resize(round(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)])
    return train, val
