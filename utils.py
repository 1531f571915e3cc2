"""Reading the data into a train/validation split (the tutorial's read_split_data), the built-in demo data, and
the tutorial's plot_data_loader_image. `read_data` is what the training scripts call.

A data source turns `--data-path` into image paths, their class indices and the class names. A folder of
class sub-folders is read by `read_image_folder`; a file is read by the source registered for its suffix
(see "Change it" in the README: a CSV reader is one short function here). Everything after (the split,
the record a resumed run keeps, the checks before training) works on what the source yields.

A folder holding train/ and val/ folders of class sub-folders, as ImageNet is laid out for torchvision's
references, is that split; any other folder of class sub-folders is split at random, 20 % of each class to
validation. Both take time in proportion to the files (ImageNet's 1.28 million included), and hold the paths in
numpy arrays (my_dataset.Paths), which the loader workers share instead of copying.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from multi_train_utils.distributed_utils import (
    DistContext,
    barrier,
    broadcast_from_main,
    is_dist_avail_and_initialized,
    print_main,
)
from multi_train_utils.errors import MAX_LINE, UserInputError, shortened
from multi_train_utils.files import path_kind
from my_dataset import Paths, header_problem

# Matched without regard to case: cameras write .JPG, phones .jpeg, scanners .TIF.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
VAL_RATE = 0.2
SPLIT_FOLDERS = ("train", "val")  # a --data-path that holds these (and perhaps test/) is split already
HEADER_CHECK_LIMIT = 20_000  # files whose headers are read before training; past it, a sample of this many


@dataclass(frozen=True)
class Samples:
    """What a data source yields: image paths, the class index of each, and the class names (index -> name)."""

    paths: Sequence[str]
    labels: Sequence[int]
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


def list_images(class_dir: Path, prefix: str = "") -> list[str]:
    """Every image below `class_dir`, sub-folders included, sorted; as paths relative to it, after `prefix`.
    os.scandir reads each folder's entries with their kinds at once: no call per file."""
    found, folders = [], [("", str(class_dir))]
    while folders:
        relative, folder = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if is_folder(entry) and not entry.name.startswith("."):
                    folders.append((f"{relative}{entry.name}/", entry.path))
                elif is_image_file(entry.name):
                    found.append(f"{prefix}{relative}{entry.name}")
    return sorted(found)


def is_folder(entry: os.DirEntry) -> bool:
    """Whether a folder's entry is a folder (a link to one too). A link the system cannot follow (a loop, a
    name too long) is not: listed as an image, its header check names it and says why."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def class_folders(root: Path) -> list[Path]:
    """The class sub-folders of `root`, sorted by name; files at the top level are ignored."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise UserInputError(f"--data-path {root}: no class sub-folders (expected {root}/<class>/<image>)")
    return folders


def read_image_folder(root: Path, relative_to: Path | None = None) -> Samples:
    """A folder with one sub-folder of images per class (flower_photos/daisy/*.jpg): the classes are the
    sub-folders' names, sorted. The paths are relative to `relative_to` (default: `root`), in a Paths."""
    prefix = "" if relative_to is None else f"{root.relative_to(relative_to)}/"
    paths, labels, names = [], [], []
    for label, folder in enumerate(class_folders(root)):
        images = list_images(folder, f"{prefix}{folder.name}/")
        if not images:
            raise UserInputError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        paths += images
        labels += [label] * len(images)
        names.append(folder.name)
    return Samples(Paths(paths, str(relative_to or root)), labels, names)


def check_data_path(path: Path) -> None:
    """That --data-path is a folder, or a file of a kind a data source reads."""
    kind = path_kind(path, "--data-path")
    if kind == "folder" or (kind == "file" and path.suffix.lower() in DATA_SOURCES):
        return
    if kind == "missing":
        raise UserInputError(f"--data-path {path}: no such folder")
    kinds = f"nor a {' or '.join(DATA_SOURCES)} file" if DATA_SOURCES else "(a folder of class sub-folders)"
    raise UserInputError(f"--data-path {path}: not a folder {kinds}")


def read_samples(path: str | os.PathLike) -> Samples:
    """Every sample of --data-path, by the data source for what it is."""
    path = Path(path)
    check_data_path(path)
    try:
        return read_image_folder(path) if path.is_dir() else DATA_SOURCES[path.suffix.lower()](path)
    except OSError as err:  # a folder inside that may not be read, say
        where = shortened(str(err.filename or path), 120)
        raise UserInputError(f"--data-path {path}: cannot read {where}: {(err.strerror or str(err)).lower()}"
                             ) from None


