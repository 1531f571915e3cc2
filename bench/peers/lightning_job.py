"""The job of bench/peers_benchmark.py with Lightning's Trainer, which starts the second process itself:

    python bench/peers/lightning_job.py JOB.json
"""

import json
import time

import lightning as L
import torch
import torchvision
from photos import Photos, read_job
from torch import nn
from torch.utils.data import DataLoader


class Classifier(L.LightningModule):
    def __init__(self, job: dict) -> None:
        super().__init__()
        self.job, self.model = job, torchvision.models.resnet18(num_classes=len(job["classes"]))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self.model(inputs), labels)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> None:
        inputs, labels = batch
        self.log("val_acc", (self.model(inputs).argmax(1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.job["lr"] * self.trainer.world_size, momentum=0.9,
                               weight_decay=1e-4)


class Timings(L.Callback):
    """The same figures as the other contestants print: when the first step ended, and each epoch's images/s."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.last_step_at = time.time()  # the epoch's end for its images/s: validation comes before its hook
        if trainer.global_step == 1 and trainer.is_global_zero:
            print(json.dumps({"first_step_at": self.last_step_at}), flush=True)

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.started = time.time()

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        images = trainer.num_training_batches * module.job["batch_size"] * trainer.world_size
        images_per_s = images / (self.last_step_at - self.started)
        if trainer.is_global_zero:
            print(json.dumps({"epoch": trainer.current_epoch, "images_per_s": images_per_s}), flush=True)


def main(job: dict) -> None:
    L.seed_everything(job["seed"])
    workers = dict(num_workers=job["workers"], persistent_workers=job["workers"] > 0)
    loader = DataLoader(Photos(job, "train"), job["batch_size"], shuffle=True, drop_last=True, **workers)
    val_loader = DataLoader(Photos(job, "val"), job["batch_size"], **workers)
    trainer = L.Trainer(accelerator="cpu", devices=job["processes"], strategy="ddp", max_epochs=job["epochs"],
                        default_root_dir=job["output_dir"], callbacks=[Timings()], enable_progress_bar=False)
    trainer.fit(Classifier(job), loader, val_loader)


if __name__ == "__main__":
    main(read_job())
