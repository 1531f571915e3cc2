"""The job of bench/peers_benchmark.py with Hugging Face Accelerate, started by torchrun (`accelerate launch
--num_processes 2 --cpu` starts one process on a machine without a GPU):

    torchrun --standalone --nproc_per_node=2 bench/peers/accelerate_job.py JOB.json
"""

import json
import time

import torch
import torchvision
from accelerate import Accelerator
from photos import Photos, read_job
from torch import nn
from torch.utils.data import DataLoader


def main(job: dict) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(job["seed"])
    workers = dict(num_workers=job["workers"], persistent_workers=job["workers"] > 0)
    loader = DataLoader(Photos(job, "train"), job["batch_size"], shuffle=True, drop_last=True, **workers)
    val_loader = DataLoader(Photos(job, "val"), job["batch_size"], **workers)
    model = torchvision.models.resnet18(num_classes=len(job["classes"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"] * accelerator.num_processes, momentum=0.9,
                                weight_decay=1e-4)
    model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)
    for epoch in range(job["epochs"]):
        model.train()
        started, images = time.time(), 0
        for step, (inputs, labels) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            images += len(labels) * accelerator.num_processes
            if epoch == step == 0 and accelerator.is_main_process:
                print(json.dumps({"first_step_at": time.time()}), flush=True)
        images_per_s = images / (time.time() - started)
        model.eval()
        correct, total = 0, 0
        with torch.no_grad():
            for inputs, labels in val_loader:
                predictions, labels = accelerator.gather_for_metrics((model(inputs).argmax(1), labels))
                correct, total = correct + (predictions == labels).sum().item(), total + len(labels)
        if accelerator.is_main_process:
            print(json.dumps({"epoch": epoch, "images_per_s": images_per_s, "val_acc": correct / total}), flush=True)
            accelerator.save(accelerator.unwrap_model(model).state_dict(), f"{job['output_dir']}/model-{epoch}.pth")
    accelerator.end_training()


if __name__ == "__main__":
    main(read_job())