def data_root(path: str | os.PathLike) -> Path:
    """The folder the paths of a run's split record are relative to: --data-path, or the folder of its file."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


@dataclass(frozen=True)
class SplitData:
    train_images_path: Paths
    train_images_label: list[int]
    val_images_path: Paths
    val_images_label: list[int]
    class_names: list[str]  # index -> name
    layout: str = "random"  # "random": seeded, 20 % of each class validates; "folders": train/ and val/
    seed: int = 0

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def record(self) -> dict[str, Any]:
        """What a run's checkpoint keeps of the split: how it was made and a digest of it, the same size for ten
        images or ten million; its whole list is split.json in the run's folder (files_record)."""
        return {"class_names": self.class_names, "layout": self.layout, "seed": self.seed,
                "train_count": len(self.train_images_path), "val_count": len(self.val_images_path),
                "digest": split_digest(self)}

    def files_record(self) -> dict[str, Any]:
        """The class list and which images train and which validate, by their paths relative to the data's
        folder: split.json. A resume needs it only where the files changed since."""
        return {"class_names": self.class_names, "train": self.train_images_path.relative(),
                "val": self.val_images_path.relative()}


def split_digest(split: SplitData) -> str:
    """A fingerprint of which images train and which validate, with their classes: equal for equal splits."""
    digest = hashlib.sha256(json.dumps(split.class_names).encode())
    for paths, labels in ((split.train_images_path, split.train_images_label),
                          (split.val_images_path, split.val_images_label)):
        digest.update(b"\0".join(paths.relative_bytes()) + b"\1")
        digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    return digest.hexdigest()


def split_samples(samples: Samples, val_rate: float = VAL_RATE, seed: int = 0) -> SplitData:
    """Split every class into training and validation images: each gives `val_rate` of its images (at least
    one) to validation. The split depends only on the samples and `seed`, and leaves the global random state
    alone; it takes one pass over the samples."""
    if not 0.0 < val_rate < 1.0:
        raise ValueError(f"val_rate must lie between 0 and 1, got {val_rate}")
    paths = samples.paths if isinstance(samples.paths, Paths) else Paths(samples.paths)
    labels = np.asarray(samples.labels, dtype=np.int64)
    order = np.argsort(labels, kind="stable")  # each class's images together, in the source's order
    counts = np.bincount(labels, minlength=len(samples.class_names))
    rng = np.random.default_rng(seed)
    is_val, start = np.zeros(len(labels), dtype=bool), 0
    for name, count in zip(samples.class_names, counts.tolist(), strict=True):
        if count < 2:
            only = paths[int(order[start])] if count else "no image"
            raise UserInputError(f"class {name} holds only {only}: a class needs at least 2 images, one for "
                                 "training and one for validation")
        chosen = rng.choice(count, size=min(count - 1, max(1, int(count * val_rate))), replace=False)
        is_val[order[start + chosen]] = True
        start += count
    return SplitData(paths[~is_val], labels[~is_val].tolist(), paths[is_val], labels[is_val].tolist(),
                     list(samples.class_names), seed=seed)


def split_folders(root: Path) -> SplitData | None:
    """The split of a folder laid out as ImageNet is for torchvision's references and pytorch/examples: train/
    and val/, each with the same class sub-folders; None for any other folder."""
    return read_split_folders(root) if (root / "train").is_dir() or (root / "val").is_dir() else None


def read_split_folders(root: Path) -> SplitData:
    """train/ and val/ as the split (a test/ beside them is left alone). Half such a layout is refused in one
    line: it would be read as classes named train and val."""
    folders = sorted(folder.name for folder in class_folders(root))
    if folders not in (["train", "val"], ["test", "train", "val"]):
        raise UserInputError(f"--data-path {root}: holds {', '.join(folders[:6])}: either train/ and val/ "
                             "folders of class sub-folders (the split is theirs) or class folders only (split at "
                             "random), not both; rename or move the folders that do not belong")
    train, val = (read_image_folder(root / name, relative_to=root) for name in SPLIT_FOLDERS)
    if train.class_names != val.class_names:
        differ = sorted(set(train.class_names) ^ set(val.class_names))
        raise UserInputError(f"--data-path {root}: train/ and val/ hold other classes ({len(differ)} in one only, "
                             f"such as {differ[0]}); both need the same class sub-folders")
    return SplitData(train.paths, list(train.labels), val.paths, list(val.labels), train.class_names, "folders")


