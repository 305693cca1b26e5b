"""The learner's gradients in one buffer (unsharded): backward passes accumulate into it in place, zeroed before
each mini-batch rather than freed after each step, so updates are bit for bit those of freed gradients; between
updates the colocated rollout holds its bfloat16 copy of the weights there. The workers run in process."""

from __future__ import annotations

import pytest
import torch

from ppoflow.configs import load_config
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.training.policy import ColocatedActorWorker

TWO_MICRO_BATCHES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # gradients accumulate in place


@pytest.fixture
def cfg(tiny_overrides):
    return load_config("grpo_tiny", tiny_overrides + TWO_MICRO_BATCHES)


def trainable_batch(cfg, prompts, step: int):
    batch = HFRolloutWorker(cfg).generate(prompts, step=step, sampling=SamplingParams.for_training(cfg))
    rows, width = batch["responses"].shape
    batch["advantages"] = torch.linspace(-1, 1, rows).unsqueeze(1).expand(rows, width).clone()
    return batch


def freeing_gradients(actor: ColocatedActorWorker) -> ColocatedActorWorker:
    """``actor`` with gradients allocated by each backward and freed after each step, as a sharded learner's are."""
    actor.learner.gradients, actor.learner.gradient_views = None, []
    actor.learner.optimizer.zero_grad(set_to_none=True)
    return actor


def in_buffer(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.untyped_storage().data_ptr()
    return start <= tensor.data_ptr() < start + buffer.untyped_storage().nbytes()


def test_updates_with_the_buffer_equal_those_with_freed_gradients(cfg, prompts):
    kept, freed = ColocatedActorWorker(cfg), freeing_gradients(ColocatedActorWorker(cfg))
    buffer = kept.learner.gradients
    assert buffer is not None and buffer.dtype == torch.float32
    for step in (1, 2, 3):
        batch = trainable_batch(cfg, prompts, step)
        assert kept.update(batch.clone(), step=step).metrics == freed.update(batch.clone(), step=step).metrics
        assert all(in_buffer(parameter.grad, buffer) for parameter in kept.model.parameters())
    for (name, mine), theirs in zip(kept.model.state_dict().items(), freed.model.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_the_rollout_copy_lives_in_the_gradients_and_an_update_waits_for_it(cfg, prompts):
    actor, twin = ColocatedActorWorker(cfg), ColocatedActorWorker(cfg)
    assert actor.rollout_dtype == "bfloat16"
    batch = trainable_batch(cfg, prompts, 1)
    actor.update(batch.clone(), step=1)
    twin.update(batch.clone(), step=1)
    with actor._rollout_model() as copy:
        assert all(in_buffer(parameter, actor.learner.gradients) for parameter in copy.parameters())
        assert {parameter.dtype for parameter in copy.parameters()} == {torch.bfloat16}
        with pytest.raises(RuntimeError, match="lent out"):
            actor.update(batch.clone(), step=2)
    generated = actor.generate(prompts, step=2, sampling=SamplingParams.for_training(cfg))
    assert generated.batch_size[0] == len(prompts) * cfg.actor_rollout_ref.rollout.n
    second = trainable_batch(cfg, prompts, 2)  # the buffer held the copy: the next update starts from zero
    assert actor.update(second.clone(), step=2).metrics == twin.update(second.clone(), step=2).metrics


def test_lora_gradients_are_too_small_for_the_copy_which_takes_memory_of_its_own(tiny_overrides, prompts):
    cfg = load_config("grpo_tiny", tiny_overrides + ["actor_rollout_ref.model.lora_rank=4"])
    actor = ColocatedActorWorker(cfg)
    with actor._rollout_model() as copy:
        assert not any(in_buffer(parameter, actor.learner.gradients) for parameter in copy.parameters())
