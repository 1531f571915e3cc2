"""The uint8 input pipeline: the same pixels as the float32 PIL pipeline it replaced, decoded faster,
normalised on the training device; and how many loader workers each process gets."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import multi_train_utils.data as data
from conftest import REPO, requires_cuda
from multi_train_utils import gpu_decode
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.optim import IMAGENET_MEAN, IMAGENET_STD, StepOptions, normalisation, to_model_input
from multi_train_utils.pictures import batch_grid
from my_dataset import (
    MyDataSet,
    build_transforms,
    collate_fn,
    decode_reduction,
    decode_rgb,
    decode_transformed,
    load_rgb,
)
from utils import build_datasets, read_split_data

spec = importlib.util.spec_from_file_location("loader_benchmark", REPO / "bench" / "loader_benchmark.py")
loader_benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader_benchmark)


def photo_like(path: Path, size: tuple[int, int] = (500, 375), mode: str = "RGB", **save: object) -> Path:
    """A JPEG with what photographs have: smooth shading, sharp edges and fine texture."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(0)
    pixels = np.stack([127 + 100 * np.sin(x / 37), 127 + 100 * np.cos(y / 23), 255 * (x + y) / (width + height)], -1)
    pixels[(x - width / 2) ** 2 + (y - height / 2) ** 2 < (height / 4) ** 2] = (230, 40, 40)  # a disc
    pixels += rng.normal(0, 18, pixels.shape)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").convert(mode).save(path, quality=90, **save)
    return path


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_jpegs_decode_to_the_same_pixels_as_pillow(tmp_path: Path, mode: str) -> None:
    path = photo_like(tmp_path / "photo.jpg", mode=mode, progressive=mode == "RGB")
    pixels = decode_rgb(str(path))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 375, 500)
    assert torch.equal(pixels, torch.from_numpy(np.array(load_rgb(str(path)))).permute(2, 0, 1))


