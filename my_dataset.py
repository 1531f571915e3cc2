"""A dataset over a list of image files and their class indices."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from multi_train_utils.errors import UserInputError

WHITE = (255, 255, 255)
JPEG_START = b"\xff\xd8\xff"  # every JPEG file begins with these bytes, whatever its name says

# torchvision 0.29 warns on every decode that its decoders move to TorchCodec; they are still the fastest
# JPEG decoder a plain torch install has, and the warning would flood the output of every run.
warnings.filterwarnings("ignore", message=r".*decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


class UnreadableImageError(UserInputError):
    """An image file that Pillow cannot decode; the message names the file."""


def load_rgb(path: str) -> Image.Image:
    """Open any image Pillow reads and return it as 8-bit RGB, upright as the camera meant it."""
    try:
        with Image.open(path) as img:
            img.load()
            return to_rgb(upright(img))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImageError(f"cannot read image {path}: {err}") from None


def read_file(path: str) -> torch.Tensor:
    """The bytes of a file as a 1-D uint8 tensor (what torchvision's decoders take)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() >= 3 and bytes(data[:3].tolist()) == JPEG_START


def decode_rgb(path: str) -> torch.Tensor:
    """An image file as uint8 RGB pixels (3, H, W), upright as the camera meant it.

    JPEGs, nearly every photograph, are decoded by torchvision's libjpeg-turbo straight into a tensor:
    the same pixels as Pillow (grayscale, CMYK and progressive files too), without Pillow's image object
    and its conversion to an array. Everything else (PNG, GIF, 16-bit, palette, transparency) and any JPEG
    torchvision refuses goes through Pillow's `load_rgb`, which reads them all or names the file.
    """
    try:
        data = read_file(path)
    except OSError as err:
        raise UnreadableImageError(f"cannot read image {path}: {err}") from None
    if is_jpeg(data):
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
        except RuntimeError:
            pass  # a damaged file: Pillow either reads it anyway or raises an error that names it
    return pil_to_tensor(load_rgb(path))


def header_problem(path: str) -> str | None:
    """What is wrong with an image file that its header already shows (empty, not an image, no pixels),
    or None. Reads a few hundred bytes, not the pixels: cheap enough to check every file before training."""
    try:
        with Image.open(path) as img:
            width, height = img.size
    except FileNotFoundError:
        return "gone"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return "empty" if Path(path).stat().st_size == 0 else f"not an image Pillow reads ({err})"
    return None if width > 0 and height > 0 else f"{width} x {height} pixels"


def upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation that phones write instead of rotating the pixels."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # a broken EXIF block should not cost us an otherwise good photo
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Grayscale, palette, CMYK, 16-bit and transparent images all become 8-bit RGB."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # Pillow's own conversion clips 16-bit and float images to 255; rescale to the full range.
        pixels = np.asarray(img, dtype=np.float64)
        top = pixels.max() or 1.0
        img = Image.fromarray(np.clip(pixels / top * 255.0, 0, 255).astype(np.uint8), mode="L")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        # Transparent pixels hold arbitrary colours; show them as white, as a viewer would.
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def collate_fn(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a list of (image, label) pairs into one image tensor and one label tensor.

    PyTorch's default_collate does the stacking: inside a data-loader worker it stacks straight into
    shared memory, where a plain torch.stack would need one more copy of the batch to get there.
    """
    images, labels = default_collate(batch)
    return images, labels


class MyDataSet(torch.utils.data.Dataset):
    """Image files with class indices. Each image is decoded to uint8 RGB pixels (3, H, W); `transform`
    (torchvision.transforms.v2 works on such tensors) crops and flips them."""

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = list(images_path)
        self.images_class = list(images_class)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images_path)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        img = decode_rgb(self.images_path[index])
        if self.transform is not None:
            img = self.transform(img)
        return img, self.images_class[index]

    # The tutorial's `collate_fn=dataset.collate_fn` keeps working. The function itself lives at the top
    # level, so data-loader workers started with spawn can pickle it by name.
    collate_fn = staticmethod(collate_fn)

