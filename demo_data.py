"""The built-in demo data: small pictures of five patterns, written as real image files in class folders.

With no --data-path the scripts train on this (utils.ensure_demo_data finds it, or has it written here once),
so the whole file pipeline (folders, JPEG and PNG, grayscale files, decoding, augmentation) runs on any machine
without a download.
"""

from __future__ import annotations

import colorsys
import math
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

CLASSES = ("checks", "dots", "grid", "rings", "stripes")
IMAGES_PER_CLASS = 120
SIDE = 64


def pattern_mask(kind: str, rng: random.Random) -> np.ndarray:
    """Where the foreground colour goes: a pattern of random period, angle and phase.

    Patterns rather than single objects, because the training augmentation (random crops down to 8 %
    of the picture, as for photographs) must still show something of the class in every crop.
    """
    period = rng.uniform(14.0, 22.0)
    turn = rng.uniform(0.0, math.pi)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    u = x * math.cos(turn) + y * math.sin(turn) + rng.uniform(0.0, period)
    v = -x * math.sin(turn) + y * math.cos(turn) + rng.uniform(0.0, period)
    half = period / 2
    if kind == "stripes":
        return (u % period) < half
    if kind == "checks":
        return ((u % period) < half) ^ ((v % period) < half)
    if kind == "grid":
        line = rng.uniform(3.0, 4.5)
        return ((u % period) < line) | ((v % period) < line)
    if kind == "dots":
        du, dv = (u % period) - half, (v % period) - half
        return du * du + dv * dv < (period * rng.uniform(0.22, 0.3)) ** 2
    if kind == "rings":
        cx, cy = rng.uniform(0, SIDE), rng.uniform(0, SIDE)
        return (np.hypot(x - cx, y - cy) % period) < half
    raise ValueError(f"unknown pattern {kind!r}")


def class_color(kind: str, rng: random.Random) -> tuple[int, int, int]:
    """A foreground colour whose hue leans towards the class's own, as sunflowers lean to yellow:
    colour helps to tell the classes apart, but the hues overlap, so the pattern matters too."""
    hue = (CLASSES.index(kind) / len(CLASSES) + rng.gauss(0.0, 0.035)) % 1.0
    red, green, blue = colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1.0), rng.uniform(0.6, 1.0))
    return round(red * 255), round(green * 255), round(blue * 255)


def make_image(kind: str, rng: random.Random) -> Image.Image:
    """One picture: the pattern in its class's colour on a dark or pale grey-ish background, slightly blurred."""
    foreground = class_color(kind, rng)
    grey = rng.randint(0, 60) if rng.random() < 0.5 else rng.randint(200, 255)
    background = tuple(min(255, max(0, grey + rng.randint(-20, 20))) for _ in range(3))
    mask = pattern_mask(kind, rng)[..., None]
    pixels = np.where(mask, np.array(foreground, np.uint8), np.array(background, np.uint8))
    img = Image.fromarray(pixels.astype(np.uint8), mode="RGB")
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 1.0)))


def write_demo_dataset(root: Path, images_per_class: int = IMAGES_PER_CLASS, seed: int = 0) -> None:
    """Write the data set under `root` (which must not exist yet); the same files for the same seed."""
    rng = random.Random(seed)
    for kind in CLASSES:
        (root / kind).mkdir(parents=True)
        for i in range(images_per_class):
            img = make_image(kind, rng)
            # A mix of what real folders hold: mostly JPEG, some PNG, some grayscale.
            if i % 20 == 3:
                img = img.convert("L")
            if i % 5 == 1:
                img.save(root / kind / f"{kind}_{i:04d}.png")
            else:
                img.save(root / kind / f"{kind}_{i:04d}.jpg", quality=90)
