"""What every contestant of bench/peers_benchmark.py reads the same way: the job (a JSON file the benchmark
writes: the photos, the project's split, the flags) and the tutorial's PIL data pipeline for it."""

import json
import sys

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

NORMALISE = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def read_job() -> dict:
    with open(sys.argv[1]) as file:
        return json.load(file)


class Photos(Dataset):
    """The split's files of one side, as the tutorial reads them: PIL, then float32 tensors."""

    def __init__(self, job: dict, side: str) -> None:
        self.root, self.files = job["root"], job[side]
        self.labels = [job["classes"].index(name.split("/")[0]) for name in self.files]
        size = job["image_size"]
        self.transform = transforms.Compose(
            [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), NORMALISE]
            if side == "train" else
            [transforms.Resize(round(size * 256 / 224)), transforms.CenterCrop(size), transforms.ToTensor(), NORMALISE])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(f"{self.root}/{self.files[index]}") as image:
            return self.transform(image.convert("RGB")), self.labels[index]
