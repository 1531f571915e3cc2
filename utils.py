"""Reading the data into a train/validation split (the tutorial's read_split_data), the datasets built from it
(my_dataset.MyDataSet with its transforms), the built-in demo data, and the tutorial's plot_data_loader_image.
`read_data` and `build_datasets` are what the training scripts call.

A data source turns `--data-path` into image paths, their class indices and the class names. A folder of
class sub-folders is read by `read_image_folder`; a file is read by the source registered for its suffix
(see "Change it" in the README: a CSV reader is one short function here). Everything after (the split,
the record a resumed run keeps, the checks before training) works on what the source yields.

A folder holding train/ and val/ folders of class sub-folders, as ImageNet is laid out for torchvision's
references, is that split; any other folder of class sub-folders is split at random, 20 % of each class to
validation. Both take time in proportion to the files (ImageNet's 1.28 million included), and hold the paths in
numpy arrays (my_dataset.Paths), which the loader workers share instead of copying. Rank 0 lists the folder
(os.scandir: one system call per folder, not per file) and hands the split to the other ranks as one message.

Before training, the headers of the image files are read (at most HEADER_CHECK_LIMIT of them, a seeded sample
past that; the loader names any other bad file when it reaches it), each process its share, so that damaged
files stop the run in one line at once, not after a whole epoch of training.

A resumed run keeps the split it started with (SplitData.record, which its checkpoints keep): the classes must
be the same, or every class index would mean another class. Where the files are those the run started with, the
split is made again as it was (its digest says so); where they changed, the run's split.json says which side each
image was on: images still there keep their side, images gone are dropped, and new images are left out, since
putting them on either side would change what the run trains or validates on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from PIL import features

from multi_train_utils.data import JPEG_SUFFIXES
from multi_train_utils.distributed_utils import (
    DistContext,
    barrier,
    is_dist_avail_and_initialized,
    print_main,
    read_on_main,
)
from multi_train_utils.errors import MAX_LINE, UserInputError, path_kind, shortened, system_reason
from my_dataset import MyDataSet, Paths, build_transforms, header_problem

# Matched without regard to case: cameras write .JPG, phones .jpeg, scanners .TIF, Windows' browsers .jfif; and
# AVIF, what browsers and phones now save, where Pillow reads it (11.3 and later).
IMAGE_EXTENSIONS = JPEG_SUFFIXES + (".png", ".bmp", ".webp", ".gif", ".tif", ".tiff") + (
    (".avif",) if "avif" in features.modules and features.check_module("avif") else ())
# Folders that systems, not people, put among photos: a zip made on a Mac, a Synology NAS's thumbnails (JPEGs
# themselves), a disk's own, Windows' on a USB stick. Like hidden ones (.git, .ipynb_checkpoints), never read.
SYSTEM_FOLDERS = frozenset({"__MACOSX", "@eaDir", "lost+found", "$RECYCLE.BIN", "System Volume Information"})
VAL_RATE = 0.2
HEADER_CHECK_LIMIT = 20_000  # files whose headers are read before training; past it, a sample of this many


@dataclass(frozen=True)
class Samples:
    """What a data source yields: image paths, the class index of each, and the class names (index -> name)."""
    paths: Sequence[str]
    labels: Sequence[int]
    class_names: list[str]


@dataclass(frozen=True)
class SplitData:
    """The images that train and those that validate, with their class indices and the class names."""
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
        """What a checkpoint keeps of the split: how it was made, and its counts and digest, not its list."""
        return {"class_names": self.class_names, "layout": self.layout, "seed": self.seed, "digest": split_digest(self),
                "train_count": len(self.train_images_path), "val_count": len(self.val_images_path)}

    def files_record(self) -> dict[str, Any]:
        """split.json: the classes, and the images that train and validate, relative to the data's folder."""
        return {"class_names": self.class_names, "train": self.train_images_path.relative(),
                "val": self.val_images_path.relative()}


DataSource = Callable[[Path], Samples]
DATA_SOURCES: dict[str, DataSource] = {}  # file suffix -> the reader of such files


def data_source(suffix: str) -> Callable[[DataSource], DataSource]:
    """Register a reader for --data-path files ending in `suffix` (such as ".csv")."""

    def register(reader: DataSource) -> DataSource:
        DATA_SOURCES[suffix.lower()] = reader
        return reader

    return register


