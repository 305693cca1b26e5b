"""Data-parallel training ranks (gloo on the CPU): the split of a batch over ranks, and W=2 against W=1 -
the same batch and weights give the same log-probs, values, updated weights and metrics, and the shards
two ranks checkpoint resume one rank with the same weights and optimizer state."""

from __future__ import annotations

import pytest
import torch

from ppoflow.configs import load_config
from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset
from ppoflow.storage.checkpoint import CheckpointError
from ppoflow.workers.launcher import start_workers
from ppoflow.workers.models import load_tokenizer
from ppoflow.workers.roles import RayGroupRole
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.training.critic import CriticWorker
from ppoflow.workers.training.data_parallel import balanced_partition
from ppoflow.workers.training.policy import ActorWorker

TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}
"""float32: W=2 sums the same terms as W=1 in another order (per rank, then over ranks)."""
UPDATED_WEIGHTS_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
"""After an AdamW step: its g / (|g| + eps) turns the last bits of a gradient near eps (a rarely seen token's
embedding) into up to ~1% of the learning rate (1e-3 here)."""


def test_balanced_partition_gives_equal_rows_and_balances_tokens():
    assert balanced_partition([5, 1, 4, 2, 3, 3], 2) == [[0, 1, 5], [2, 3, 4]]  # 9 tokens each
    assert balanced_partition([1, 1, 1], 2) == [[0, 2], [1]]  # the first part takes the extra row
    assert balanced_partition([7, 7, 7, 7], 1) == [[0, 1, 2, 3]]
    parts = balanced_partition(list(range(1, 17)), 4)
    assert sorted(row for part in parts for row in part) == list(range(16))
    assert {len(part) for part in parts} == {4}
    assert {sum(row + 1 for row in part) for part in parts} == {34}  # 136 tokens, 34 per rank


@pytest.fixture
def overrides(tiny_overrides):
    """GAE (so a critic trains too), micro-batches of 4 (ranks' micro-batches differ from W=1's), and
    half a CPU per rank so that two ranks of actor and critic plus the rollout fit the test's Ray."""
    return tiny_overrides + [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.forward_micro_batch_size_per_gpu=5",
        "actor_rollout_ref.actor.resources.num_cpus=0.5",
        "critic.resources.num_cpus=0.5",
    ]