def read_split_data(root: str | os.PathLike, val_rate: float = VAL_RATE, seed: int = 0) -> SplitData:
    """The tutorial's function: the training and validation images of --data-path and their classes: its
    train/ and val/ folders, or every class split at random."""
    path = Path(root)
    check_data_path(path)
    return (path.is_dir() and split_folders(path)) or split_samples(read_samples(path), val_rate, seed)


def reuse_split(path: str | os.PathLike, record: dict[str, Any]) -> tuple[SplitData, str | None]:
    """The split a run was started with (SplitData.record), on the files --data-path holds now.

    The classes must be the same, or every class index would mean another class. Where the files are those the
    run started with, the split is made again as it was (its digest says so). Where they changed, the run's
    split.json says which side each image was on: images still there keep their side, images gone are dropped,
    and new images are left out, since putting them on either side would change what the run trains or
    validates on. Returns the split and a note of what changed, or None.
    """
    samples = read_samples(path)
    if samples.class_names != record["class_names"]:
        raise UserInputError(f"--data-path {path}: the classes differ from the run's ("
                             f"{class_changes(record, samples.class_names)}); a run keeps its classes: start a new "
                             "run (another --output-dir) for these")
    if "digest" in record:
        again = read_split_data(path, seed=record["seed"])
        if split_digest(again) == record["digest"]:
            return again, None
        record = recorded_files(record)
    present = dict(zip(Paths.of(samples.paths).relative(), samples.labels, strict=True))
    root = str(data_root(path))
    sides = {}
    for side in ("train", "val"):
        kept = [relative for relative in record[side] if relative in present]
        if not kept:
            raise UserInputError(f"--data-path {path}: none of the run's {side} images is there any more")
        sides[side] = (Paths(kept, root), [present[relative] for relative in kept])
    split = SplitData(*sides["train"], *sides["val"], list(samples.class_names), record.get("layout", "random"),
                      record.get("seed", 0))
    kept = len(split.train_images_path) + len(split.val_images_path)
    gone, added = len(record["train"]) + len(record["val"]) - kept, len(present) - kept
    note = "; ".join(filter(None, [gone and f"{gone} image(s) of the run's split are gone",
                                   added and f"{added} new image(s) are left out (a new run would use them)"]))
    return split, note or None


def recorded_files(record: dict[str, Any]) -> dict[str, Any]:
    """The run's split.json, for a run whose files changed since it started."""
    file = Path(record.get("file", "split.json"))
    try:
        files = json.loads(file.read_text())
    except (OSError, ValueError):
        raise UserInputError(f"--data-path: the images differ from those the run started with, and the run's "
                             f"{file} that says which of them trained cannot be read; put the images back, or start "
                             "a new run") from None
    return {**record, **files}


def class_changes(record: dict[str, Any], classes: list[str]) -> str:
    """What differs between the run's classes and the data's, in words."""
    gone = sorted(set(record["class_names"]) - set(classes))
    new = sorted(set(classes) - set(record["class_names"]))
    words = [f"gone: {', '.join(gone[:5])}" if gone else "", f"new: {', '.join(new[:5])}" if new else ""]
    return "; ".join(word for word in words if word) or "the same names in another order"


def read_data(data_path: str | None, ctx: DistContext, seed: int = 0, num_classes: int | None = None,
              saved_split: dict[str, Any] | None = None) -> SplitData:
    """--data-path (or the demo data) split into training and validation images, or the split a resumed run
    saved; checked (the class count, the image files' headers) before any training, and said in one line. Rank
    0 reads the folder; the others get its split, as one message."""
    path = resolve_data_path(data_path, ctx)
    found: SplitData | str | None = None
    if ctx.is_main:
        try:
            found = choose_split(path, seed, saved_split)
        except UserInputError as err:
            found = str(err)  # every rank raises it, rather than waiting for rank 0
    found = broadcast_from_main(found)
    if isinstance(found, str):
        raise UserInputError(found)
    if num_classes is not None and num_classes != found.num_classes:
        raise UserInputError(f"--num_classes {num_classes}: the data in {path} has {found.num_classes} classes "
                             f"({shortened(', '.join(found.class_names), 100)})")
    check_image_files(found.train_images_path + found.val_images_path, ctx, seed)
    layout = "its train/ and val/ folders" if found.layout == "folders" else "20 % of each class validates"
    print_main(f"{path}: {found.num_classes} classes, {len(found.train_images_path)} images for training, "
               f"{len(found.val_images_path)} for validation ({layout})")
    return found