def list_images(folder: str | os.PathLike, prefix: str = "", inside: frozenset[tuple[int, int]] | None = None
                ) -> list[str]:
    """Every image below `folder`, sub-folders included, sorted, as paths relative to it after `prefix`. `inside`:
    the folder_identity of each folder from the top of the listing down to `folder`; a link back to one of them is
    passed over, or every image there would be listed again and again."""
    inside = frozenset({folder_identity(folder)}) if inside is None else inside
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if not is_read(entry.name):  # also the "._photo.jpg" copies macOS leaves behind
                continue
            try:
                is_folder = entry.is_dir()  # a link to one too; known from the listing, without a call per file
            except OSError:  # a link the system cannot follow: listed if named as an image, its header check says why
                is_folder = False
            if is_folder:
                identity = folder_identity(entry)
                if identity not in inside:
                    found += list_images(entry, f"{prefix}{entry.name}/", inside | {identity})
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS) and is_a_file_or_a_broken_link(entry):
                found.append(prefix + entry.name)
    return sorted(found)


def is_read(name: str) -> bool:
    """Whether a file or folder of this name is looked at: not a hidden one, nor one of SYSTEM_FOLDERS."""
    return not name.startswith(".") and name not in SYSTEM_FOLDERS


def folder_identity(folder: str | os.PathLike) -> tuple[int, int]:
    """A folder's device and inode: the same through every link to it."""
    info = os.stat(folder)
    return info.st_dev, info.st_ino


def is_a_file_or_a_broken_link(entry: os.DirEntry) -> bool:
    """Not a pipe, a socket or a device (also through a link), whose reading would wait for ever; a link to nothing
    is listed, for the header check to name it."""
    try:
        if entry.is_file():  # known from the listing for all but links
            return True
        entry.stat()  # followed to its end, the link leads to something that is no file
        return False
    except OSError:  # a link to nothing, or one that loops
        return True


def what_it_holds(folder: Path) -> str:
    """What a class folder without images holds instead: the kinds of file most of it is (an iPhone's HEIC photos,
    say, which Pillow cannot read), for its error line."""
    kinds: Counter[str] = Counter()
    for _, folders, names in os.walk(folder):
        folders[:] = filter(is_read, folders)  # what list_images passes over: a NAS's thumbnails are no photos of it
        kinds.update(Path(name).suffix.lower() or name for name in names if is_read(name))
    if not kinds:
        return "; it is empty"
    held = ", ".join(f"{count} {kind} file(s)" for kind, count in kinds.most_common(3))
    convert = "; convert HEIC photos to JPEG first" if kinds.keys() & {".heic", ".heif"} else ""
    return f"; it holds {held}{'' if len(kinds) <= 3 else ', ...'}{convert}"


def read_image_folder(root: Path, relative_to: Path | None = None) -> Samples:
    """A folder of one sub-folder of images per class, the classes named by them; paths relative to `relative_to`."""
    prefix = "" if relative_to is None else f"{root.relative_to(relative_to)}/"
    paths, labels, names, top = [], [], [], folder_identity(root)
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and is_read(folder.name):  # not the files beside them
            images = list_images(folder, f"{prefix}{folder.name}/", frozenset({top, folder_identity(folder)}))
            if not images:
                raise UserInputError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})"
                                     f"{what_it_holds(folder)}")
            paths += images
            labels += [len(names)] * len(images)
            names.append(folder.name)
    if not names:
        with os.scandir(root) as entries:
            loose = sum(entry.name.lower().endswith(IMAGE_EXTENSIONS) for entry in entries)
        hint = (f"; it holds {loose} image(s) itself: they need a folder per class (ImageNet's val/ comes without "
                "them)") if loose else ""
        raise UserInputError(f"--data-path {root}: no class sub-folders (expected {root}/<class>/<image>){hint}")
    return Samples(Paths(paths, str(relative_to or root)), labels, names)


def read_samples(path: Path) -> Samples:
    """Every sample of --data-path, by the data source for what it is: a folder, or a file of a registered kind."""
    kind = path_kind(path, "--data-path")
    reader = {"folder": read_image_folder, "file": DATA_SOURCES.get(path.suffix.lower())}.get(kind)
    if reader is None:
        kinds = f"nor a {' or '.join(DATA_SOURCES)} file" if DATA_SOURCES else "(a folder of class sub-folders)"
        why = "no such folder" if kind == "missing" else f"not a folder {kinds}"
        raise UserInputError(f"--data-path {path}: {why}")
    try:
        return reader(path)
    except OSError as err:  # a folder inside that may not be read, say
        raise UserInputError(f"--data-path {path}: cannot read {shortened(str(err.filename or path), 120)}: "
                             f"{system_reason(err)}") from None


def split_digest(split: SplitData) -> str:
    """A fingerprint of which images train and which validate, with their classes: equal for equal splits."""
    digest = hashlib.sha256(json.dumps(split.class_names).encode())
    for paths, labels in ((split.train_images_path, split.train_images_label),
                          (split.val_images_path, split.val_images_label)):
        digest.update(b"\0".join(paths.array.tolist()) + b"\1")
        digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    return digest.hexdigest()


