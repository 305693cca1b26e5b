"""A step batch crosses between the run's processes as plain values (ppoflow.workers.transport) and
arrives as the same batch: same keys in the same order, same dtypes, shapes and values, the same
non-tensor columns; what has no plain form (a nested batch) still arrives intact."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from ppoflow.storage.batch import batch_from_plain, non_tensor_column, plain_batch, with_non_tensor_columns


def step_batch() -> TensorDict:
    """Every dtype a batch carries, a response slice of a wider tensor (a view), JSON-like columns."""
    wide = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    batch = TensorDict(
        {
            "prompts": torch.randint(0, 50, (4, 5)),
            "prompt_mask": torch.rand(4, 5) > 0.3,
            "rollout_log_probs": wide[:, :3],
            "advantages": torch.randn(4, 3, dtype=torch.bfloat16),
            "weight_version": torch.tensor([3, 3, 4, 4]),
            "empty": torch.zeros(4, 0),
        },
        batch_size=[4],
    )
    return with_non_tensor_columns(
        batch,
        {"uid": ["a", "a", "b", "b"], "data_source": ["copy"] * 4, "ground_truth": [[1, 2], {"x": (1,)}, None, 2.5]},
    )


def assert_same_batch(got: TensorDict, want: TensorDict) -> None:
    assert list(got.keys()) == list(want.keys())
    assert got.batch_size == want.batch_size
    for name in want.keys():
        value = want.get(name)
        if isinstance(value, torch.Tensor):
            assert got.get(name).dtype == value.dtype and torch.equal(got.get(name), value), name
        else:
            assert non_tensor_column(got, name) == non_tensor_column(want, name), name


def test_a_batch_rebuilt_from_its_plain_values_is_the_same_batch():
    batch = step_batch()
    plain = plain_batch(batch)
    rebuilt = batch_from_plain(pickle.loads(pickle.dumps(plain, protocol=5)))
    assert_same_batch(rebuilt, batch)
    # the slice shipped its own three columns, not the six of the tensor it views
    assert plain[2]["rollout_log_probs"][0].nbytes == 4 * 3 * 4
    rebuilt["prompts"][0, 0] = -1  # the rebuilt tensors own their memory
    assert batch["prompts"][0, 0] != -1


def test_a_batch_with_no_plain_form_says_so():
    nested = TensorDict({"inner": TensorDict({"x": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
    assert plain_batch(nested) is None
    with_grad = TensorDict({"x": torch.zeros(2, requires_grad=True)}, batch_size=[2])
    assert plain_batch(with_grad) is None


def test_batches_cross_to_and_from_a_ray_worker_as_plain_values(ray_local):
    ray = ray_local
    from ppoflow.configs.schema import ResourcesConfig
    from ppoflow.workers.models import set_up_worker_process
    from ppoflow.workers.transport import send_batches_as_plain_values

    @ray.remote
    class Echo:
        def __init__(self):
            set_up_worker_process(ResourcesConfig(num_cpus=1, num_gpus=0, num_threads=1, custom={}))

        def echo(self, batch):
            return batch

        def sends_plain_values(self) -> bool:
            return TensorDict in ray.cloudpickle.CloudPickler.dispatch

    send_batches_as_plain_values()
    worker = Echo.remote()
    assert ray.get(worker.sends_plain_values.remote())
    batch = step_batch()
    assert_same_batch(ray.get(worker.echo.remote(batch)), batch)
    assert_same_batch(ray.get(worker.echo.remote(ray.put(batch))), batch)
    nested = TensorDict({"inner": batch}, batch_size=[4])
    assert_same_batch(ray.get(worker.echo.remote(nested)).get("inner"), batch)
    ray.kill(worker)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool])
def test_every_tensor_dtype_survives_the_plain_form(dtype):
    values = (torch.randn(3, 2) * 10).to(dtype)
    batch = TensorDict({"x": values}, batch_size=[3])
    assert_same_batch(batch_from_plain(plain_batch(batch)), batch)
