"""Reading image folders: the split, the mess real folders hold, every image mode, clear errors."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import demo_data
import utils
from conftest import make_image_folder, write_image
from multi_train_utils.errors import UserInputError
from my_dataset import MyDataSet, UnreadableImageError, collate_fn, load_rgb
from utils import IMAGE_EXTENSIONS, plot_data_loader_image, read_split_data


def test_split_is_deterministic_per_seed_and_leaves_global_random_alone(image_folder: Path) -> None:
    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    first = read_split_data(image_folder, seed=0)
    assert random.random() == expected_next
    assert read_split_data(image_folder, seed=0) == first
    assert read_split_data(image_folder, seed=1).val_images_path != first.val_images_path
    assert first.class_names == ["blue", "green", "red"]
    assert len(first.train_images_path) == 24 and len(first.val_images_path) == 6
    assert not set(first.train_images_path) & set(first.val_images_path)
    for paths, labels in ((first.train_images_path, first.train_images_label),
                          (first.val_images_path, first.val_images_label)):
        assert all(Path(p).parent.name == first.class_names[label] for p, label in zip(paths, labels, strict=True))


def test_every_class_gives_validation_at_least_one_image(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path, {"a": 2, "b": 3, "c": 20})
    split = read_split_data(root, val_rate=0.2)
    assert sorted(split.val_images_label) == [0, 1, 2, 2, 2, 2]


def test_messy_folder_reads_every_image_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "messy"
    names = ["a.jpg", "b.JPG", "c.jpeg", "d.JPEG", "e.png", "f.PNG", "g.bmp", "h.webp", "i.tif", "j.gif", "l.jfif",
             "m.JPE"]
    for name in names:
        write_image(root / "cats" / name, (200, 100, 50))
    write_image(root / "cats" / "nested" / "k.jpg", (200, 100, 50))
    write_image(root / "dogs" / "gray.jpg", (90, 90, 90), mode="L")
    write_image(root / "dogs" / "pal.png", (10, 90, 200), mode="P")
    (root / "cats" / "notes.txt").write_text("not an image")
    (root / "cats" / "._a.jpg").write_bytes(b"macOS resource fork")
    (root / "cats" / "Thumbs.db").write_bytes(b"\0\1")
    (root / "LICENSE.txt").write_text("CC-BY")
    write_image(root / "top_level.jpg", (0, 0, 0))
    (root / ".ipynb_checkpoints").mkdir()
    for system in ("__MACOSX/cats", "lost+found", "$RECYCLE.BIN", "System Volume Information"):
        (root / system).mkdir(parents=True)
    (root / "__MACOSX" / "cats" / "._a.jpg").write_bytes(b"macOS metadata")
    write_image(root / "cats" / "@eaDir" / "a.jpg" / "SYNOPHOTO_THUMB_S.jpg", (200, 100, 50))  # a NAS's thumbnail
    os.mkfifo(root / "dogs" / "pipe.jpg")  # opened, it would wait for a writer for ever
    (root / "dogs" / "pipe_link.jpg").symlink_to(root / "dogs" / "pipe.jpg")
    split = read_split_data(root)
    assert split.class_names == ["cats", "dogs"]
    everything = sorted(Path(p).name for p in split.train_images_path + split.val_images_path)
    assert everything == sorted([*names, "k.jpg", "gray.jpg", "pal.png"])
    dataset = MyDataSet(split.train_images_path + split.val_images_path,
                        split.train_images_label + split.val_images_label)
    for i in range(len(dataset)):
        pixels = dataset[i][0]
        assert pixels.dtype == torch.uint8 and pixels.shape == (3, 24, 24), dataset.images_path[i]


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "P+transparency", "RGB", "RGBA", "CMYK", "I", "I;16", "F",
                                  "YCbCr"])
def test_every_image_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    base = Image.fromarray(np.arange(24 * 24 * 3, dtype=np.uint8).reshape(24, 24, 3), "RGB")
    suffix = {"CMYK": "jpg", "YCbCr": "jpg", "I": "tif", "F": "tif"}.get(mode, "png")
    path = tmp_path / f"img.{suffix}"
    if mode == "P+transparency":
        base.convert("P").save(path, transparency=0)
    else:
        base.convert(mode).save(path)
    rgb = load_rgb(str(path))
    assert rgb.mode == "RGB" and rgb.size == (24, 24)
    assert np.asarray(rgb).std() > 0  # not blank: 16-bit and float images are rescaled, not clipped


def test_transparent_pixels_become_white(tmp_path: Path) -> None:
    path = tmp_path / "clear.png"
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(path)
    assert load_rgb(str(path)).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.new("RGB", (40, 20), (120, 30, 30)).save(path, exif=exif)
    assert load_rgb(str(path)).size == (20, 40)


@pytest.mark.parametrize("content", [b"", b"this is text, not a JPEG", b"\xff\xd8\xff\xe0 truncated"])
def test_unreadable_image_is_named_in_the_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.jpg"
    path.write_bytes(content)
    with pytest.raises(UnreadableImageError, match=r"broken\.jpg"):
        MyDataSet([str(path)], [0])[0]


def test_truncated_jpeg_is_named_in_the_error(tmp_path: Path) -> None:
    good = write_image(tmp_path / "whole.jpg", (10, 200, 10), size=64)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(UnreadableImageError, match=r"cut\.jpg"):
        load_rgb(str(cut))


@pytest.mark.parametrize(("layout", "message"), [
    ("missing", "no such folder"),
    ("file", "not a folder"),
    ("no_classes", r"no class sub-folders \(expected .*/data/<class>/<image>\); it holds 1 image\(s\) itself"),
    ("empty_class", r"holds no images \(.*\); it holds 1 \.txt file\(s\)$"),
    ("heic_class", r"holds no images \(.*\); it holds 2 \.heic file\(s\); convert HEIC photos to JPEG first$"),
    ("no_files", "holds no images .*; it is empty$"),
    ("nas_thumbnails_only", "holds no images .*; it is empty$"),
    ("one_image", "at least 2 images"),
])
def test_bad_layouts_raise_a_clear_error(tmp_path: Path, layout: str, message: str) -> None:
    root = tmp_path / "data"
    if layout == "file":
        root.write_text("not a folder")
    elif layout == "no_classes":
        write_image(root / "loose.jpg", (1, 2, 3))
    elif layout == "empty_class":
        make_image_folder(root, {"a": 3})
        (root / "b").mkdir()
        (root / "b" / "readme.txt").write_text("no images here")
    elif layout == "heic_class":  # an iPhone's photos, which Pillow cannot read
        make_image_folder(root, {"a": 3})
        (root / "b").mkdir()
        for name in ("IMG_0001.HEIC", "IMG_0002.heic"):
            (root / "b" / name).write_bytes(b"\0\0\0\x18ftypheic")
    elif layout == "no_files":
        make_image_folder(root, {"a": 3})
        (root / "b" / ".DS_Store").parent.mkdir()
        (root / "b" / ".DS_Store").write_bytes(b"Bud1")
    elif layout == "nas_thumbnails_only":  # JPEGs themselves, which the listing passes over
        make_image_folder(root, {"a": 3})
        write_image(root / "b" / "@eaDir" / "photo.jpg" / "SYNOPHOTO_THUMB_M.jpg", (1, 2, 3))
    elif layout == "one_image":
        make_image_folder(root, {"a": 3, "b": 1})
    with pytest.raises(UserInputError, match=message) as caught:
        read_split_data(root)
    assert str(root) in str(caught.value)


@pytest.mark.skipif(".avif" not in IMAGE_EXTENSIONS, reason="this Pillow cannot read AVIF")
def test_avif_photos_are_images(tmp_path: Path) -> None:
    """What browsers and phones now save: where Pillow reads it, a class of them trains."""
    make_image_folder(tmp_path / "data", {"a": 3})
    for i in range(3):
        write_image(tmp_path / "data" / "b" / f"{i}.AVIF", (10, 20, 200))
    split = read_split_data(tmp_path / "data")
    assert split.class_names == ["a", "b"] and sum(label == 1 for label in [*split.train_images_label,
                                                                             *split.val_images_label]) == 3
    assert load_rgb(str(tmp_path / "data" / "b" / "0.AVIF")).size == (24, 24)


def test_collate_fn_stacks_and_pickles_by_name() -> None:
    batch = [(torch.zeros(3, 4, 4), 1), (torch.ones(3, 4, 4), 2)]
    images, labels = collate_fn(batch)
    assert images.shape == (2, 3, 4, 4) and labels.tolist() == [1, 2]
    assert pickle.loads(pickle.dumps(MyDataSet.collate_fn)) is collate_fn
    from my_dataset import build_transforms

    dataset = pickle.loads(pickle.dumps(MyDataSet(["a.jpg"], [0], build_transforms(16)[0])))  # for spawned workers
    assert dataset.images_path[0] == "a.jpg" and dataset.reduction(4032, 3024) == 8


def test_plot_data_loader_image_saves_a_png(image_folder: Path, tmp_path: Path) -> None:
    from my_dataset import build_transforms

    split = read_split_data(image_folder)
    dataset = MyDataSet(split.train_images_path, split.train_images_label, build_transforms(16)[1])
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=collate_fn)
    written = plot_data_loader_image(loader, tmp_path / "out" / "batch.png", split.class_names)
    with Image.open(written) as img:
        assert img.format == "PNG" and img.size == (4 * 128, 2 * (128 + 14))
        # Un-normalised: the red class's tiles are red again, not the normalised values clipped to black.
        assert max(img.getpixel((64, 64))) > 100



@pytest.mark.parametrize(("flags", "start"), [
    (["--out", "{tmp}/a_file/batch.png"], "--out {tmp}/a_file/batch.png: cannot write there"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1"),
    (["--out", "{tmp}/batch.txt"], "argument --out: expected a picture file (.png, .jpg, ...), got '{tmp}/batch.txt'"),
    (["--data-path", "{tmp}/a_file"], "--data-path {tmp}/a_file: not a folder")])
def test_show_batch_says_what_is_wrong_in_one_line(image_folder: Path, tmp_path: Path, flags: list[str],
                                                   start: str) -> None:
    import show_batch

    (tmp_path / "a_file").write_text("")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    with pytest.raises(UserInputError) as caught:
        show_batch.main(["--data-path", str(image_folder), "--image-size", "16", *flags])
    assert str(caught.value).startswith(start.format(tmp=tmp_path)) and "\n" not in str(caught.value)


def test_demo_data_is_written_once_and_deterministically(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    demo_data.write_demo_dataset(first, images_per_class=3)
    demo_data.write_demo_dataset(second, images_per_class=3)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert len(files) == 3 * len(demo_data.CLASSES)
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    target = tmp_path / "demo"
    utils.write_once(target)
    before = (target / "rings" / "rings_0000.jpg").stat().st_mtime_ns
    utils.write_once(target)  # someone else wrote it first: it stays as it is
    assert (target / "rings" / "rings_0000.jpg").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch left behind
    split = read_split_data(target)
    assert split.class_names == list(demo_data.CLASSES)
    assert {Path(p).suffix for p in split.train_images_path + split.val_images_path} == {".jpg", ".png"}


# ---- ImageNet's layout and size -------------------------------------------------------------------------------

def test_train_and_val_folders_are_the_split_and_nothing_of_val_is_trained_on(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    make_image_folder(root / "train", {"n01": 8, "n02": 6})
    make_image_folder(root / "val", {"n01": 2, "n02": 3})
    (root / "test").mkdir()  # left alone, as torchvision's references leave it
    (root / "lost+found").mkdir()  # the data on a disk of its own
    split = read_split_data(root)
    assert split.layout == "folders" and split.class_names == ["n01", "n02"]
    assert sorted(Path(p).relative_to(root).parts[0] for p in split.val_images_path) == ["val"] * 5
    assert all(Path(p).relative_to(root).parts[0] == "train" for p in split.train_images_path)
    assert split.val_images_label == [0, 0, 1, 1, 1] and len(split.train_images_path) == 14
    assert read_split_data(root, seed=5) == split, "no random draw: the folders are the split"


@pytest.mark.parametrize(("layout", "message"), [
    ({"train": {"a": 3, "b": 3}}, "either train/ and val/ folders of class sub-folders"),
    ({"train": {"a": 3}, "val": {"a": 1}, "cats": {"x": 2}}, "holds cats, train, val: either train/ and val/"),
    ({"train": {"a": 3, "b": 3}, "val": {"a": 1, "c": 1}}, "train/ and val/ hold other classes (2 in one only, such"),
])
def test_half_a_split_layout_is_one_line(tmp_path: Path, layout: dict, message: str) -> None:
    root = tmp_path / "data"
    for folder, classes in layout.items():
        make_image_folder(root / folder, classes)
    with pytest.raises(UserInputError, match=re.escape(message)) as caught:
        read_split_data(root)
    assert str(root) in str(caught.value) and "\n" not in str(caught.value)


def test_the_split_takes_one_pass_and_keeps_exact_counts_at_many_classes(tmp_path: Path) -> None:
    """Split per class in one pass over the samples (not once per class over all of them): a million samples
    of 1000 classes in well under the time one pass per class would take."""
    import time

    from utils import Samples, split_samples

    labels = np.repeat(np.arange(1000), 1000)
    samples = Samples([f"c{label}/{index}.JPEG" for index, label in enumerate(labels.tolist())], labels, [
        f"c{label}" for label in range(1000)])
    started = time.perf_counter()
    split = split_samples(samples, seed=0)
    assert time.perf_counter() - started < 30
    assert len(split.val_images_path) == 1000 * 200 and np.bincount(split.val_images_label).tolist() == [200] * 1000


def test_a_checkpoints_record_of_the_split_does_not_grow_with_the_files(tmp_path: Path) -> None:
    import pickle as pickling

    from utils import Samples, split_samples

    def record(count: int) -> bytes:
        labels = np.arange(count) % 10
        return pickling.dumps(split_samples(Samples([f"{i}.jpg" for i in range(count)], labels,
                                                    [str(c) for c in range(10)])).record)

    assert abs(len(record(100)) - len(record(100_000))) <= 8 and len(record(100_000)) < 2000, "the counts alone grow"


def test_paths_are_one_array_that_a_loader_worker_shares(tmp_path: Path) -> None:
    from my_dataset import Paths

    paths = Paths(["a/1.jpg", "b/ü.jpg"], root="/data")
    assert isinstance(paths.array, np.ndarray) and paths[1] == "/data/b/ü.jpg" and list(paths) == [
        "/data/a/1.jpg", "/data/b/ü.jpg"]
    assert (paths + paths)[3] == "/data/b/ü.jpg" and paths.relative() == ["a/1.jpg", "b/ü.jpg"]
    assert pickle.loads(pickle.dumps(paths)) == paths


def test_file_and_folder_names_that_are_not_utf8_are_read_and_kept(tmp_path: Path) -> None:
    """Names from an old archive or a Windows share, in Latin-1: Python gives them as str with surrogates."""
    root = os.fsencode(tmp_path)
    for name in (b"caf\xe9", b"tea"):
        for i in range(3):
            write_image(Path(os.fsdecode(root + b"/" + name + b"/%d\xff.jpg" % i)), (30 * i, 90, 200))
    split = read_split_data(tmp_path)
    assert split.class_names == [os.fsdecode(b"caf\xe9"), "tea"]
    every = split.train_images_path + split.val_images_path
    assert sorted(map(os.fsencode, every.relative())) == sorted(b"%s/%d\xff.jpg" % (name, i) for name in
                                                                 (b"caf\xe9", b"tea") for i in range(3))
    dataset = MyDataSet(every, split.train_images_label + split.val_images_label)
    assert [dataset[i][0].shape for i in range(len(dataset))] == [(3, 24, 24)] * 6
    assert json.loads(json.dumps(split.files_record())) == split.files_record()  # split.json keeps them


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG of that size: what Pillow reads to open it (its pixels are never reached)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IDAT", zlib.compress(b"\0" * 64))


def test_a_200_megapixel_photo_is_an_image_and_a_gigapixel_one_is_named(tmp_path: Path) -> None:
    """Phones take 108 and 200 megapixel photos: Pillow's default limit warned of the one and refused the other."""
    from my_dataset import header_problem

    phone, huge = tmp_path / "phone.png", tmp_path / "huge.png"
    phone.write_bytes(png_header(16320, 12240))
    huge.write_bytes(png_header(40000, 30000))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning too
        assert header_problem(str(phone)) is None
    assert header_problem(str(huge)) == "more than 500 million pixels (a decompression bomb?)"