def split_samples(samples: Samples, val_rate: float = VAL_RATE, seed: int = 0) -> SplitData:
    """Each class gives `val_rate` of its images (at least one) to validation, drawn from `seed` alone."""
    if not 0.0 < val_rate < 1.0:
        raise ValueError(f"val_rate must lie between 0 and 1, got {val_rate}")
    paths, labels = Paths(samples.paths), np.asarray(samples.labels, dtype=np.int64)
    order = np.argsort(labels, kind="stable")  # each class's images together: one pass over them all
    counts = np.bincount(labels, minlength=len(samples.class_names)).tolist()
    rng, is_val, start = np.random.default_rng(seed), np.zeros(len(labels), dtype=bool), 0
    for name, count in zip(samples.class_names, counts, strict=True):
        if count < 2:
            raise UserInputError(f"class {name} holds only {paths[int(order[start])] if count else 'no image'}: a "
                                 "class needs at least 2 images, one for training and one for validation")
        chosen = rng.choice(count, size=min(count - 1, max(1, int(count * val_rate))), replace=False)
        is_val[order[start + chosen]] = True
        start += count
    return SplitData(paths[~is_val], labels[~is_val].tolist(), paths[is_val], labels[is_val].tolist(),
                     list(samples.class_names), seed=seed)


def read_split_folders(root: Path) -> SplitData:
    """train/ and val/ as the split (a test/ beside them is left alone); half such a layout is refused."""
    folders = sorted(folder.name for folder in root.iterdir() if folder.is_dir() and is_read(folder.name))
    if folders not in (["train", "val"], ["test", "train", "val"]):  # or it would be read as classes train, val
        raise UserInputError(f"--data-path {root}: holds {', '.join(folders[:6])}: either train/ and val/ "
                             "folders of class sub-folders (the split is theirs) or class folders only (split at "
                             "random), not both; rename or move the folders that do not belong")
    train, val = read_image_folder(root / "train", root), read_image_folder(root / "val", root)
    if train.class_names != val.class_names:
        differ = sorted(set(train.class_names) ^ set(val.class_names))
        raise UserInputError(f"--data-path {root}: train/ and val/ hold other classes ({len(differ)} in one only, "
                             f"such as {differ[0]}); both need the same class sub-folders")
    return SplitData(train.paths, list(train.labels), val.paths, list(val.labels), train.class_names, "folders")


def read_split_data(root: str | os.PathLike, val_rate: float = VAL_RATE, seed: int = 0) -> SplitData:
    """The tutorial's function: --data-path's train/ and val/ folders, or every class split at random."""
    path = Path(root)
    if os.path.isdir(path / "train") or os.path.isdir(path / "val"):  # ImageNet's layout, split already
        return read_split_folders(path)
    return split_samples(read_samples(path), val_rate, seed)


def reuse_split(path: Path, record: dict[str, Any]) -> SplitData:
    """The split a run was started with (SplitData.record), on the files --data-path holds now; what changed is said."""
    again = read_split_data(path, seed=record.get("seed", 0))  # one listing, in the layout the folder has now
    if again.class_names != record["class_names"]:
        raise UserInputError(f"--data-path {path}: the classes differ from the run's ("
                             f"{class_changes(record, again.class_names)}); a run keeps its classes: start a new "
                             "run (another --output-dir) for these")
    if split_digest(again) == record.get("digest"):
        return again
    record = recorded_files(record)
    every_image = again.train_images_path + again.val_images_path
    present = dict(zip(every_image.relative(), again.train_images_label + again.val_images_label, strict=True))
    sides = {}
    for side in ("train", "val"):
        kept = [relative for relative in record[side] if relative in present]
        if not kept:
            raise UserInputError(f"--data-path {path}: none of the run's {side} images is there any more")
        sides[side] = (Paths(kept, every_image.root), [present[relative] for relative in kept])
    kept = len(sides["train"][0]) + len(sides["val"][0])
    gone, added = len(record["train"]) + len(record["val"]) - kept, len(present) - kept
    changes = "; ".join(filter(None, [gone and f"{gone} image(s) of the run's split are gone",
                                      added and f"{added} new image(s) are left out (a new run would use them)"]))
    if changes:
        print_main(f"{path}: {changes}; the run keeps its split for the other images")
    return SplitData(*sides["train"], *sides["val"], list(again.class_names), record.get("layout", "random"),
                     record.get("seed", 0))


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
    """--data-path (or the demo data) split, or a resumed run's `saved_split`, checked before any training."""
    path = Path(data_path) if data_path else demo_data_folder(ctx)
    found = read_on_main(lambda: split_for_the_run(path, seed, saved_split))
    check_classes(found, path, num_classes)
    check_image_files(found.train_images_path + found.val_images_path, ctx, seed)
    print_main(split_summary(found, path))
    return found


