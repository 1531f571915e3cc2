"""Which classes the model confuses: per-class figures from a confusion matrix, and the matrix as a picture.

The matrix has one row per true class and one column per predicted class, in class-index order; its
diagonal holds the correct answers, and it sums to the number of validation images.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def count_confusion(labels: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> torch.Tensor:
    """This batch's confusion matrix (num_classes x num_classes), counted on the labels' device."""
    pairs = labels.long() * num_classes + predictions.long()
    # index_add_, not bincount: on a GPU bincount reads the largest value back to size its output, a wait
    # for the GPU in every validation batch.
    counts = torch.zeros(num_classes * num_classes, dtype=torch.long, device=labels.device)
    return counts.index_add_(0, pairs, torch.ones_like(pairs)).view(num_classes, num_classes)


def per_class(confusion: list[list[int]], class_names: list[str]) -> dict[str, dict[str, float]]:
    """Precision (of the images predicted as the class, the share that are it), recall (of the images of
    the class, the share found) and count (its validation images) for each class name. A class nothing was
    predicted as has precision 0, as scikit-learn reports it."""
    matrix = np.asarray(confusion, dtype=np.int64)
    figures = {}
    for index, name in enumerate(class_names):
        hits, predicted, count = matrix[index, index], matrix[:, index].sum(), matrix[index].sum()
        figures[name] = {"precision": float(hits / predicted) if predicted else 0.0,
                         "recall": float(hits / count) if count else 0.0, "count": int(count)}
    return figures


CELL = 44  # pixels per cell of the picture


def confusion_image(confusion: list[list[int]], class_names: list[str], title: str = "") -> Image.Image:
    """The matrix as an RGB picture with class names: each cell shaded by its share of its row (the true
    class), so that a class with few images shows its errors as plainly as a large one."""
    matrix = np.asarray(confusion, dtype=np.int64)
    font = ImageFont.load_default(13)
    label_width = max(int(font.getlength(name)) for name in class_names) + 12
    top = 48 + label_width  # room for the title and the predicted classes' names, written upwards
    side = len(class_names) * CELL
    title = title or "Confusion matrix (rows: true class, columns: predicted)"
    width = max(label_width + side, int(font.getlength(title))) + 12
    image = Image.new("RGB", (width, top + side + 30), "white")
    draw = ImageDraw.Draw(image)
    draw.text((6, 6), title, fill="black", font=font)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    for row, name in enumerate(class_names):
        draw.text((6, top + row * CELL + CELL // 2 - 7), name, fill="black", font=font)
        upwards = Image.new("RGB", (label_width, 18), "white")
        ImageDraw.Draw(upwards).text((2, 2), name, fill="black", font=font)
        image.paste(upwards.rotate(90, expand=True), (label_width + row * CELL + CELL // 2 - 9, 40))
        for column in range(len(class_names)):
            shade = int(255 * (1 - shares[row, column]))
            box = (label_width + column * CELL, top + row * CELL)
            draw.rectangle([*box, box[0] + CELL - 1, box[1] + CELL - 1], fill=(shade, shade, 255), outline="grey")
            text = str(matrix[row, column])
            draw.text((box[0] + (CELL - font.getlength(text)) / 2, box[1] + CELL // 2 - 7), text,
                      fill="white" if shade < 128 else "black", font=font)
    draw.text((label_width, top + side + 8), "predicted class", fill="black", font=font)
    return image
