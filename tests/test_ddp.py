"""What DDP promises, checked with real processes on gloo: same weights as one big batch, exact evaluation."""

from __future__ import annotations

from pathlib import Path

import ddp_workers
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from conftest import free_port
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.optim import StepOptions


def rendezvous_on_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    rendezvous_on_localhost(monkeypatch)


SAMPLES = 32
CASES = {
    "plain": ddp_workers.Case(batch_size=4),  # DDP's built-in all-reduce, as users get it
    "plain_counted": ddp_workers.Case(batch_size=4, count_all_reduces=True),
    "accumulated": ddp_workers.Case(batch_size=2, accum_steps=2, count_all_reduces=True),
    "bf16_gradients": ddp_workers.Case(batch_size=4, comm_hook="bf16"),
    "unsynced": ddp_workers.Case(batch_size=4, sync_gradients=False, count_all_reduces=True),
}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of CASES trained by 2 real DDP processes on gloo, started once for all of them."""
    out = tmp_path_factory.mktemp("ddp")
    with pytest.MonkeyPatch.context() as monkeypatch:
        rendezvous_on_localhost(monkeypatch)
        mp.spawn(ddp_workers.equal_weights_worker, args=(2, SAMPLES, str(out), CASES), nprocs=2)
    return out


def load_ranks(out: Path, case: str) -> list[dict]:
    return [torch.load(out / f"rank{rank}_{case}.pth", weights_only=True) for rank in range(2)]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "plain_counted", "accumulated"])
def test_two_processes_with_batch_b_equal_one_process_with_batch_2b(two_process_runs: Path, case: str) -> None:
    """2 processes x accum_steps batches of b take the steps of one process with batches of 2 x accum_steps x b,
    and DDP all-reduces once per optimizer step, not once per batch."""
    rank0, rank1 = load_ranks(two_process_runs, case)
    global_batch = 2 * CASES[case].batch_size * CASES[case].accum_steps
    single, _ = ddp_workers.train_fixed_order(single_process("cpu"), global_batch, SAMPLES)
    start = ddp_workers.small_net().state_dict()
    for name, weight in single.state_dict().items():
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), f"{name}: the replicas drifted apart"
        assert not torch.allclose(weight, start[name]), f"{name} did not train"
        assert torch.allclose(rank0["weights"][name], weight, atol=1e-5, rtol=0), (
            f"{name}: max difference {(rank0['weights'][name] - weight).abs().max():.2e}")
    if CASES[case].count_all_reduces:
        optimizer_steps = ddp_workers.EPOCHS * SAMPLES // global_batch
        assert rank0["all_reduces"] == optimizer_steps  # the small net's gradients fit in one bucket


@pytest.mark.slow
def test_gradients_sent_as_bf16_keep_replicas_equal_and_close(two_process_runs: Path) -> None:
    rank0, rank1 = load_ranks(two_process_runs, "bf16_gradients")
    exact = ddp_workers.train_fixed_order(single_process("cpu"), 2 * 4, SAMPLES)[0].state_dict()
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    # Rounded gradients: near the float32 result, but not equal to it (so the hook really ran).
    assert 0.0 < max_difference(rank0["weights"], exact) < 1e-2


@pytest.mark.slow
def test_without_gradient_sync_nothing_is_all_reduced(two_process_runs: Path) -> None:
    """The benchmark's no-communication bound: each replica trains on its own data alone."""
    rank0, rank1 = load_ranks(two_process_runs, "unsynced")
    assert rank0["all_reduces"] == rank1["all_reduces"] == 0
    assert max_difference(rank0["weights"], rank1["weights"]) > 1e-4


def test_accumulated_batches_equal_one_large_batch_in_one_process() -> None:
    ctx = single_process("cpu")
    large, _ = ddp_workers.train_fixed_order(ctx, 8, 32)
    accumulated, _ = ddp_workers.train_fixed_order(ctx, 2, 32, options=StepOptions("cpu", accum_steps=4))
    assert max_difference(large.state_dict(), accumulated.state_dict()) < 1e-5


def test_a_short_last_group_weighs_each_of_its_batches_by_its_own_size() -> None:
    """6 batches with accum_steps 4: a group of 4 batches, then one of 2 that still takes a whole mean."""
    dataset = ddp_workers.fixed_data(12)
    ctx = single_process("cpu")

    def train(batches: list[list[int]], accum_steps: int) -> dict[str, torch.Tensor]:
        model = ddp_workers.small_net()
        optimizer = ddp_workers.build_optimizer(model, lr=0.05)
        loader = DataLoader(dataset, batch_sampler=batches)
        options = StepOptions("cpu", accum_steps=accum_steps)
        ddp_workers.train_one_epoch(model, ddp_workers.CROSS_ENTROPY, optimizer, loader, ctx.device, 0,
                                      options=options)
        return model.state_dict()

    micro = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert max_difference(train(micro, 4), train([list(range(8)), [8, 9, 10, 11]], 1)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_and_its_confusion_matrix_equal_one_process(tmp_path: Path, rendezvous: None,
                                                                           world_size: int) -> None:
    sizes = [7, 11]
    mp.spawn(ddp_workers.exact_evaluation_worker, args=(world_size, sizes, str(tmp_path)), nprocs=world_size)
    ctx = single_process("cpu")
    # The model rank 0 saves: its own BatchNorm statistics, not an average of every rank's.
    model = ddp_workers.skew_batchnorm(ddp_workers.small_net(batchnorm=True), rank=0)
    for rank in range(world_size):
        results = torch.load(tmp_path / f"eval_rank{rank}.pth", weights_only=True)
        for count in sizes:
            alone = ddp_workers.evaluate(model, ddp_workers.CROSS_ENTROPY, ddp_workers.evaluation_loader(ctx, count),
                                         ctx.device, num_classes=3)
            figures, confusion = results[count]
            correct, alone_figures = figures["val_correct"], alone.figures()
            assert figures["val_total"] == count, "padding or skipping changed the number of images"
            assert (correct, count) == (alone_figures["val_correct"], alone_figures["val_total"])
            assert figures["val_loss"] == pytest.approx(alone_figures["val_loss"], rel=1e-6)  # float32, another order
            # The confusion matrix, summed in the same all-reduce: the same counts as one process's.
            assert confusion == alone.sums["confusion"].tolist() and sum(map(sum, confusion)) == count
            assert sum(confusion[i][i] for i in range(3)) == correct


def test_validation_shards_cover_every_image_once() -> None:
    from multi_train_utils.data import UnpaddedDistributedSampler

    for count in (7, 11, 2, 0):
        for world_size in (1, 2, 3, 8):
            shards = [list(UnpaddedDistributedSampler(count, world_size, r)) for r in range(world_size)]
            assert sorted(i for shard in shards for i in shard) == list(range(count))
            assert [len(UnpaddedDistributedSampler(count, world_size, r)) for r in range(world_size)] == [
                len(s) for s in shards]



@pytest.mark.slow
def test_one_rank_reads_the_folder_and_every_rank_gets_its_split(image_folder: Path, tmp_path: Path,
                                                                  rendezvous: None) -> None:
    """At 1.28 million files, N processes listing the same tree cost N times the start-up (and the file system's
    time): rank 0 reads it, and the others receive its split."""
    import json

    mp.spawn(ddp_workers.listing_worker, args=(3, str(image_folder), str(tmp_path)), nprocs=3)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [rank["reads"] for rank in ranks] == [1, 0, 0]
    assert ranks[0]["train"] == ranks[1]["train"] == ranks[2]["train"] and len(ranks[0]["train"]) == 24