def test_exif_orientation_and_a_png_named_jpg(tmp_path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    rotated = photo_like(tmp_path / "rotated.jpg", size=(40, 20), exif=exif)
    assert torch.equal(decode_rgb(str(rotated)), torch.from_numpy(np.array(load_rgb(str(rotated)))).permute(2, 0, 1))
    assert decode_rgb(str(rotated)).shape == (3, 40, 20)
    png = tmp_path / "really_a_png.jpg"
    Image.new("RGBA", (8, 6), (0, 0, 0, 0)).save(png, format="PNG")
    assert decode_rgb(str(png)).shape == (3, 6, 8) and decode_rgb(str(png)).min() == 255  # transparent: white


def old_and_new(path: Path, transform_index: int, seed: int, image_size: int = 224) -> tuple[torch.Tensor, ...]:
    """One image through the float32 PIL pipeline and through the uint8 one, with the same random draws
    (transforms and transforms.v2 draw the crop box and the flip from torch in the same order)."""
    old = loader_benchmark.tutorial_transforms(image_size) if transform_index == 0 else None
    if old is None:
        from torchvision import transforms

        old = transforms.Compose([transforms.Resize(round(image_size * 256 / 224)),
                                  transforms.CenterCrop(image_size), transforms.ToTensor(),
                                  transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    # The tutorial's own two pipelines in transforms.v2, on uint8 tensors (build_transforms is yours to change).
    train = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    new = v2.Compose(train if transform_index == 0
                     else [v2.Resize(round(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)])
    torch.manual_seed(seed)
    expected = old(load_rgb(str(path)))
    torch.manual_seed(seed)
    got = to_model_input(new(decode_rgb(str(path))).unsqueeze(0), torch.device("cpu"))[0]
    return expected, got


def resizes_uint8_like_pillow() -> bool:
    """Whether transforms.v2 resizes uint8 images with torch's uint8 kernel, which rounds as Pillow does, rather
    than through float32. Before torchvision 0.24 it took the uint8 kernel only on CPUs that torch reports as
    AVX2, not on AVX-512 ones (pytorch/vision#8374); the two give the same pixels only when it takes it."""
    image = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    uint8_kernel = torch.nn.functional.interpolate(image[None], size=(17, 23), mode="bilinear", antialias=True)[0]
    return torch.equal(F.resize(image, [17, 23], antialias=True), uint8_kernel)


@pytest.mark.parametrize("transform_index", [0, 1], ids=["train", "val"])
def test_the_model_sees_what_the_float32_pil_pipeline_gave_within_rounding(tmp_path: Path,
                                                                           transform_index: int) -> None:
    """Both crop the same box and resize it with an antialiased bilinear filter, rounding to uint8 after
    resizing; their fixed-point arithmetic differs in the last bit, so a pixel may be one level of 255 off
    (0.0175 after the normalisation). Measured here and on eight real 500 x 375 photos, six crops each:
    at most 1 level, 0.001 levels on average. Resized through float32 instead (resizes_uint8_like_pillow),
    this image is still at most 1 level off, 0.17 on average."""
    path = photo_like(tmp_path / "photo.jpg")
    mean_limit = 0.02 if resizes_uint8_like_pillow() else 0.25
    for seed in range(6 if transform_index == 0 else 1):
        expected, got = old_and_new(path, transform_index, seed)
        assert got.shape == expected.shape == (3, 224, 224) and got.dtype == torch.float32
        levels = (got - expected).abs() * torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255
        assert levels.max() <= 1.01, f"seed {seed}: a pixel {levels.max():.2f} levels off"
        assert levels.mean() < mean_limit, f"seed {seed}: {levels.mean():.4f} levels off on average"


def test_the_step_normalises_uint8_batches_on_the_device_in_the_memory_format() -> None:
    pixels = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    options = StepOptions("cpu", channels_last=True)
    images, labels = options.to_device(pixels, torch.tensor([0, 1]), torch.device("cpu"))
    assert labels.tolist() == [0, 1]
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(images, (pixels / 255 - mean) / std)
    floats = torch.randn(2, 3, 8, 8)
    assert torch.equal(to_model_input(floats, torch.device("cpu")), floats), "batches already in floats pass unchanged"


def test_collate_stacks_into_shared_memory_inside_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a worker, default_collate stacks straight into shared memory; a plain torch.stack would leave
    the batch to be copied there once more on its way to the training process."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    pixels = torch.zeros(3, 4, 4, dtype=torch.uint8)
    images, labels = collate_fn([(pixels, 1), (pixels + 1, 2)])
    assert images.is_shared() and images.dtype == torch.uint8 and labels.tolist() == [1, 2]


def test_the_batch_grid_shows_uint8_batches() -> None:
    red = torch.tensor([255, 0, 0], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 8, 8)
    assert batch_grid(red, torch.tensor([0, 1])).getpixel((64, 64)) == (255, 0, 0)


@pytest.mark.parametrize(("cpus", "local_processes", "device", "workers"), [
    (12, 1, "cuda", 11),  # one CPU left to the training process
    (12, 4, "cuda", 2),   # 3 CPUs per GPU process
    (128, 1, "cuda", data.MAX_GPU_WORKERS),
    (1, 1, "cuda", 1),
    (2, 1, "cpu", 0),     # on a CPU, training needs the cores itself
    (32, 2, "cpu", 4),
])
def test_default_workers_count_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                             local_processes: int, device: str, workers: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 256)  # the machine's count must not matter
    ctx = DistContext(0, 0, local_processes, local_processes, torch.device(device), local_processes > 1)
    assert data.default_workers(ctx) == workers


def mixed_folder(root: Path) -> list[Path]:
    """JPEGs of several sizes, and what the GPU must not decode: an EXIF-rotated JPEG and a PNG."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return [photo_like(root / "a.jpg", (500, 375)), photo_like(root / "b.jpg", (320, 480)),
            photo_like(root / "rotated.jpg", (300, 200), exif=exif), photo_like(root / "c.png", (260, 300)),
            photo_like(root / "gray.jpg", (400, 300), mode="L")]


def test_gpu_decode_logic_on_the_cpu_gives_the_workers_crops_flips_and_labels(tmp_path: Path) -> None:
    """--decode-on gpu's decoding and the dataset's own training transform, run on the CPU: on the same seed,
    the same batch as the workers' pipeline, image for image, labels in order. An augmentation added to the
    transform (TrivialAugmentWide) applies on both paths alike."""
    paths = [str(p) for p in mixed_folder(tmp_path)]
    labels = [4, 0, 3, 1, 2]
    for transform in (build_transforms(64)[0], v2.Compose([*build_transforms(64)[0].transforms,
                                                           v2.TrivialAugmentWide()])):
        reference = MyDataSet(paths, labels, transform)
        encoded = gpu_decode.EncodedImages(reference)
        batch, batch_labels = encoded.collate_fn([encoded[i] for i in range(len(paths))])
        assert batch.shapes[:, 0].tolist() == [0, 0, 3, 3, 0], "the rotated JPEG and the PNG come decoded"
        for seed in range(3):
            torch.manual_seed(seed)
            on_device = batch.decode_and_augment(torch.device("cpu"))
            torch.manual_seed(seed)
            expected = torch.stack([reference[i][0] for i in range(len(paths))])
            assert on_device.dtype == torch.uint8 and torch.equal(on_device, expected), f"seed {seed}"
        assert batch_labels.tolist() == labels


def test_decode_on_gpu_falls_back_on_a_cpu_and_names_the_non_jpegs_on_a_gpu(image_folder: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    for i, jpeg in enumerate(sorted(image_folder.glob("*/*.jpg"))[:2]):  # JPEGs as Windows' browsers name them
        jpeg.rename(jpeg.with_suffix((".jfif", ".JPE")[i]))
    split = read_split_data(image_folder)
    train, _ = build_datasets(split, 16, "gpu", torch.device("cpu"))
    assert type(train) is MyDataSet
    assert "--decode-on gpu: training on cpu, so the loader workers decode the images" in capsys.readouterr().out
    train, val = build_datasets(split, 16, "gpu", torch.device("cuda"))
    assert type(train) is gpu_decode.EncodedImages and type(val) is MyDataSet
    pngs = sum(path.endswith(".png") for path in split.train_images_path)
    assert 0 < pngs < 24
    assert f"{pngs} of 24 training images are not JPEGs; the loader workers decode those" in capsys.readouterr().out


def test_encoded_batches_cross_from_a_worker_and_can_be_looked_at(tmp_path: Path) -> None:
    paths = [str(p) for p in mixed_folder(tmp_path)]
    encoded = gpu_decode.EncodedImages(MyDataSet(paths, [0, 1, 0, 1, 0], build_transforms(48)[0]))
    loader = torch.utils.data.DataLoader(encoded, batch_size=5, num_workers=1, collate_fn=encoded.collate_fn,
                                         multiprocessing_context="fork")
    batch, labels = next(iter(loader))
    assert isinstance(batch, gpu_decode.EncodedBatch) and labels.tolist() == [0, 1, 0, 1, 0]
    assert batch.decode_and_augment(torch.device("cpu")).shape == (5, 3, 48, 48)
    assert batch_grid(batch, labels).size == (4 * 128, 2 * (128 + 14))


def test_the_loader_benchmark_times_both_pipelines_on_the_same_files(image_folder: Path) -> None:
    figures = loader_benchmark.loader_benchmark(str(image_folder), 16, workers=0, repeats=2, batch_size=2, images=4)
    assert figures["loader_images_per_s_per_worker"] > 0 and figures["loader_images_per_s_per_worker_tutorial"] > 0
    assert figures["loader_speedup"] == pytest.approx(figures["loader_images_per_s_per_worker"]
                                                      / figures["loader_images_per_s_per_worker_tutorial"])
    assert len(figures["runs"]["default"]) == len(figures["runs"]["tutorial"]) == 2


def test_photos_are_made_at_photo_size_one_class_per_source(tmp_path: Path) -> None:
    sources = [photo_like(tmp_path / "one.jpg", (640, 427)), photo_like(tmp_path / "two.png", (300, 451))]
    root = loader_benchmark.make_photos(tmp_path / "photos", sources, per_source=3)
    split = read_split_data(root)
    assert split.class_names == ["one", "two"]
    for path in split.train_images_path + split.val_images_path:
        with Image.open(path) as photo:
            assert photo.format == "JPEG" and photo.size == loader_benchmark.PHOTO_SIZE


@requires_cuda
@pytest.mark.gpu
def test_on_a_gpu_nvjpeg_gives_the_workers_batch_within_rounding(tmp_path: Path) -> None:
    """nvjpeg's inverse DCT and the GPU's float resizing round differently from libjpeg-turbo and the CPU's
    fixed-point resizing: a few levels here and there. A wrong box or flip would be tens of levels off."""
    paths = [str(p) for p in mixed_folder(tmp_path)]
    encoded = gpu_decode.EncodedImages(MyDataSet(paths, list(range(len(paths))), build_transforms(64)[0]))
    batch, _ = encoded.collate_fn([encoded[i] for i in range(len(paths))])
    torch.manual_seed(0)
    on_gpu = batch.decode_and_augment(torch.device("cuda"))
    torch.manual_seed(0)
    on_cpu = batch.decode_and_augment(torch.device("cpu"))
    assert on_gpu.is_cuda and on_gpu.dtype == torch.uint8
    levels = (on_gpu.cpu().int() - on_cpu.int()).abs().float()
    assert levels.mean() < 2.0, f"{levels.mean():.2f} levels off on average"
    images, _ = StepOptions("cuda", channels_last=True).to_device(batch, torch.tensor([0]), torch.device("cuda"))
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)


def test_the_normalisation_constants_are_made_once_per_device() -> None:
    """Made in every step, their copy to a GPU would make the CPU wait for the GPU every step."""
    first, again = normalisation(torch.device("cpu")), normalisation(torch.device("cpu"))
    assert first[0] is again[0] and first[1] is again[1]


def test_fit_and_eval_only_end_the_loader_workers_when_they_return(image_folder: Path) -> None:
    """Persistent workers left to the garbage collector wait out torch's 5 s timeout each before they end; fit
    and evaluate_only end them on return, so none is alive then, and a loader iterated again starts anew."""
    import multiprocessing

    from multi_train_utils.data import build_loaders
    from multi_train_utils.train_eval_utils import evaluate_only, fit

    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    train_set, val_set = build_datasets(read_split_data(image_folder), 16)
    train_loader, val_loader = build_loaders(train_set, val_set, 4, ctx, workers=2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(3))
    model(torch.zeros(1, 3, 16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    fit(model, torch.nn.CrossEntropyLoss(), optimizer, train_loader, val_loader, ctx.device, epochs=2)
    assert multiprocessing.active_children() == [], "the workers outlived fit"
    assert next(iter(val_loader))[0].shape[0] == 4, "iterated again, the loader starts new workers"
    evaluate_only(model, torch.nn.CrossEntropyLoss(), val_loader, ctx.device, StepOptions("cpu"), ["a", "b", "c"])
    assert multiprocessing.active_children() == [], "the workers outlived evaluate_only"


@pytest.mark.parametrize("image_size", [224, 64])
def test_a_large_jpeg_is_decoded_no_larger_than_the_transform_needs_and_ends_the_same(tmp_path: Path,
                                                                                     image_size: int) -> None:
    """A phone's 4032 x 3024: the random crop is drawn for its full size, with the same random numbers, and
    cut from a picture that libjpeg decoded at 1/2, 1/4 or 1/8 of each side; the flips and every later step
    are the same, and it is upright too when EXIF turns it. The pixels differ by what DCT scaling does
    otherwise than the antialiased bilinear filter (docs/input-pipeline.md has the measured figures)."""
    path = photo_like(tmp_path / "photo.jpg", size=(4032, 3024))
    turned = photo_like(tmp_path / "turned.jpg", size=(4032, 3024), exif=sideways_exif())
    limit = 3.0 if image_size == 224 else 5.0  # levels of 255, on average over a crop
    factors = (2, 4) if image_size == 224 else (8, 8)  # of the training crop, of the validation crop
    for transform, factor in zip(build_transforms(image_size), factors, strict=True):
        reduction = decode_reduction(transform)
        assert reduction(4032, 3024) == factor
        for file in (path, turned):
            for seed in range(4):
                torch.manual_seed(seed)
                full = transform(decode_rgb(str(file)))
                torch.manual_seed(seed)
                reduced = MyDataSet([str(file)], [0], transform)[0][0]
                assert reduced.shape == full.shape == (3, image_size, image_size)
                levels = (reduced.float() - full.float()).abs().mean()
                assert levels < limit, f"{file.name}, seed {seed}: {levels:.2f} levels off on average"
                torch.manual_seed(seed)
                assert torch.equal(reduced, decode_transformed(str(file), transform, reduction)), \
                    "the dataset decoded every pixel"
    small, train = photo_like(tmp_path / "small.jpg"), build_transforms(224)[0]  # 500 x 375: each pixel is needed
    assert decode_reduction(train)(500, 375) == 1
    torch.manual_seed(0)
    full = train(decode_rgb(str(small)))
    torch.manual_seed(0)
    assert torch.equal(MyDataSet([str(small)], [0], train)[0][0], full), "not the pixels of the whole pipeline"
    assert decode_reduction(v2.Compose([v2.RandomCrop(32), v2.Resize(16)])) is None, "a crop of so many pixels first"

    class OwnDecode(MyDataSet):
        decode = staticmethod(lambda path: torch.zeros(3, 500, 500, dtype=torch.uint8))

    assert OwnDecode([str(path)], [0], train)[0][0].max() == 0, "a decode of one's own was passed over"
    dataset = MyDataSet([str(path)], [0], train)
    dataset.decode = lambda path: torch.zeros(3, 500, 500, dtype=torch.uint8)
    assert dataset[0][0].max() == 0, "a decode of one's own, set on the dataset, was passed over"
    assert MyDataSet([str(path)], [0], v2.RandomResizedCrop(64))[0][0].shape == (3, 64, 64), "a transform alone"


def sideways_exif() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the camera was held upright
    return exif.tobytes()


def test_a_jpeg_that_pillow_refuses_to_open_is_still_decoded_by_torchvision(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "large.jpg"
    Image.new("RGB", (400, 300), (200, 30, 30)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # its 120,000 pixels are now a "decompression bomb"
    train_tf, _ = build_transforms(32)
    image, _ = MyDataSet([str(path)], [0], train_tf)[0]
    assert image.shape == (3, 32, 32) and abs(int(image[0].float().mean()) - 200) <= 3
