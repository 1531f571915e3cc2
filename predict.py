"""Classify images with a trained run: the most likely classes of each image, with their probabilities.

    python predict.py --run runs/single photo.jpg more_photos/
    python predict.py --run runs/single more_photos/ --top-k 1 --json

The run's folder (its --output-dir) holds everything needed: class_indices.json, weights/best.pth, and in
its checkpoint the --model and --image-size it trained with. Each image goes through the run's validation
transform, as evaluation sees it. A file that cannot be read is named on stderr, and the others are still
classified; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model import create_model, model_source, read_state_dict
from multi_train_utils.checkpoint import state_dict_mismatch
from multi_train_utils.cli import MAX_IMAGE_SIZE, DefaultsOnceFormatter, OneLineErrorParser, at_least, path_text
from multi_train_utils.errors import UserInputError, one_line, report
from multi_train_utils.files import load_file
from multi_train_utils.launch import resolve_device, use_device
from multi_train_utils.optim import to_model_input
from multi_train_utils.recorder import CHECKPOINT_NAME
from multi_train_utils.train_eval_utils import class_logits
from my_dataset import UnreadableImageError, build_transforms, decode_rgb
from utils import IMAGE_EXTENSIONS, list_images


@dataclass(frozen=True)
class TrainedRun:
    """What predicting needs from a run's folder."""

    class_names: list[str]
    weights: Path
    model: str
    image_size: int


def get_args_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0], formatter_class=DefaultsOnceFormatter)
    add = parser.add_argument
    add("images", nargs="+", help="image files, or folders whose images (sub-folders too) are all classified")
    add("--run", type=path_text, default=None, help="the --output-dir of a training run (default: the run --weights "
        "belongs to, else output)")
    add("--weights", default=None, help="weights to use instead of the run's weights/best.pth "
        "(such as weights/best_ema.pth)")
    add("--model", default=None, help="the model's name, if not the run's")
    add("--image-size", type=at_least(16, MAX_IMAGE_SIZE), default=None, help="crop size, if not the run's")
    add("--top-k", type=at_least(1), default=3, help="classes to show per image")
    add("--batch-size", type=at_least(1, 4096), default=32, help="images per forward pass")
    add("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N or mps")
    add("--json", action="store_true", help="one JSON object per image and line, instead of a table")
    return parser


def read_run(args: argparse.Namespace) -> TrainedRun:
    """The class names, weights, model and image size of --run, each overridable by its flag. Without --run,
    the run is the one whose weights/ folder --weights is in."""
    run = Path(args.run or (Path(args.weights).parent.parent if args.weights else "output"))
    flag = "--run" if args.run or not args.weights else "--weights"
    classes_file = run / "class_indices.json"
    if not classes_file.is_file():
        where = f"{args.weights}: the run it belongs to, {run}, has" if flag == "--weights" else f"{run}:"
        raise UserInputError(f"{flag} {where} no class_indices.json (give the --output-dir of a training run with "
                             "--run)")
    classes = json.loads(classes_file.read_text())
    class_names = [classes[str(index)] for index in range(len(classes))]
    saved_args = {}
    if not (args.model and args.image_size) and (run / CHECKPOINT_NAME).is_file():
        saved_args = load_file(run / CHECKPOINT_NAME, "--run").get("args", {})
    model, image_size = args.model or saved_args.get("model"), args.image_size or saved_args.get("image_size")
    if not (model and image_size):
        raise UserInputError(f"--run {run}: no {CHECKPOINT_NAME} to read the model and image size from; "
                             "give --model and --image-size")
    return TrainedRun(class_names, Path(args.weights or run / "weights" / "best.pth"), model, image_size)


def load_model(run: TrainedRun, device: torch.device) -> nn.Module:
    model = create_model(run.model, len(run.class_names))
    state = read_state_dict(run.weights)
    problem = state_dict_mismatch(model, state)
    if problem:
        raise UserInputError(f"--weights {run.weights}: does not fit {run.model} with {len(run.class_names)} "
                             f"classes ({problem})")
    model.load_state_dict(state)
    return model.to(device).eval()


def image_files(inputs: Sequence[str]) -> list[str]:
    """The files named, and the images inside the folders named, in a fixed order."""
    found = []
    for item in inputs:
        # A file named is tried whatever its name: if it is no image, it is named as unreadable.
        found += list_images(Path(item), f"{Path(item)}/") if Path(item).is_dir() else [item]
    return found


def batches(paths: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(paths), size):
        yield paths[start:start + size]


@torch.no_grad()
def predict(model: nn.Module, paths: list[str], image_size: int, device: torch.device, batch_size: int,
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, class probabilities) for each readable image; each unreadable one is named on stderr."""
    _, val_transform = build_transforms(image_size)
    for chunk in batches(paths, batch_size):
        images, readable = [], []
        for path in chunk:
            try:
                images.append(val_transform(decode_rgb(path)))
                readable.append(path)
            except (UnreadableImageError, OSError) as err:
                report(f"error: {err}")
        if images:
            logits = class_logits(model(to_model_input(torch.stack(images), device)))
            yield from zip(readable, logits.float().softmax(dim=1).cpu(), strict=True)


def describe(path: str, probabilities: torch.Tensor, class_names: list[str], top_k: int, as_json: bool) -> str:
    values, indices = probabilities.topk(min(top_k, len(class_names)))
    top = [(class_names[i], p) for i, p in zip(indices.tolist(), values.tolist(), strict=True)]
    if as_json:
        return json.dumps({"image": path, "top": [{"class": name, "probability": p} for name, p in top]},
                          allow_nan=False)
    return f"{path}  " + "  ".join(f"{name} {p:.3f}" for name, p in top)


def main(argv: Sequence[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.model:
        model_source(args.model)
    run = read_run(args)
    device = resolve_device(args.device, 0, distributed=False)
    use_device(device)
    model = load_model(run, device)
    paths = image_files(args.images)
    if not paths:
        raise UserInputError(f"no image in {', '.join(args.images)} (nor in its sub-folders: "
                             f"{', '.join(IMAGE_EXTENSIONS)})")
    if hasattr(sys.stdout, "reconfigure"):  # a name that is not UTF-8 is written as the bytes it is, as ls writes it
        sys.stdout.reconfigure(errors="surrogateescape")
    classified = 0
    for path, probabilities in predict(model, paths, run.image_size, device, args.batch_size):
        if not probabilities.isfinite().all():
            raise UserInputError(f"--weights {run.weights}: gives NaN for {path}: these weights have diverged (the "
                                 "loss of their run became NaN or infinite); use an earlier epoch's "
                                 "weights/model-N.pth")
        print(describe(path, probabilities, run.class_names, args.top_k, args.json), flush=True)
        classified += 1
    return 0 if classified == len(paths) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserInputError as stop:
        report(f"error: {one_line(stop)}")
        sys.exit(2)