@pytest.fixture
def batch(overrides):
    cfg = load_config("grpo_tiny", overrides)
    ensure_datasets(cfg.data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    prompts = dataset.batch([0, 1, 2, 3], list("abcd"), tokenizer.pad_token_id).exclude(
        "uid", "data_source", "ground_truth"
    )
    batch = HFRolloutWorker(cfg).generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    rows, width = batch["responses"].shape
    generator = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(rows, width, generator=generator) * batch["response_mask"]
    batch["returns"] = torch.randn(rows, width, generator=generator) * batch["response_mask"]
    return batch


def test_two_ranks_train_as_one(ray_local, overrides, batch, tmp_path):
    cfg_one = load_config("grpo_tiny", overrides)
    # one_step_off: the actor keeps the weights it pushed, for a restarted rollout worker
    cfg_two = load_config("grpo_tiny", overrides + ["trainer.n_cpu_ranks_per_node=2", "trainer.mode=one_step_off"])
    assert (cfg_one.data_parallel_size, cfg_two.data_parallel_size) == (1, 2)
    assert batch.batch_size[0] == 16 and len(set(batch["response_mask"].sum(dim=1).tolist())) > 1

    actor, critic = ActorWorker(cfg_one), CriticWorker(cfg_one)
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    batch["values"] = critic.compute_values(batch)["values"]
    expected = actor.update(batch, step=1)  # on-policy: the update's own log-probs are the old ones
    expected_critic = critic.update(batch, step=1)

    workers = start_workers(cfg_two)
    try:
        assert isinstance(workers.actor, RayGroupRole) and len(workers.actor.handles) == 2
        assert [len(nodes) for nodes in (workers.placement["actor"], workers.placement["critic"])] == [2, 2]
        get = workers.get
        torch.testing.assert_close(workers.actor.compute_log_prob(batch)["log_probs"], log_probs, **TOLERANCE)
        torch.testing.assert_close(workers.critic.compute_values(batch)["values"], batch["values"], **TOLERANCE)
        result = workers.actor.update(batch, step=1)
        critic_metrics = workers.critic.update(batch, step=1)
        pushed = get(workers.actor.start_prepare_weights())
        again = get(workers.actor.start_prepare_weights(again=True))  # only rank 0 kept them
        assert pushed.version == 1 and (again.version, again.layouts) == (pushed.version, pushed.layouts)
        mask = batch["response_mask"]
        torch.testing.assert_close(
            result.fields["old_log_probs"][mask], expected.fields["old_log_probs"][mask], **TOLERANCE
        )
        for name, value in {**expected.metrics, **expected_critic}.items():
            got = result.metrics.get(name, critic_metrics.get(name))
            assert got == pytest.approx(value, rel=1e-4, abs=1e-6), (name, got, value)

        # Each rank writes its shards (plus rank 0's optimizer.pt). Resumed from them, the two ranks make the
        # next update bit for bit as they did uninterrupted (same W: same order of every sum).
        entries = workers.actor.save_checkpoint(str(tmp_path / "actor"))
        second = batch.exclude("values")
        workers.actor.update(second, step=2)
        uninterrupted = workers.actor.weights_digest()
        workers.actor.load_checkpoint(str(tmp_path / "actor"), entries, weight_version=1)
        workers.actor.update(second, step=2)
        assert workers.actor.weights_digest() == uninterrupted
    finally:
        workers.shutdown()
    assert sorted(entries) == [
        "optimizer.pt",
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    resumed = ActorWorker(cfg_one)
    resumed.load_checkpoint(str(tmp_path / "actor"), entries, weight_version=1)
    for name, tensor in actor.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, **UPDATED_WEIGHTS_TOLERANCE)
    # One rank resumes from the shards with the weights W=1 reached and the optimizer state too: its next
    # update equals W=1's next update.
    assert resumed.learner.optimizer.state_dict()["state"][0]["step"] == 1
    actor.update(second, step=2)
    resumed.update(second, step=2)
    for name, tensor in actor.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, **UPDATED_WEIGHTS_TOLERANCE)

    # The shards are checked against the marker's checksums before DCP reads them.
    shard = tmp_path / "actor" / "shard-00002-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="checksum"):
        ActorWorker(cfg_one).load_checkpoint(str(tmp_path / "actor"), entries, weight_version=1)


@pytest.mark.slow  # another start of every worker (~80 s on 2 busy cores); the cut is unit-tested in test_packing
def test_two_ranks_cut_by_tokens_and_packed_train_as_one(ray_local, overrides, batch):
    """Dynamic bsz (micro-batches of at most 24 tokens, each rank as many as the one needing most) and packed
    sequences: W=2 gives W=1's log-probs, values, own old log-probs and update metrics."""
    words = overrides + [
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24",
        "critic.ppo_max_token_len_per_gpu=24",
    ]
    cfg_one = load_config("grpo_tiny", words)
    cfg_two = load_config("grpo_tiny", words + ["trainer.n_cpu_ranks_per_node=2"])
    actor, critic = ActorWorker(cfg_one), CriticWorker(cfg_one)
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    batch["values"] = critic.compute_values(batch)["values"]
    expected, expected_critic = actor.update(batch, step=1), critic.update(batch, step=1)
    workers = start_workers(cfg_two)
    try:
        mask = batch["response_mask"]
        torch.testing.assert_close(
            workers.actor.compute_log_prob(batch)["log_probs"][mask], log_probs[mask], **TOLERANCE
        )
        torch.testing.assert_close(workers.critic.compute_values(batch)["values"], batch["values"], **TOLERANCE)
        result, critic_metrics = workers.actor.update(batch, step=1), workers.critic.update(batch, step=1)
    finally:
        workers.shutdown()
    torch.testing.assert_close(
        result.fields["old_log_probs"][mask], expected.fields["old_log_probs"][mask], **TOLERANCE
    )
    for name, value in {**expected.metrics, **expected_critic}.items():
        got = result.metrics.get(name, critic_metrics.get(name))
        assert got == pytest.approx(value, rel=1e-4, abs=1e-6), (name, got, value)
