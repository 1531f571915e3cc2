"""The benchmark's plain DDP script: the job of bench/peers_benchmark.py as a tutorial writes it
(DistributedSampler, DDP, a loop), with no engine:

    torchrun --standalone --nproc_per_node=2 bench/peers/plain_ddp.py JOB.json
"""

import json
import time

import torch
import torch.distributed as dist
import torchvision
from photos import Photos, read_job
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler


def main(job: dict) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(job["seed"])
    train_set, val_set = Photos(job, "train"), Photos(job, "val")
    sampler = DistributedSampler(train_set, seed=job["seed"])
    workers = dict(num_workers=job["workers"], persistent_workers=job["workers"] > 0)
    loader = DataLoader(train_set, job["batch_size"], sampler=sampler, drop_last=True, **workers)
    val_loader = DataLoader(val_set, job["batch_size"], sampler=DistributedSampler(val_set, shuffle=False), **workers)
    model = nn.parallel.DistributedDataParallel(torchvision.models.resnet18(num_classes=len(job["classes"])))
    optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"] * world_size, momentum=0.9, weight_decay=1e-4)
    for epoch in range(job["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        started, images = time.time(), 0
        for step, (inputs, labels) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            images += len(labels) * world_size
            if epoch == step == 0 and rank == 0:
                print(json.dumps({"first_step_at": time.time()}), flush=True)
        images_per_s = images / (time.time() - started)
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for inputs, labels in val_loader:
                correct += torch.tensor([(model(inputs).argmax(1) == labels).sum().item(), len(labels)])
        dist.all_reduce(correct)
        if rank == 0:
            val_acc = (correct[0] / correct[1]).item()
            print(json.dumps({"epoch": epoch, "images_per_s": images_per_s, "val_acc": val_acc}), flush=True)
            torch.save(model.module.state_dict(), f"{job['output_dir']}/model-{epoch}.pth")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(read_job())
