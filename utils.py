"""Reading an image folder into a train/validation split, and drawing what the model sees."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from multi_train_utils.errors import UserInputError

# Matched without regard to case: cameras write .JPG, phones .jpeg, scanners .TIF.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class SplitData:
    train_images_path: list[str]
    train_images_label: list[int]
    val_images_path: list[str]
    val_images_label: list[int]
    class_names: list[str]  # index -> name; the folder names, sorted

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_record(self, root: str | os.PathLike) -> dict[str, list[str]]:
        """The class list and the split, with paths relative to `root`: what a run keeps in its output
        folder and its checkpoint, so that a resume trains and validates on the same images."""
        return {"class_names": self.class_names,
                "train": [os.path.relpath(path, root) for path in self.train_images_path],
                "val": [os.path.relpath(path, root) for path in self.val_images_path]}


def is_image_file(name: str) -> bool:
    # Names starting with a dot are hidden files, such as the "._photo.jpg" copies macOS leaves behind.
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def list_images(class_dir: Path) -> list[str]:
    """Every image below `class_dir`, sub-folders included, in a fixed (sorted) order."""
    found = []
    for folder, subdirs, files in os.walk(class_dir, followlinks=True):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found += [os.path.join(folder, f) for f in files if is_image_file(f)]
    return sorted(found)


def class_folders(root: Path) -> list[Path]:
    """The class sub-folders of `root`, sorted by name; files at the top level are ignored."""
    if not root.exists():
        raise UserInputError(f"--data-path {root}: no such folder")
    if not root.is_dir():
        raise UserInputError(f"--data-path {root}: not a folder")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise UserInputError(f"--data-path {root}: no class sub-folders (expected {root}/<class>/<image>)")
    return folders


def read_split_data(root: str | os.PathLike, val_rate: float = 0.2, seed: int = 0) -> SplitData:
    """Split every class of an image folder into training and validation images.

    Each class gives `val_rate` of its images (at least one) to validation. The split depends only on
    the files and `seed`, and leaves Python's global random state alone.
    """
    if not 0.0 < val_rate < 1.0:
        raise ValueError(f"val_rate must lie between 0 and 1, got {val_rate}")
    rng = random.Random(seed)
    split = SplitData([], [], [], [], [])
    for label, folder in enumerate(class_folders(Path(root))):
        images = list_images(folder)
        if not images:
            raise UserInputError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        if len(images) < 2:
            raise UserInputError(f"class folder {folder} holds only {images[0]}: a class needs at least "
                                 "2 images, one for training and one for validation")
        val_count = min(len(images) - 1, max(1, int(len(images) * val_rate)))
        val_images = set(rng.sample(images, k=val_count))
        for path in images:
            paths, labels = ((split.val_images_path, split.val_images_label) if path in val_images
                             else (split.train_images_path, split.train_images_label))
            paths.append(path)
            labels.append(label)
        split.class_names.append(folder.name)
    return split


def reuse_split(root: str | os.PathLike, record: dict[str, list[str]]) -> tuple[SplitData, str | None]:
    """The split a run was started with (`SplitData.to_record`), on the images `root` holds now.

    The classes must be the same folders, or every class index would mean another class. Images still
    there keep their side of the split; images gone are dropped; new images are left out, since putting
    them on either side would change what the run trains or validates on. Returns the split and a note
    of what changed, or None.
    """
    root = Path(root)
    classes = [folder.name for folder in class_folders(root)]
    if classes != record["class_names"]:
        raise UserInputError(f"--data-path {root}: the classes differ from the run's ({class_changes(record, classes)}"
                             "); a run keeps its classes: start a new run (another --output-dir) for these")
    present = {os.path.relpath(path, root) for folder in class_folders(root) for path in list_images(folder)}
    split = SplitData([], [], [], [], list(classes))
    for side, paths, labels in (("train", split.train_images_path, split.train_images_label),
                                ("val", split.val_images_path, split.val_images_label)):
        for relative in record[side]:
            if relative in present:
                paths.append(str(root / relative))
                labels.append(classes.index(Path(relative).parts[0]))
    kept = len(split.train_images_path) + len(split.val_images_path)
    gone, added = len(record["train"]) + len(record["val"]) - kept, len(present) - kept
    for side, paths in (("training", split.train_images_path), ("validation", split.val_images_path)):
        if not paths:
            raise UserInputError(f"--data-path {root}: none of the run's {side} images is there any more")
    note = "; ".join(filter(None, [gone and f"{gone} image(s) of the run's split are gone",
                                   added and f"{added} new image(s) are left out (a new run would use them)"]))
    return split, note or None


def class_changes(record: dict[str, list[str]], classes: list[str]) -> str:
    """What differs between the run's classes and the folder's, in words."""
    gone = sorted(set(record["class_names"]) - set(classes))
    new = sorted(set(classes) - set(record["class_names"]))
    words = [f"gone: {', '.join(gone)}" if gone else "", f"new: {', '.join(new)}" if new else ""]
    return "; ".join(word for word in words if word)


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
    if not isinstance(images, torch.Tensor):
        from multi_train_utils.gpu_decode import whole_images  # imported here: that module imports this one

        images = whole_images(images)
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


def plot_data_loader_image(data_loader: torch.utils.data.DataLoader, path: str | os.PathLike,
                           class_names: list[str] | None = None, max_images: int = 16) -> Path:
    """Save the first batch of `data_loader`, un-normalised, as a PNG grid; returns the file written."""
    images, labels = next(iter(data_loader))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch_grid(images[:max_images], labels[:max_images], class_names).save(path)
    return path
