"""What DDP promises, checked with real processes on gloo: same weights as one big batch, exact evaluation."""

from __future__ import annotations

from pathlib import Path

import ddp_workers
import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port
from multi_train_utils.distributed_utils import single_process


@pytest.fixture
def rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_two_processes_with_batch_b_equal_one_process_with_batch_2b(tmp_path: Path, rendezvous: None) -> None:
    batch, samples = 4, 32
    mp.spawn(ddp_workers.equal_weights_worker, args=(2, batch, samples, str(tmp_path)), nprocs=2)
    rank0 = torch.load(tmp_path / "rank0.pth", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pth", weights_only=True)
    single = ddp_workers.train_fixed_order(single_process("cpu"), 2 * batch, samples).state_dict()
    start = ddp_workers.small_net().state_dict()
    for name, weight in single.items():
        assert torch.equal(rank0[name], rank1[name]), f"{name}: the two replicas drifted apart"
        assert not torch.allclose(weight, start[name]), f"{name} did not train"
        assert torch.allclose(rank0[name], weight, atol=1e-5, rtol=0), (
            f"{name}: max difference {(rank0[name] - weight).abs().max():.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_equals_one_process(tmp_path: Path, rendezvous: None, world_size: int) -> None:
    sizes = [7, 11]
    mp.spawn(ddp_workers.exact_evaluation_worker, args=(world_size, sizes, str(tmp_path)), nprocs=world_size)
    ctx = single_process("cpu")
    model = ddp_workers.small_net()
    for rank in range(world_size):
        results = torch.load(tmp_path / f"eval_rank{rank}.pth", weights_only=True)
        for count in sizes:
            alone = ddp_workers.evaluate(model, ddp_workers.evaluation_loader(ctx, count), ctx.device)
            correct, total, loss = results[count]
            assert total == count, "padding or skipping changed the number of images"
            assert (correct, total) == (alone.correct, alone.total)
            assert loss == pytest.approx(alone.loss, rel=1e-6)  # float32 sums in another order


def test_validation_shards_cover_every_image_once() -> None:
    from multi_train_utils.data import UnpaddedDistributedSampler

    for count in (7, 11, 2, 0):
        for world_size in (1, 2, 3, 8):
            shards = [list(UnpaddedDistributedSampler(count, world_size, r)) for r in range(world_size)]
            assert sorted(i for shard in shards for i in shard) == list(range(count))
            assert [len(UnpaddedDistributedSampler(count, world_size, r)) for r in range(world_size)] == [
                len(s) for s in shards]