def resolve_data_path(data_path: str | None, ctx: DistContext) -> Path:
    """`--data-path`, or the built-in demo data, written once by one process per machine."""
    if data_path:
        return Path(data_path)
    if ctx.local_rank == 0:
        print_main(f"No --data-path given: training on the built-in demo data in {ensure_demo_data()}")
    barrier()  # the other processes on this machine wait until the files are there
    return ensure_demo_data()  # written by now: finds the folder local rank 0 wrote


def choose_split(path: Path, seed: int, saved_split: dict[str, Any] | None) -> SplitData:
    """A new split of the data, or, for a resumed run, the one it started with (what changed is said)."""
    if saved_split is None:
        return read_split_data(path, seed=seed)
    split, changes = reuse_split(path, saved_split)
    if changes:
        print_main(f"{path}: {changes}; the run keeps its split for the other images")
    return split


def check_image_files(paths: Paths, ctx: DistContext, seed: int = 0, shown: int = 3) -> None:
    """Stop before the first epoch if image files are damaged, naming them at once: otherwise a bad validation
    image is found only after a whole epoch of training. Each process reads the headers of its share; the bad
    ones are gathered so that every process stops alike. Past HEADER_CHECK_LIMIT files, a seeded sample of that
    many is read, and the loader names any other bad file when it reaches it."""
    chosen = np.arange(len(paths))
    if len(paths) > HEADER_CHECK_LIMIT:
        chosen = np.sort(np.random.default_rng(seed).choice(len(paths), HEADER_CHECK_LIMIT, replace=False))
    bad = []
    for index in chosen[ctx.rank::ctx.world_size].tolist():
        problem = header_problem(paths[index])
        if problem:
            bad.append(f"{paths.array[index].decode()} ({problem})")  # relative to the data's folder: short
    if is_dist_avail_and_initialized():
        shares: list[list[str]] = [[] for _ in range(ctx.world_size)]
        dist.all_gather_object(shares, bad)
        bad = [entry for share in shares for entry in share]
    if bad:
        where = f" in {paths.root}" if paths.root else ""
        head, tail = f"{len(bad)} image file(s){where} cannot be read: ", "; delete or replace them"
        listed = ", ".join(sorted(bad)[:shown]) + (f" and {len(bad) - shown} more" if len(bad) > shown else "")
        raise UserInputError(head + shortened(listed, MAX_LINE - len(head) - len(tail) - len("error: ")) + tail)


# The built-in demo data: written by demo_data.py where it is not there yet, beside the code, or, where the
# checkout cannot be written (a read-only install, a shared copy), in the user's cache folder.
DEMO_ROOT = Path(__file__).resolve().parent / "data" / "demo_patterns"
DEMO_CACHE_ROOT = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train-multi-gpu"
                   / "demo_patterns")


def ensure_demo_data() -> Path:
    """The demo data's folder, written first where it is not there yet: to a temporary folder renamed into
    place, so that a run stopped half-way, or two machines writing at once, never leave half a data set."""
    for root in (DEMO_ROOT, DEMO_CACHE_ROOT):
        if root.is_dir():
            return root
        try:
            write_once(root)
            return root
        except OSError as err:
            problem = err.strerror
    raise UserInputError(f"the demo data can be written neither to {DEMO_ROOT} nor to {DEMO_CACHE_ROOT} ({problem}); "
                         "train on a folder of your images with --data-path")


def write_once(root: Path) -> None:
    from demo_data import write_demo_dataset

    root.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        write_demo_dataset(scratch / "data")
        try:
            os.rename(scratch / "data", root)
        except OSError:
            if not root.is_dir():  # anything but "someone else finished first" is a real error
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def plot_data_loader_image(data_loader: torch.utils.data.DataLoader, path: str | os.PathLike,
                           class_names: list[str] | None = None, max_images: int = 16) -> Path:
    """Save the first batch of `data_loader`, un-normalised, as a PNG grid; returns the file written."""
    from multi_train_utils.pictures import batch_grid

    images, labels = next(iter(data_loader))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch_grid(images[:max_images], labels[:max_images], class_names).save(path)
    return path
