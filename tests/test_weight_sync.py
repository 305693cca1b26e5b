"""Weight sync in-process: bucket layout, exact round trip, delta updates."""

import torch

from ppoflow.configs.schema import WeightSyncConfig
from ppoflow.workers.weight_sync import WeightReceiver, WeightSender, bucket_size, plan_buckets


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    net[2].to(torch.bfloat16)  # mixed dtypes travel in one bucket
    return net


def test_buckets_respect_the_size_limit_and_keep_order():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)), ("d", torch.zeros(10))]
    layouts = plan_buckets(tensors, bucket_bytes=1000)  # float32: 400, 400, 1200, 40 bytes
    assert [[slot.name for slot in layout] for layout in layouts] == [["a", "b"], ["c"], ["d"]]
    assert [bucket_size(layout) for layout in layouts] == [800, 1200, 40]
    assert layouts[0][1].offset == 400


def test_round_trip_copies_every_tensor_exactly():
    source, target = model(0), model(1)
    update, _ = WeightSender(WeightSyncConfig(backend="object_store", bucket_mb=1, delta=False)).prepare(
        source.state_dict(), 7
    )
    assert WeightReceiver().apply(target, update, torch.device("cpu")) == 7
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name


def test_delta_sends_only_what_changed():
    source, target = model(0), model(1)
    sender = WeightSender(WeightSyncConfig(backend="object_store", bucket_mb=1, delta=True))
    first, _ = sender.prepare(source.state_dict(), 1)
    assert {slot.name for layout in first.layouts for slot in layout} == set(source.state_dict())
    WeightReceiver().apply(target, first, torch.device("cpu"))
    with torch.no_grad():
        source[1].bias.add_(1.0)
    second, _ = sender.prepare(source.state_dict(), 2)
    assert [slot.name for layout in second.layouts for slot in layout] == ["1.bias"]
    assert second.nbytes == 16 * 4
    WeightReceiver().apply(target, second, torch.device("cpu"))
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name
    assert sender.prepare(source.state_dict(), 3)[0].layouts == []  # nothing changed, nothing sent
