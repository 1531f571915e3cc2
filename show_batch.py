"""Save one training batch as a PNG grid, the way the training loop gets it: look at the data before you
train on it.

    python show_batch.py
    python show_batch.py --data-path flower_photos --out flowers_batch.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from PIL import Image

from multi_train_utils.cli import (
    DATA_DEFAULTS,
    DEMO_DEFAULTS,
    MAX_IMAGE_SIZE,
    MAX_SEED,
    OneLineErrorParser,
    at_least,
    path_text,
)
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.errors import UserInputError, one_line, report, system_reason
from utils import build_datasets, plot_data_loader_image, read_data


def main(argv: list[str] | None = None) -> None:
    """Save a grid of one training batch, as the training loop would get it, to look at before training."""
    parser = OneLineErrorParser(description="Save one training batch, un-normalised, as a PNG grid.")
    parser.add_argument("--data-path", type=path_text, default=None,
                        help="image folder; without it, the built-in demo data")
    parser.add_argument("--image-size", type=at_least(16, MAX_IMAGE_SIZE), default=None,
                        help="side of the training crop (default: what the training scripts use on that data)")
    parser.add_argument("--batch-size", type=at_least(1, 1024), default=16, help="images in the grid")
    parser.add_argument("--seed", type=at_least(0, MAX_SEED), default=0,
                        help="seed for the split, the shuffle and the crops")
    parser.add_argument("--out", type=picture_file, default="first_batch.png",
                        help="picture file to write (.png, .jpg, ...)")
    args = parser.parse_args(argv)
    image_size = args.image_size or (DATA_DEFAULTS if args.data_path else DEMO_DEFAULTS)["image_size"]
    torch.manual_seed(args.seed)
    data = read_data(args.data_path, single_process("cpu"), seed=args.seed)
    train_set, _ = build_datasets(data, image_size)
    # The training set, so the grid shows its random crops and flips, not validation's centre crops.
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=train_set.collate_fn)
    try:
        written = plot_data_loader_image(loader, args.out, data.class_names, args.batch_size)
    except OSError as err:
        raise UserInputError(f"--out {args.out}: cannot write there ({system_reason(err)})") from None
    print(f"Wrote {written}")


def picture_file(text: str) -> str:
    """A path whose suffix names a format Pillow writes."""
    Image.init()  # registers every format Pillow has
    if Image.registered_extensions().get(Path(path_text(text)).suffix.lower()) not in Image.SAVE:
        raise argparse.ArgumentTypeError(f"expected a picture file (.png, .jpg, ...), got {text!r}")
    return text


if __name__ == "__main__":
    try:
        main()
    except UserInputError as stop:
        report(f"error: {one_line(stop)}")
        sys.exit(2)
