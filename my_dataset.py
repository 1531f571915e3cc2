"""A dataset over a list of image files and their class indices."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from multi_train_utils.errors import UserInputError

WHITE = (255, 255, 255)


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
    """Stack a list of (image, label) pairs into one image tensor and one label tensor."""
    images, labels = zip(*batch, strict=True)
    return torch.stack(images, dim=0), torch.as_tensor(labels, dtype=torch.long)


class MyDataSet(torch.utils.data.Dataset):
    """Image files with class indices; `transform` turns each PIL image into a tensor."""

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[Image.Image], torch.Tensor] | None = None) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = list(images_path)
        self.images_class = list(images_class)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images_path)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | Image.Image, int]:
        img = load_rgb(self.images_path[index])
        if self.transform is not None:
            img = self.transform(img)
        return img, self.images_class[index]

    # The tutorial's `collate_fn=dataset.collate_fn` keeps working. The function itself lives at the top
    # level, so data-loader workers started with spawn can pickle it by name.
    collate_fn = staticmethod(collate_fn)

