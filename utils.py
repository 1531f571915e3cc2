"""Reading the data into a train/validation split, and the tutorial's plot_data_loader_image.

A data source turns `--data-path` into image paths, their class indices and the class names. A folder of
class sub-folders is read by `read_image_folder`; a file is read by the source registered for its suffix
(see "Change it" in the README: a CSV reader is one short function here). Everything after (the split,
the record a resumed run keeps, the checks before training) works on what the source yields.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from multi_train_utils.errors import UserInputError
from multi_train_utils.pictures import batch_grid

# Matched without regard to case: cameras write .JPG, phones .jpeg, scanners .TIF.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class Samples:
    """What a data source yields: image paths, the class index of each, and the class names (index -> name)."""

    paths: list[str]
    labels: list[int]
    class_names: list[str]


DataSource = Callable[[Path], Samples]
DATA_SOURCES: dict[str, DataSource] = {}  # file suffix -> the reader of such files


def data_source(suffix: str) -> Callable[[DataSource], DataSource]:
    """Register a reader for --data-path files ending in `suffix` (such as ".csv")."""

    def register(reader: DataSource) -> DataSource:
        DATA_SOURCES[suffix.lower()] = reader
        return reader

    return register


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
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise UserInputError(f"--data-path {root}: no class sub-folders (expected {root}/<class>/<image>)")
    return folders


def read_image_folder(root: Path) -> Samples:
    """A folder with one sub-folder of images per class (flower_photos/daisy/*.jpg): the classes are the
    sub-folders' names, sorted."""
    samples = Samples([], [], [])
    for label, folder in enumerate(class_folders(root)):
        images = list_images(folder)
        if not images:
            raise UserInputError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        samples.paths.extend(images)
        samples.labels.extend([label] * len(images))
        samples.class_names.append(folder.name)
    return samples


def check_data_path(path: Path) -> None:
    """That --data-path is a folder, or a file of a kind a data source reads."""
    if path.is_dir() or (path.is_file() and path.suffix.lower() in DATA_SOURCES):
        return
    if not path.exists():
        raise UserInputError(f"--data-path {path}: no such folder")
    kinds = f"nor a {' or '.join(DATA_SOURCES)} file" if DATA_SOURCES else "(a folder of class sub-folders)"
    raise UserInputError(f"--data-path {path}: not a folder {kinds}")


def read_samples(path: str | os.PathLike) -> Samples:
    """Every sample of --data-path, by the data source for what it is."""
    path = Path(path)
    check_data_path(path)
    return read_image_folder(path) if path.is_dir() else DATA_SOURCES[path.suffix.lower()](path)


def data_root(path: str | os.PathLike) -> Path:
    """The folder the paths of a run's split record are relative to: --data-path, or the folder of its file."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


@dataclass(frozen=True)
class SplitData:
    train_images_path: list[str]
    train_images_label: list[int]
    val_images_path: list[str]
    val_images_label: list[int]
    class_names: list[str]  # index -> name

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_record(self, root: str | os.PathLike) -> dict[str, list[str]]:
        """The class list and the split, with paths relative to `root`: what a run keeps in its output
        folder and its checkpoint, so that a resume trains and validates on the same images."""
        return {"class_names": self.class_names,
                "train": [os.path.relpath(path, root) for path in self.train_images_path],
                "val": [os.path.relpath(path, root) for path in self.val_images_path]}


def split_samples(samples: Samples, val_rate: float = 0.2, seed: int = 0) -> SplitData:
    """Split every class into training and validation images: each gives `val_rate` of its images (at least
    one) to validation. The split depends only on the samples and `seed`, and leaves Python's global random
    state alone."""
    if not 0.0 < val_rate < 1.0:
        raise ValueError(f"val_rate must lie between 0 and 1, got {val_rate}")
    rng = random.Random(seed)
    split = SplitData([], [], [], [], list(samples.class_names))
    for label, name in enumerate(samples.class_names):
        images = [path for path, of in zip(samples.paths, samples.labels, strict=True) if of == label]
        if len(images) < 2:
            raise UserInputError(f"class {name} holds only {images[0] if images else 'no image'}: a class needs at "
                                 "least 2 images, one for training and one for validation")
        val_images = set(rng.sample(images, k=min(len(images) - 1, max(1, int(len(images) * val_rate)))))
        for path in images:
            paths, labels = ((split.val_images_path, split.val_images_label) if path in val_images
                             else (split.train_images_path, split.train_images_label))
            paths.append(path)
            labels.append(label)
    return split


def read_split_data(root: str | os.PathLike, val_rate: float = 0.2, seed: int = 0) -> SplitData:
    """The tutorial's function: split every class of --data-path into training and validation images."""
    return split_samples(read_samples(root), val_rate, seed)


def reuse_split(path: str | os.PathLike, record: dict[str, list[str]]) -> tuple[SplitData, str | None]:
    """The split a run was started with (`SplitData.to_record`), on the samples --data-path holds now.

    The classes must be the same, or every class index would mean another class. Images still there keep
    their side of the split; images gone are dropped; new images are left out, since putting them on either
    side would change what the run trains or validates on. Returns the split and a note of what changed, or
    None.
    """
    samples, root = read_samples(path), data_root(path)
    if samples.class_names != record["class_names"]:
        raise UserInputError(f"--data-path {path}: the classes differ from the run's ("
                             f"{class_changes(record, samples.class_names)}); a run keeps its classes: start a new "
                             "run (another --output-dir) for these")
    present = {os.path.relpath(image, root): label for image, label in zip(samples.paths, samples.labels, strict=True)}
    split = SplitData([], [], [], [], list(samples.class_names))
    for side, paths, labels in (("train", split.train_images_path, split.train_images_label),
                                ("val", split.val_images_path, split.val_images_label)):
        for relative in record[side]:
            if relative in present:
                paths.append(str(root / relative))
                labels.append(present[relative])
    kept = len(split.train_images_path) + len(split.val_images_path)
    gone, added = len(record["train"]) + len(record["val"]) - kept, len(present) - kept
    for side, paths in (("training", split.train_images_path), ("validation", split.val_images_path)):
        if not paths:
            raise UserInputError(f"--data-path {path}: none of the run's {side} images is there any more")
    note = "; ".join(filter(None, [gone and f"{gone} image(s) of the run's split are gone",
                                   added and f"{added} new image(s) are left out (a new run would use them)"]))
    return split, note or None


def class_changes(record: dict[str, list[str]], classes: list[str]) -> str:
    """What differs between the run's classes and the data's, in words."""
    gone = sorted(set(record["class_names"]) - set(classes))
    new = sorted(set(classes) - set(record["class_names"]))
    words = [f"gone: {', '.join(gone)}" if gone else "", f"new: {', '.join(new)}" if new else ""]
    return "; ".join(word for word in words if word) or "the same names in another order"


def plot_data_loader_image(data_loader: torch.utils.data.DataLoader, path: str | os.PathLike,
                           class_names: list[str] | None = None, max_images: int = 16) -> Path:
    """Save the first batch of `data_loader`, un-normalised, as a PNG grid; returns the file written."""
    images, labels = next(iter(data_loader))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch_grid(images[:max_images], labels[:max_images], class_names).save(path)
    return path
