"""The workers in-process (no Ray): generation contract, log-prob parity, updates, the critic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppoflow.configs import load_config
from ppoflow.workers.models import copy_in_dtype, load_causal_lm
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.training.critic import CriticWorker
from ppoflow.workers.training.policy import ActorWorker, ReferenceWorker
from tests.conftest import model_config


@pytest.fixture
def cfg(tiny_overrides):
    return load_config("grpo_tiny", tiny_overrides)


def test_generate_returns_the_rollout_contract(cfg, prompts):
    worker = HFRolloutWorker(cfg)
    batch = worker.generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    n, width = cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length
    assert batch.batch_size == torch.Size([3 * n])
    assert batch["responses"].shape == (3 * n, width) and batch["responses"].dtype == torch.int64
    assert batch["response_mask"].dtype == torch.bool
    assert torch.equal(batch["group_index"], torch.tensor([0] * n + [1] * n + [2] * n))
    assert torch.equal(batch["prompts"][::n], prompts["prompts"])  # prompt-major rows
    assert (batch["weight_version"] == 0).all()
    eos = worker.tokenizer.eos_token_id
    for tokens, mask in zip(batch["responses"].tolist(), batch["response_mask"].tolist()):
        valid = sum(mask)
        assert mask == [True] * valid + [False] * (width - valid)  # a prefix
        assert eos not in tokens[: valid - 1]  # nothing valid after the first EOS
        assert valid == width or tokens[valid - 1] == eos
    assert (batch["rollout_log_probs"][~batch["response_mask"]] == 0).all()
    assert (batch["rollout_log_probs"][batch["response_mask"]] < 0).all()


def test_a_trajectory_samples_the_same_alone_as_in_its_batch(cfg, prompts):
    """Each trajectory draws from its own seeded stream (``trajectory_seed``) and leaves the engine's batch when it
    ends, so the first prompt's responses sampled on their own equal its rows of the whole step's batch."""
    worker = HFRolloutWorker(cfg)
    sampling = dataclasses.replace(SamplingParams.for_training(cfg), max_new_tokens=32)
    whole = worker.generate(prompts, step=3, sampling=sampling)
    alone = worker.generate(prompts[:1], step=3, sampling=sampling)
    lengths = whole["response_mask"].sum(dim=1)
    assert lengths.min() < lengths.max()  # responses of several lengths: some left the batch before others
    for name in ("responses", "response_mask", "rollout_log_probs"):
        torch.testing.assert_close(alone[name], whole[name][: sampling.n], atol=1e-6, rtol=1e-6)


def test_sampling_depends_only_on_seed_and_step(cfg, prompts):
    worker = HFRolloutWorker(cfg)
    sampling = SamplingParams.for_training(cfg)
    first = worker.generate(prompts, step=3, sampling=sampling)
    worker.generate(prompts, step=4, sampling=sampling)  # advances nothing that step 3 depends on
    again = worker.generate(prompts, step=3, sampling=sampling)
    assert torch.equal(first["responses"], again["responses"])
    other = worker.generate(prompts, step=5, sampling=sampling)
    assert not torch.equal(first["responses"], other["responses"])


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_actor_recomputes_the_sampling_log_probs(tiny_overrides, prompts, dtype, tolerance):
    """With the same weights, the actor's log-probs equal the rollout's: the PPO ratio starts at 1, up to the
    rounding of the rollout's dtype (bfloat16 keeps 8 bits of each logit's mantissa)."""
    cfg = load_config("grpo_tiny", [*tiny_overrides, f"actor_rollout_ref.rollout.dtype={dtype}"])
    rollout = HFRolloutWorker(cfg)
    assert next(rollout.model.parameters()).dtype == getattr(torch, dtype)
    batch = rollout.generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    for worker in (ActorWorker(cfg), ReferenceWorker(cfg)):
        log_probs = worker.compute_log_prob(batch)["log_probs"]
        mask = batch["response_mask"]
        torch.testing.assert_close(log_probs[mask], batch["rollout_log_probs"][mask], atol=tolerance, rtol=0)


def test_log_probs_are_position_correct_with_left_padding(cfg, prompts):
    """A left-padded prompt must score its response exactly as the same prompt unpadded."""
    rollout = HFRolloutWorker(cfg)
    batch = rollout.generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    pad = rollout.tokenizer.pad_token_id
    padded = batch.clone()
    padded["prompts"] = torch.cat([torch.full((batch.batch_size[0], 2), pad), batch["prompts"]], dim=1)
    padded["prompt_mask"] = torch.cat(
        [torch.zeros(batch.batch_size[0], 2, dtype=torch.bool), batch["prompt_mask"]], dim=1
    )
    actor = ActorWorker(cfg)
    mask = batch["response_mask"]
    torch.testing.assert_close(
        actor.compute_log_prob(padded)["log_probs"][mask],
        actor.compute_log_prob(batch)["log_probs"][mask],
        atol=1e-5,
        rtol=1e-5,
    )


def _trainable_batch(cfg, prompts, actor):
    batch = HFRolloutWorker(cfg).generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    batch["advantages"] = (
        torch.linspace(-1, 1, batch.batch_size[0]).unsqueeze(1).expand_as(batch["old_log_probs"]).clone()
    )
    return batch


def test_update_changes_weights_and_bumps_the_version(cfg, prompts):
    actor = ActorWorker(cfg)
    batch = _trainable_batch(cfg, prompts, actor)
    before = {name: tensor.clone() for name, tensor in actor.model.state_dict().items()}
    metrics = actor.update(batch, step=1).metrics
    assert actor.weight_version == 1
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"} <= set(metrics)
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(before[name], tensor) for name, tensor in actor.model.state_dict().items())
    rollout = HFRolloutWorker(cfg)
    assert rollout.apply_weights(actor.prepare_weights()) == 1
    served = rollout.model.state_dict()  # in rollout.dtype (bfloat16): the sync casts the actor's weights into it
    trained = actor.model.state_dict()
    assert all(torch.equal(served[name], tensor.to(served[name].dtype)) for name, tensor in trained.items())


def test_micro_batching_does_not_change_the_update(tiny_overrides, prompts):
    """Micro-batch losses are normalised by the whole mini-batch, so the step is the same."""
    updates = []
    for micro in ("null", "4"):
        cfg = load_config(
            "grpo_tiny", tiny_overrides + [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"]
        )
        actor = ActorWorker(cfg)
        metrics = actor.update(_trainable_batch(cfg, prompts, actor), step=1).metrics
        updates.append((metrics, actor.model.state_dict()))
    (metrics_a, weights_a), (metrics_b, weights_b) = updates
    assert metrics_a["actor/pg_loss"] == pytest.approx(metrics_b["actor/pg_loss"], abs=1e-6)
    assert metrics_a["actor/grad_norm"] == pytest.approx(metrics_b["actor/grad_norm"], rel=1e-4)
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], atol=1e-6, rtol=1e-5)


def kept_for_backward(run, *args, **kwargs) -> tuple[object, int]:
    """``run(*args, **kwargs)``'s result and the elements of the tensors autograd kept for the backward pass
    meanwhile (those a checkpointed layer recomputes are kept by the checkpoint instead, and not counted)."""
    kept = [0]

    def pack(tensor):
        kept[0] += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run(*args, **kwargs)
    return result, kept[0]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_gradient_checkpointing_recomputes_and_changes_nothing_else(tiny_overrides, prompts, role):
    """``enable_gradient_checkpointing``: the update's losses, gradient norm and new weights equal those without
    it (fp32, atol 1e-6 / rtol 1e-5: the recomputation is the same arithmetic), while autograd keeps less than
    half as much for the backward pass (the decoder layers' activations are recomputed instead)."""
    results = []
    for enabled in ("false", "true"):
        cfg = load_config(
            "grpo_tiny",
            tiny_overrides
            + ["algorithm.adv_estimator=gae", f"actor_rollout_ref.model.enable_gradient_checkpointing={enabled}"],
        )
        assert cfg.critic.model.enable_gradient_checkpointing == (enabled == "true")  # follows the actor's
        actor = ActorWorker(cfg)
        batch = _trainable_batch(cfg, prompts, actor)
        worker = actor if role == "actor" else CriticWorker(cfg)
        if role == "critic":
            batch["values"] = worker.compute_values(batch)["values"]
            batch["returns"] = torch.ones_like(batch["values"]) * batch["response_mask"]
        result, kept = kept_for_backward(worker.update, batch, step=1)
        metrics = result.metrics if role == "actor" else result
        results.append((metrics, {name: t.clone() for name, t in worker.model.state_dict().items()}, kept))
    (plain, plain_weights, plain_kept), (checkpointed, checkpointed_weights, checkpointed_kept) = results
    for name in ["actor/pg_loss", "actor/grad_norm"] if role == "actor" else ["critic/vf_loss", "critic/grad_norm"]:
        assert checkpointed[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(checkpointed_weights[name], tensor, atol=1e-6, rtol=1e-5)
    assert checkpointed_kept < 0.5 * plain_kept  # the decoder layers' activations are not kept


def test_an_on_policy_update_takes_its_own_log_probs_as_the_old_ones(tiny_overrides, prompts):
    """One epoch over one mini-batch: the update without ``old_log_probs`` equals the update after a
    separate old_log_prob pass (up to floating-point reordering) and returns that pass's log-probs."""
    cfg = load_config("grpo_tiny", tiny_overrides + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    separate, fused = ActorWorker(cfg), ActorWorker(cfg)
    batch = _trainable_batch(cfg, prompts, separate)
    expected = separate.update(batch, step=1)
    shortcut = fused.update(batch.exclude("old_log_probs"), step=1)
    assert expected.fields is None
    mask = batch["response_mask"]
    torch.testing.assert_close(
        shortcut.fields["old_log_probs"][mask], batch["old_log_probs"][mask], atol=1e-5, rtol=1e-5
    )
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert shortcut.metrics[name] == pytest.approx(expected.metrics[name], rel=1e-4, abs=1e-6), name
    assert shortcut.metrics["actor/ppo_kl"] == 0 and shortcut.metrics["actor/pg_clipfrac"] == 0  # ratio exactly 1
    for name, tensor in separate.model.state_dict().items():
        torch.testing.assert_close(fused.model.state_dict()[name], tensor, atol=1e-6, rtol=1e-5)


def test_an_update_that_is_not_on_policy_needs_the_old_log_probs(tiny_overrides, prompts):
    cfg = load_config("grpo_tiny", tiny_overrides + ["actor_rollout_ref.actor.ppo_epochs=2"])
    actor = ActorWorker(cfg)
    with pytest.raises(ValueError, match="not on-policy"):
        actor.update(_trainable_batch(cfg, prompts, actor).exclude("old_log_probs"), step=1)


def test_critic_values_and_update(tiny_overrides, prompts):
    cfg = load_config("grpo_tiny", tiny_overrides + ["algorithm.adv_estimator=gae"])
    critic = CriticWorker(cfg)
    batch = HFRolloutWorker(cfg).generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["responses"].shape
    assert (values[~batch["response_mask"]] == 0).all()
    batch["values"] = values
    batch["returns"] = torch.ones_like(values) * batch["response_mask"]
    first = critic.update(batch, step=1)["critic/vf_loss"]
    for step in range(2, 6):
        last = critic.update(batch, step=step)["critic/vf_loss"]
    assert last < first  # regressing toward constant returns lowers the loss


def test_response_padding_is_trimmed_without_changing_results(cfg, prompts):
    """Extra padding columns cost nothing and change nothing (forward passes run on the trimmed batch)."""
    batch = HFRolloutWorker(cfg).generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    padded = batch.clone()
    extra = 5
    for name in ("responses", "response_mask", "rollout_log_probs"):
        padded[name] = torch.nn.functional.pad(batch[name], (0, extra))
    actor = ActorWorker(cfg)
    full, trimmed = actor.compute_log_prob(padded)["log_probs"], actor.compute_log_prob(batch)["log_probs"]
    assert full.shape[1] == batch["responses"].shape[1] + extra
    torch.testing.assert_close(full[:, :-extra], trimmed)
    assert (full[:, -extra:] == 0).all()


def test_old_log_probs_at_step_start_come_from_the_kept_weights(cfg, prompts):
    """separate_async's decoupled PPO: after updates, the step's first weights still give the old log-probs,
    and the pass leaves the updated weights (and the optimizer's parameters) in place."""
    actor = ActorWorker(cfg)
    batch = _trainable_batch(cfg, prompts, actor)
    actor.snapshot_weights()
    before = actor.compute_log_prob(batch)["log_probs"]
    actor.update(batch, step=1)
    parameters = [id(parameter) for parameter in actor.model.parameters()]
    after = actor.compute_log_prob(batch)["log_probs"]
    assert not torch.equal(before, after)
    assert torch.equal(actor.compute_log_prob(batch, at_step_start=True)["log_probs"], before)
    assert torch.equal(actor.compute_log_prob(batch)["log_probs"], after)
    assert [id(parameter) for parameter in actor.model.parameters()] == parameters


def test_a_local_role_calls_its_workers_methods_by_name():
    """The typed role methods call the worker method of their name; in process a ``start_*`` reference is the
    reply itself, and ``Workers.get`` hands it back."""
    from ppoflow.workers.roles import LocalRole, Workers

    class Recorder:
        def __getattr__(self, method):
            return lambda *args, **kwargs: (method, args, kwargs)

    workers = Workers(rollout=LocalRole(Recorder()), actor=LocalRole(Recorder()), uses_ray=False)
    assert workers.actor.compute_log_prob("b", at_step_start=True) == (
        "compute_log_prob",
        ("b",),
        {"at_step_start": True},
    )
    assert workers.actor.load_checkpoint("d", {}, weight_version=3) == (
        "load_checkpoint",
        ("d", {}),
        {"weight_version": 3},
    )
    update = workers.actor.start_prepare_weights(again=True)
    assert workers.get(update) == ("prepare_weights", (), {"again": True, "version": None})
    assert workers.get(workers.rollout.start_apply_weights(update)) == ("apply_weights", (update,), {})


def test_a_copy_in_another_dtype_holds_every_weight_cast_in_one_allocation(tiny_model):
    """The colocated rollout's bfloat16 copy: each weight cast (the tied embedding and head in one slot), the
    rotary buffers copied, every parameter a view of one storage (freed whole); a source missing a weight is
    refused rather than leaving the slot unset."""
    model = load_causal_lm(model_config(tiny_model))
    state = model.state_dict()
    copy = copy_in_dtype(model, state.items(), "bfloat16")
    copied = copy.state_dict()
    assert set(copied) == set(state) and not copy.training
    assert all(torch.equal(copied[name], tensor.to(torch.bfloat16)) for name, tensor in state.items())
    assert len({parameter.untyped_storage().data_ptr() for parameter in copy.parameters()}) == 1
    assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight
    buffers = dict(copy.named_buffers())
    assert all(torch.equal(buffers[name], buffer) for name, buffer in model.named_buffers())
    with pytest.raises(ValueError, match="lack"):
        copy_in_dtype(model, list(state.items())[1:], "bfloat16")
