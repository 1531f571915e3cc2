"""A batch as a picture: what the model sees, un-normalised, each image captioned with its class."""

from __future__ import annotations

import math

import torch
from PIL import Image, ImageDraw

from .optim import IMAGENET_MEAN, IMAGENET_STD


def denormalize(images: torch.Tensor) -> torch.Tensor:
    """Pixel values in [0, 1] of a batch: a uint8 batch as the loaders give it, or one in the ImageNet
    normalisation as the model takes it."""
    if images.dtype == torch.uint8:
        return images.float() / 255
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() * std + mean).clamp(0.0, 1.0)


def batch_grid(images: torch.Tensor, labels: torch.Tensor, class_names: list[str] | None = None,
               columns: int | None = None, tile: int = 128) -> Image.Image:
    """A grid of a batch (uint8 or normalised), each image captioned with its class, as a PIL image.

    Small images are blown up to `tile` pixels without smoothing, so one sees the pixels the model gets.
    A batch of JPEG files (--decode-on gpu, cropped only on the device) is shown as whole pictures.
    """
    if not isinstance(images, torch.Tensor):  # JPEG files of --decode-on gpu, still to decode
        images = images.whole_images()
    pixels = (denormalize(images.detach().cpu()) * 255).round().to(torch.uint8)
    # Four across for up to 16 images; larger batches grow about as wide as tall.
    columns = columns or min(len(pixels), max(4, math.ceil(math.sqrt(len(pixels)))))
    rows = (len(pixels) + columns - 1) // columns
    caption = 14
    grid = Image.new("RGB", (columns * tile, rows * (tile + caption)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
        x, y = (i % columns) * tile, (i // columns) * (tile + caption)
        picture = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((tile, tile), Image.NEAREST)
        grid.paste(picture, (x, y))
        draw.text((x + 2, y + tile), class_names[label] if class_names else str(label), fill=(0, 0, 0))
    return grid
