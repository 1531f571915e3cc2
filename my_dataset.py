"""A dataset over a list of image files and their class indices, and the augmentations its images get.

Images are decoded to uint8 tensors (3, H, W) and augmented as such (torchvision's transforms.v2): a quarter of
the bytes of float32 through the loader workers' shared memory, the pin-memory thread and the copy to the GPU.
Turning them into normalised floats is one cheap elementwise pass on the training device, inside the step.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from multi_train_utils.errors import UserInputError

WHITE = (255, 255, 255)
JPEG_START = b"\xff\xd8\xff"  # every JPEG file begins with these bytes, whatever its name says

# torchvision 0.29 warns on every decode that its decoders move to TorchCodec; they are still the fastest
# JPEG decoder a plain torch install has, and the warning would flood the output of every run.
warnings.filterwarnings("ignore", message=r".*decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


def read_file(path: str) -> torch.Tensor:
    """The bytes of a file as a 1-D uint8 tensor (what torchvision's decoders take)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


class UnreadableImageError(UserInputError):
    """An image file that Pillow cannot decode; the message names the file."""


def load_rgb(path: str) -> Image.Image:
    """Open any image Pillow reads and return it as 8-bit RGB, upright as the camera meant it."""
    try:
        with Image.open(path) as img:
            img.load()
            return to_rgb(upright(img))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImageError(f"cannot read image {path}: {file_problem(path, err)}") from None


def file_problem(path: str, err: BaseException) -> str:
    """Why an image file cannot be read, in a few words: the system's reason, or what Pillow found (its own
    message repeats the file's name, which the line already gives)."""
    if isinstance(err, OSError) and err.errno is not None:
        return os.strerror(err.errno).lower()
    if isinstance(err, Image.DecompressionBombError):
        return "more pixels than Pillow accepts (a decompression bomb?)"
    try:
        if os.stat(path).st_size == 0:
            return "empty"
    except OSError as stat_err:
        return os.strerror(stat_err.errno).lower()
    return "not an image (damaged, cut short, or another kind of file)"


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
        raise UnreadableImageError(f"cannot read image {path}: {file_problem(path, err)}") from None
    if is_jpeg(data):
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
        except RuntimeError:
            pass  # a damaged file: Pillow either reads it anyway or raises an error that names it
    return pil_to_tensor(load_rgb(path))


# (width, height) of an upright photo -> by how much smaller it may be decoded: 1, 2, 4 or 8
Reduction = Callable[[int, int], int]
JPEG_REDUCTIONS = (8, 4, 2)  # what libjpeg decodes at directly: 1/8, 1/4 or 1/2 of each side
REDUCTION_MARGIN = 1.5
EXIF_ORIENTATION, SIDEWAYS = 0x0112, (5, 6, 7, 8)  # the orientations that turn the picture by 90 degrees


def decode_reduction(transform: Callable | None) -> Reduction | None:
    """How much smaller a JPEG may be decoded for `transform`, or None. Only where the transform's first step
    brings every image to a size of its own (RandomResizedCrop, Resize): decoded no smaller than that step
    needs, the photo ends the same, within rounding, and the later steps never see a difference. Another
    first step may count pixels (a crop of so many), so it gets every pixel."""
    first = transform.transforms[0] if isinstance(transform, v2.Compose) and transform.transforms else transform
    if isinstance(first, v2.RandomResizedCrop):
        out_h, out_w = first.size
        least_area, (ratio_min, ratio_max) = min(first.scale), first.ratio

        def needed(width: int, height: int) -> float:  # the fraction of each side the smallest crop needs
            area = least_area * width * height
            return max(out_w / math.sqrt(area * ratio_min), out_h / math.sqrt(area / ratio_max))
    elif isinstance(first, v2.Resize) and first.max_size is None:
        def needed(width: int, height: int) -> float:
            if len(first.size) == 1:  # the shorter side to that size
                return first.size[0] / min(width, height)
            return max(first.size[1] / width, first.size[0] / height)
    else:
        return None
    # The smallest crop stays REDUCTION_MARGIN times the output's side: each output pixel is still an average
    # of several decoded ones, and ends within a level or two of one decoded from every pixel.
    return lambda width, height: next((k for k in JPEG_REDUCTIONS if needed(width, height) * k * REDUCTION_MARGIN <= 1),
                                      1)


def decode_transformed_reduced(path: str, transform: v2.Compose, reduction: Reduction) -> torch.Tensor | None:
    """`transform` of the JPEG at `path`, decoded at 1/2, 1/4 or 1/8 of its width and height where `reduction`
    says the transform needs no more: libjpeg then scales each 8 x 8 block of the compressed picture itself
    (Pillow's `draft`), at a fraction of the cost of decoding every pixel. A 12-megapixel phone photo
    cropped to 224 pixels needs a quarter of its pixels or fewer; its validation crop, a sixty-fourth.

    A random crop is drawn for the photo's full size, by RandomResizedCrop itself (the same random numbers
    as when every pixel is decoded), then cut from the smaller picture. None where the full size is needed,
    or where Pillow cannot read the file (decode_rgb then names it)."""
    try:
        with Image.open(path) as img:
            if img.format != "JPEG":
                return None
            width, height = img.size
            if img.getexif().get(EXIF_ORIENTATION) in SIDEWAYS:
                width, height = height, width  # the transform sees the photo upright
            factor = reduction(width, height)
            if factor == 1:
                return None
            img.draft("RGB", (img.width // factor, img.height // factor))
            small = pil_to_tensor(to_rgb(upright(img)))
    except Exception:  # whatever this shortcut trips on (odd EXIF, a cut file), the full decode decides and names
        return None
    first, rest = transform.transforms[0], v2.Compose(transform.transforms[1:])
    if isinstance(first, v2.RandomResizedCrop):
        box = first.make_params([torch.empty(0, height, width, dtype=torch.uint8)])  # drawn for the full size
        scale_y, scale_x = small.shape[1] / height, small.shape[2] / width
        top, left = round(box["top"] * scale_y), round(box["left"] * scale_x)
        box = {"top": top, "left": left, "height": min(small.shape[1] - top, max(1, round(box["height"] * scale_y))),
               "width": min(small.shape[2] - left, max(1, round(box["width"] * scale_x)))}
        return rest(first.transform(small, box))
    return rest(first(small))


def header_problem(path: str) -> str | None:
    """What is wrong with an image file that its header already shows (gone, empty, not an image, no pixels),
    or None. Reads a few hundred bytes, not the pixels: cheap enough to check many files before training."""
    try:
        with Image.open(path) as img:
            width, height = img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return "gone" if isinstance(err, FileNotFoundError) else file_problem(path, err)
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


def build_transforms(image_size: int) -> tuple[v2.Compose, v2.Compose]:
    """The tutorial's augmentation at 224 px, scaled to `image_size`, on uint8 tensors: random crops to
    train, a centre crop to validate (resized first to 256/224 of the crop, as at 224). The one definition
    of each: --decode-on gpu applies the same training transform on the GPU.

    antialias=True: bilinear resizing averages over the pixels it shrinks, as Pillow does, so the
    crops look like the float32 PIL pipeline's (see tests/test_pipeline.py for how close).
    """
    train = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])
    val = v2.Compose([v2.Resize(round(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)])
    return train, val


def batch_transform(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> Callable | None:
    """--mixup-alpha, --cutmix-alpha: each training batch (on the device, normalised) blends pairs of its images
    and their labels, by a share drawn from Beta(alpha, alpha): MixUp over the whole picture, CutMix in a box;
    one of the two per batch where both are on (torchvision's references do the same). The labels become the
    blend's shares of each class, which nn.CrossEntropyLoss takes as they are. None where both are 0."""
    mixup = v2.MixUp(alpha=mixup_alpha, num_classes=num_classes) if mixup_alpha else None
    cutmix = v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes) if cutmix_alpha else None
    return v2.RandomChoice([mixup, cutmix]) if mixup and cutmix else mixup or cutmix


def build_datasets(split: Any, image_size: int, decode_on: str = "cpu", device: torch.device | None = None,
                   ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """The training and validation datasets of a split (utils.SplitData), each with its transform.
    --decode-on gpu: the GPU decodes the training JPEGs, and applies the same training transform there
    (multi_train_utils/gpu_decode.py)."""
    train_tf, val_tf = build_transforms(image_size)
    train = MyDataSet(split.train_images_path, split.train_images_label, train_tf)
    if decode_on == "gpu":
        from multi_train_utils.gpu_decode import decoded_on_the_gpu

        train = decoded_on_the_gpu(train, device) or train
    return train, MyDataSet(split.val_images_path, split.val_images_label, val_tf)


class Paths(Sequence[str]):
    """File paths held as one numpy array of their UTF-8 bytes (relative to `root`), not as a list of str.

    1.28 million str objects take some 150 MB, and a loader worker that reads one (touching its reference count)
    copies the memory page it lives on, until every worker holds a copy of them all (PyTorch issue 13246). An
    array is one object, which reading leaves alone; it also pickles in one piece, for the other ranks.
    """

    def __init__(self, paths: Sequence[str] | np.ndarray = (), root: str = "") -> None:
        self.root = root
        self.array = paths if isinstance(paths, np.ndarray) else np.array([path.encode() for path in paths], bytes)

    @classmethod
    def of(cls, paths: Sequence[str]) -> Paths:
        return paths if isinstance(paths, Paths) else cls(paths)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: Any) -> Any:
        """A path (str) for a number; a Paths for a slice, a mask or an array of indices."""
        if isinstance(index, (int, np.integer)):
            relative = self.array[index].decode()
            return os.path.join(self.root, relative) if self.root else relative
        return Paths(self.array[index], self.root)

    def __iter__(self) -> Iterator[str]:
        return (os.path.join(self.root, path) if self.root else path for path in self.relative())

    def __add__(self, other: Sequence[str]) -> Paths:
        if isinstance(other, Paths) and other.root == self.root:
            return Paths(np.concatenate([self.array, other.array]), self.root)
        return Paths([*self, *other])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(other) == list(self)

    def relative(self) -> list[str]:
        """The paths relative to `root` (as a run's split.json keeps them)."""
        return [path.decode() for path in self.array.tolist()]

    def relative_bytes(self) -> list[bytes]:
        return self.array.tolist()

    def __repr__(self) -> str:
        return f"Paths({len(self)} under {self.root or '.'})"


class MyDataSet(torch.utils.data.Dataset):
    """Image files with class indices. Each image is decoded to uint8 RGB pixels (3, H, W); `transform`
    (torchvision.transforms.v2 works on such tensors) crops and flips them."""

    decode = staticmethod(decode_rgb)  # path -> uint8 pixels (3, H, W)

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = Paths.of(images_path)  # see Paths: the loader workers share it, without copies
        self.images_class = list(images_class)
        self.transform = transform
        # Large JPEGs decoded no larger than the transform needs; a decode of one's own is always the one used.
        self.reduction = decode_reduction(transform) if self.decode is decode_rgb else None

    def __len__(self) -> int:
        return len(self.images_path)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path = self.images_path[index]
        img = decode_transformed_reduced(path, self.transform, self.reduction) if self.reduction else None
        if img is None:
            img = self.decode(path)
            if self.transform is not None:
                img = self.transform(img)
        return img, self.images_class[index]

    # The tutorial's `collate_fn=dataset.collate_fn` keeps working. The function itself lives at the top
    # level, so data-loader workers started with spawn can pickle it by name.
    collate_fn = staticmethod(collate_fn)