def test_a_link_back_to_a_folder_above_lists_no_image_twice(tmp_path: Path) -> None:
    """Followed, `cats/up -> ..` would list every image again at each level, in training and in validation."""
    root = make_image_folder(tmp_path / "data", {"cats": 4, "dogs": 4})
    (root / "cats" / "up").symlink_to("..")
    (root / "dogs" / "again").symlink_to(".")
    (root / "dogs" / "cats").symlink_to(root / "cats")  # a link to another folder: its images, once
    split = read_split_data(root)
    every = sorted(split.train_images_path.relative() + split.val_images_path.relative())
    assert len(every) == 12 and len(set(map(os.path.realpath, split.train_images_path + split.val_images_path))) == 8
    cats = sorted(f"dogs/cats/{image.name}" for image in (root / "cats").iterdir() if image.name != "up")
    assert [name for name in every if name.startswith("dogs/cats/")] == cats


def test_a_folder_named_like_an_image_is_read_as_a_folder_of_images(tmp_path: Path) -> None:
    (tmp_path / "2019.jpg").mkdir()  # an album folder, say
    for name in ("2019.jpg/a.jpg", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    assert utils.list_images(tmp_path) == ["2019.jpg/a.jpg", "b.png"]


def test_one_class_is_refused_before_training(tmp_path: Path) -> None:
    """--data-path at one class's folder of sub-folders: every loss would be 0, and every accuracy 100 %."""
    from multi_train_utils.distributed_utils import single_process

    root = make_image_folder(tmp_path / "daisy", {"2019": 6})
    with pytest.raises(UserInputError, match=r"one class only \(2019\); a classifier learns to tell 2 or more apart"):
        utils.read_data(str(root), single_process("cpu"))