def check_classes(found: SplitData, path: Path, num_classes: int | None) -> None:
    """At least 2 classes (--data-path at one class's folder would train a loss of 0), and --num_classes of them."""
    if found.num_classes < 2:
        raise UserInputError(f"--data-path {path}: one class only ({found.class_names[0]}); a classifier learns to "
                             "tell 2 or more apart: give the folder that holds a folder per class")
    if num_classes not in (None, found.num_classes):
        raise UserInputError(f"--num_classes {num_classes}: the data in {path} has {found.num_classes} classes "
                             f"({shortened(', '.join(found.class_names), 100)})")


def split_for_the_run(path: Path, seed: int, saved_split: dict[str, Any] | None) -> SplitData:
    """A fresh run's split of `path`, or the split a resumed run started with (`saved_split`)."""
    return read_split_data(path, seed=seed) if saved_split is None else reuse_split(path, saved_split)


def check_image_files(paths: Paths, ctx: DistContext, seed: int = 0) -> None:
    """Stop before the first epoch if the headers of image files (a seeded sample past the limit) show damage."""
    chosen = np.sort(np.random.default_rng(seed).permutation(len(paths))[:HEADER_CHECK_LIMIT])
    bad = []
    for index in chosen[ctx.rank::ctx.world_size].tolist():  # each process its share
        problem = header_problem(paths[index])
        if problem:
            bad.append(f"{os.fsdecode(paths.array[index])} ({problem})")  # relative to the data's folder: short
    if is_dist_avail_and_initialized():  # so that every process stops alike
        shares = [None] * ctx.world_size
        dist.all_gather_object(shares, bad)
        bad = list(itertools.chain(*shares))
    if bad:
        raise UserInputError(bad_files_line(bad, paths.root))


def bad_files_line(bad: list[str], root: str, shown: int = 3) -> str:
    """The one line that names the first `shown` bad files, and counts the rest."""
    head = f"{len(bad)} image file(s){f' in {root}' if root else ''} cannot be read: "
    tail = "; delete or replace them"
    listed = ", ".join(sorted(bad)[:shown]) + (f" and {len(bad) - shown} more" if len(bad) > shown else "")
    return head + shortened(listed, MAX_LINE - len(head) - len(tail) - len("error: ")) + tail


# The built-in demo data: written by demo_data.py where it is not there yet, beside the code, or, where the
# checkout cannot be written (a read-only install, a shared copy), in the user's cache folder.
DEMO_ROOT = Path(__file__).resolve().parent / "data" / "demo_patterns"
DEMO_CACHE_ROOT = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train-multi-gpu"
                   / "demo_patterns")


def split_summary(found: SplitData, path: Path) -> str:
    layout = "its train/ and val/ folders" if found.layout == "folders" else "20 % of each class validates"
    return (f"{path}: {found.num_classes} classes, {len(found.train_images_path)} images for training, "
            f"{len(found.val_images_path)} for validation ({layout})")


def build_datasets(split: SplitData, image_size: int, decode_on: str = "cpu", device: torch.device | None = None,
                   ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """The training and validation datasets of a split (SplitData), each with its transform."""
    train_tf, val_tf = build_transforms(image_size)
    train = MyDataSet(split.train_images_path, split.train_images_label, train_tf)
    if decode_on == "gpu":  # the GPU decodes the training JPEGs, and applies the same transform there
        from multi_train_utils.gpu_decode import decoded_on_the_gpu
        train = decoded_on_the_gpu(train, device) or train
    return train, MyDataSet(split.val_images_path, split.val_images_label, val_tf)


def demo_data_folder(ctx: DistContext) -> Path:
    """The built-in demo data, for a run without --data-path: written once, by one process per machine."""
    if ctx.local_rank == 0:
        print_main(f"No --data-path given: the built-in demo data in {ensure_demo_data()}")
    barrier()  # the other processes on this machine wait until the files are there
    return ensure_demo_data()  # written by now: finds the folder local rank 0 wrote


def ensure_demo_data() -> Path:
    """The demo data's folder, written first where it is not there yet (beside the code, or in the user's cache)."""
    for root in (DEMO_ROOT, DEMO_CACHE_ROOT):
        try:
            if not root.is_dir():
                write_once(root)
            return root
        except OSError as err:
            problem = err.strerror
    raise UserInputError(f"the demo data can be written neither to {DEMO_ROOT} nor to {DEMO_CACHE_ROOT} ({problem}); "
                         "train on a folder of your images with --data-path")


def write_once(root: Path) -> None:
    """The demo data written to a temporary folder renamed into place, so that a run stopped half-way, or two
    machines writing at once, never leave half a data set."""
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
