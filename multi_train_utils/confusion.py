"""Which classes the model confuses: per-class figures, the confusion matrix, and the matrix as a picture, all
exact on any number of processes and bounded at any number of classes.

The matrix has one row per true class and one column per predicted class, in class-index order; its diagonal
holds the correct answers, and it sums to the number of validation images. It is counted up to
MAX_MATRIX_CLASSES classes (1024 x 1024 counts: 8 MB); the per-class figures at any count (three counts per
class). A metrics.jsonl line carries the matrix and the per-class figures up to MAX_LINE_CLASSES classes;
past that, the classes confused most, and the whole matrix is in a file of its own. The picture shows at most
MAX_PICTURE_CLASSES classes: past that, those confused most.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

MAX_MATRIX_CLASSES = 1024
MAX_LINE_CLASSES = 100
MAX_PICTURE_CLASSES = 30
MOST_CONFUSED = 20  # pairs (true class, predicted class) a line names past MAX_LINE_CLASSES
CELL = 44  # pixels per cell of the picture


def class_sums(labels: torch.Tensor, predictions: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """This batch's counts per class (images, correct answers, predictions), and its confusion matrix where
    there are few enough classes; counted on the labels' device. index_add_, not bincount: on a GPU bincount
    reads the largest value back to size its output, a wait for the GPU in every validation batch."""
    labels, predictions = labels.long(), predictions.long()
    ones = torch.ones_like(labels)

    def per_class_count(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_classes, dtype=torch.long, device=labels.device).index_add_(0, index, values)

    sums = {"class_images": per_class_count(labels, ones),
            "class_correct": per_class_count(labels, (labels == predictions).long()),
            "class_predicted": per_class_count(predictions, ones)}
    if num_classes <= MAX_MATRIX_CLASSES:
        pairs = labels * num_classes + predictions
        counts = torch.zeros(num_classes * num_classes, dtype=torch.long, device=labels.device)
        sums["confusion"] = counts.index_add_(0, pairs, ones).view(num_classes, num_classes)
    return sums


def per_class(sums: dict[str, torch.Tensor], class_names: list[str]) -> dict[str, dict[str, float]]:
    """Precision (of the images predicted as the class, the share that are it), recall (of the images of
    the class, the share found) and count (its validation images) for each class name. A class nothing was
    predicted as has precision 0, as scikit-learn reports it."""
    images, correct, predicted = (sums[name].long().tolist() for name in
                                  ("class_images", "class_correct", "class_predicted"))
    return {name: {"precision": hits / guessed if guessed else 0.0, "recall": hits / count if count else 0.0,
                   "count": count}
            for name, hits, guessed, count in zip(class_names, correct, predicted, images, strict=True)}


def most_confused(confusion: torch.Tensor, limit: int) -> list[tuple[int, int, int]]:
    """The `limit` largest off-diagonal counts, as (true class, predicted class, count), largest first."""
    errors = confusion.clone()
    errors.fill_diagonal_(0)
    counts, flat = errors.flatten().topk(min(limit, errors.numel()))
    side = confusion.shape[1]
    return [(index // side, index % side, count) for index, count in zip(flat.tolist(), counts.tolist(), strict=True)
            if count > 0]


def class_figures(sums: dict[str, torch.Tensor], class_names: list[str]) -> dict[str, Any]:
    """What a metrics.jsonl line says of the classes: the matrix and every class's figures up to
    MAX_LINE_CLASSES classes; past that the classes confused most (the whole matrix is in a file of its own,
    see RunRecorder), so that a line stays small at any number of classes."""
    confusion = sums.get("confusion")
    if len(class_names) <= MAX_LINE_CLASSES:
        return {"confusion_matrix": confusion.long().tolist() if confusion is not None else [],
                "per_class": per_class(sums, class_names)}
    if confusion is None:
        return {}
    return {"most_confused": [{"true": class_names[true], "predicted": class_names[guess], "count": count}
                              for true, guess, count in most_confused(confusion.long(), MOST_CONFUSED)]}


def classes_to_draw(confusion: torch.Tensor, limit: int = MAX_PICTURE_CLASSES) -> list[int]:
    """Every class up to `limit`; past that the `limit` classes with the most errors, made or suffered, in
    class-index order."""
    if len(confusion) <= limit:
        return list(range(len(confusion)))
    errors = confusion.sum(0) + confusion.sum(1) - 2 * confusion.diagonal()
    return sorted(errors.topk(limit).indices.tolist())


def confusion_image(confusion: torch.Tensor, class_names: list[str], title: str = "") -> Image.Image:
    """The matrix as an RGB picture with class names: each cell shaded by its share of its row (the true
    class), so that a class with few images shows its errors as plainly as a large one. Past
    MAX_PICTURE_CLASSES classes, only the rows and columns of those confused most."""
    from PIL import ImageDraw, ImageFont

    shown = classes_to_draw(confusion)
    matrix = confusion.long().numpy()
    shares = matrix[shown] / np.maximum(matrix[shown].sum(axis=1, keepdims=True), 1)
    names = [class_names[index] for index in shown]
    font = ImageFont.load_default(13)
    label_width = max(int(font.getlength(name)) for name in names) + 12
    top = 48 + label_width  # room for the title and the predicted classes' names, written upwards
    side = len(names) * CELL
    title = title or "Confusion matrix (rows: true class, columns: predicted)"
    if len(shown) < len(class_names):
        title += f": the {len(shown)} of {len(class_names)} classes confused most"
    width = max(label_width + side, int(font.getlength(title))) + 12
    image = Image.new("RGB", (width, top + side + 30), "white")
    draw = ImageDraw.Draw(image)
    draw.text((6, 6), title, fill="black", font=font)
    for row, name in enumerate(names):
        draw.text((6, top + row * CELL + CELL // 2 - 7), name, fill="black", font=font)
        upwards = Image.new("RGB", (label_width, 18), "white")
        ImageDraw.Draw(upwards).text((2, 2), name, fill="black", font=font)
        image.paste(upwards.rotate(90, expand=True), (label_width + row * CELL + CELL // 2 - 9, 40))
        for column, predicted in enumerate(shown):
            shade = int(255 * (1 - shares[row, predicted]))
            box = (label_width + column * CELL, top + row * CELL)
            draw.rectangle([*box, box[0] + CELL - 1, box[1] + CELL - 1], fill=(shade, shade, 255), outline="grey")
            text = str(matrix[shown[row], predicted])
            draw.text((box[0] + (CELL - font.getlength(text)) / 2, box[1] + CELL // 2 - 7), text,
                      fill="white" if shade < 128 else "black", font=font)
    draw.text((label_width, top + side + 8), "predicted class", fill="black", font=font)
    return image
