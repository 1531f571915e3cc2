"""Images as the data-loader workers hand them over (uint8 tensors, decoded fast) and as the model takes
them (float, normalised, on the training device).

Workers send uint8 pixels: a quarter of the bytes of float32 through shared memory, the pin-memory
thread and the copy to the GPU. Turning them into normalised floats is one cheap elementwise pass on the
training device, inside the step, the same on a CPU and on a GPU.
"""

from __future__ import annotations

import functools

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_transforms(image_size: int) -> tuple[v2.Compose, v2.Compose]:
    """The tutorial's augmentation at 224 px, scaled to `image_size`, on uint8 tensors: random crops to
    train, a centre crop to validate (resized first to 256/224 of the crop, as at 224).

    antialias=True: bilinear resizing averages over the pixels it shrinks, as Pillow does, so the
    crops look like the float32 PIL pipeline's (see tests/test_pipeline.py for how close).
    """
    train = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])
    val = v2.Compose([v2.Resize(round(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)])
    return train, val


def to_model_input(images: torch.Tensor, device: torch.device,
                   memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """A batch from the loader as the model takes it, on `device`: uint8 pixels (N, 3, H, W), or JPEGs
    still to decode (--decode-on gpu), become float32 in the ImageNet normalisation, in `memory_format`.
    Float batches (made by other loaders) are only moved."""
    if not isinstance(images, torch.Tensor):  # JPEG files of --decode-on gpu (gpu_decode.EncodedBatch)
        images = images.decode_and_augment(device)
    # Copied as uint8, a quarter of float32's bytes; asynchronously from pinned memory. The layout next,
    # while a pixel is still one byte, not four.
    images = images.to(device, non_blocking=True).to(memory_format=memory_format)
    if images.dtype != torch.uint8:
        return images
    # (x / 255 - mean) / std in one subtraction and one multiplication; elementwise ops keep the layout.
    mean, scale = normalisation(images.device)
    return (images.float() - mean) * scale


@functools.cache
def normalisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet's mean and 1/std in 0..255 pixel units, made once per device: built every step, their copy
    to the GPU would make the CPU wait for it every step."""
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    return mean, 1 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)
