"""LoRA (``actor_rollout_ref.model.lora_rank`` / ``lora_adapter_path``, peft): only the adapter trains, the
reference is the base model with the adapter disabled, weight sync sends the adapter (or merged weights),
checkpoints and digests hold it, the export offers the merged model and the adapter; ``lora_rank=0`` is full
fine-tuning. The workers run in process (no Ray)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.verl_answers import verl_answer
from ppoflow.workers.launcher import start_local_workers
from ppoflow.workers.models import load_causal_lm
from ppoflow.workers.resources import role_resources
from ppoflow.workers.roles import ActorBaseRole
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.training.colocated import ColocatedActorWorker
from ppoflow.workers.training.learner import unique_state_names
from ppoflow.workers.training.lora import ADAPTER_DIR
from ppoflow.workers.training.policy import ActorWorker, ReferenceWorker

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
FAST = ["actor_rollout_ref.actor.optim.lr=5e-2"]  # a step that moves the adapter well away from B = 0
EXACT = ["actor_rollout_ref.rollout.dtype=float32"]  # the rollout in the actor's dtype: the passes compare exactly
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Llama's linear layers but the output head: what ``target_modules=all-linear`` adapts."""


@pytest.fixture
def overrides(tiny_overrides):
    return tiny_overrides + LORA + FAST + EXACT


@pytest.fixture
def cfg(overrides):
    return load_config("grpo_tiny", overrides)


def trainable_batch(cfg, prompts, actor, step: int = 1):
    batch = HFRolloutWorker(cfg).generate(prompts, step=step, sampling=SamplingParams.for_training(cfg))
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    batch["advantages"] = (
        torch.linspace(-1, 1, batch.batch_size[0]).unsqueeze(1).expand_as(batch["old_log_probs"]).clone()
    )
    return batch


def trained_actor(cfg, prompts) -> tuple[ActorWorker, object]:
    actor = ActorWorker(cfg)
    batch = trainable_batch(cfg, prompts, actor)
    assert actor.update(batch, step=1).metrics["actor/optimizer_steps"] == 1
    return actor, batch


def response_log_probs(model, batch) -> torch.Tensor:
    """Each response token's log-prob under ``model`` (temperature 1, the preset's), [N, R], zero after EOS:
    prompt + response in one pass, left-padded prompts, positions counting real tokens."""
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    prompt, response = batch["prompts"].shape[1], batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, prompt - 1 : prompt + response - 1].float(), dim=-1)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]


def adapter_size(cfg) -> int:
    """Elements of rank-r adapters on every adapted linear layer, from the plain model's shapes: r x (in + out)."""
    rank = cfg.actor_rollout_ref.model.lora_rank
    plain = load_causal_lm(cfg.actor_rollout_ref.model)
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in plain.named_modules()
        if name.rsplit(".", 1)[-1] in ADAPTED
    )


# ------------------------------------------------------------------------------------ training


def test_only_the_adapter_trains_and_the_base_stays_as_loaded(cfg, prompts):
    actor = ActorWorker(cfg)
    base = {name: tensor.clone() for name, tensor in actor.adapter.base.state_dict().items() if ".lora_" not in name}
    trainable = {name: p for name, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert sum(p.numel() for p in trainable.values()) == adapter_size(cfg)
    optimized = [p for group in actor.learner.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in trainable.values()}  # AdamW holds the adapter alone
    assert all(not p.any() for name, p in trainable.items() if ".lora_B." in name)  # starts as the base (B = 0)

    grads = {}
    for name, parameter in trainable.items():
        parameter.register_hook(lambda grad, name=name: grads.setdefault(name, grad))
    actor.update(trainable_batch(cfg, prompts, actor), step=1)
    assert set(grads) == set(trainable)  # every adapter tensor got a gradient ...
    frozen = [p for p in actor.model.parameters() if not p.requires_grad]
    assert len(frozen) == len(list(load_causal_lm(cfg.actor_rollout_ref.model).parameters()))  # ... the base none
    assert all(p.grad is None for p in frozen)
    after = actor.adapter.base.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in base.items())  # the base did not move
    assert any(p.any() for name, p in trainable.items() if ".lora_B." in name)


def test_lora_rank_zero_is_full_fine_tuning(tiny_overrides, prompts):
    cfg = load_config("grpo_tiny", tiny_overrides)
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules, model.lora_adapter_path) == (
        0,
        16,
        "all-linear",
        None,
    )  # verl's defaults
    assert not model.lora and not cfg.ref_in_actor
    actor = ActorWorker(cfg)
    assert actor.adapter is None and type(actor.model).__module__.startswith("transformers.")
    optimized = [p for group in actor.learner.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(list(actor.model.parameters()))
    actor.update(trainable_batch(cfg, prompts, actor), step=1)
    entries = actor.save_checkpoint(str(cfg.trainer.default_local_dir) + "/ckpt")
    saved = load_file(str(cfg.trainer.default_local_dir) + "/ckpt/model.safetensors")
    assert set(saved) == unique_state_names(actor.model) and "model.safetensors" in entries


# ------------------------------------------------------------------------------------ reference


def test_the_reference_is_the_base_model_with_the_adapter_disabled(overrides, prompts):
    cfg = load_config("grpo_tiny", overrides + ["actor_rollout_ref.actor.use_kl_loss=true"])
    assert cfg.use_reference and cfg.ref_in_actor
    assert not any(key.startswith("actor_rollout_ref.ref") for key in role_resources(cfg))  # nothing reserved
    workers = start_local_workers(cfg)
    assert isinstance(workers.ref, ActorBaseRole) and workers.ref.actor is workers.actor
    actor = workers.actor.worker
    batch = trainable_batch(cfg, prompts, actor)
    batch["ref_log_probs"] = workers.ref.compute_log_prob(batch)["log_probs"]
    before = actor.weights_digest()
    actor.update(batch, step=1)
    assert actor.weights_digest() != before  # the step cache's fingerprint follows the adapter

    separate = ReferenceWorker(cfg)  # a frozen copy of the base model, loaded on its own
    expected = separate.compute_log_prob(batch)["log_probs"]
    # the same arithmetic as the plain model (the LoRA layers call only their base layer): tolerance 1e-6
    torch.testing.assert_close(workers.ref.compute_log_prob(batch)["log_probs"], expected, atol=1e-6, rtol=0)
    assert (actor.compute_log_prob(batch)["log_probs"] - expected).abs().max() > 1e-3  # the actor has moved
    assert workers.ref.weights_digest() == separate.weights_digest()  # the base model's own digest


def test_actor_and_reference_passes_side_by_side_do_not_mix(overrides, prompts):
    """In process a step's forward passes run in threads: the reference's adapter-disabled pass must not leak
    into the actor's pass on the same model, or the other way round."""
    cfg = load_config("grpo_tiny", overrides + ["actor_rollout_ref.actor.use_kl_loss=true"])
    workers = start_local_workers(cfg)
    actor = workers.actor.worker
    batch = trainable_batch(cfg, prompts, actor)
    batch["ref_log_probs"] = workers.ref.compute_log_prob(batch)["log_probs"]
    actor.update(batch, step=1)
    expected = (workers.actor.compute_log_prob(batch)["log_probs"], workers.ref.compute_log_prob(batch)["log_probs"])
    start = threading.Barrier(2)

    def passes(role):
        start.wait()
        return [role.compute_log_prob(batch)["log_probs"] for _ in range(5)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(passes, [workers.actor, workers.ref]))
    for want, got in zip(expected, results):
        assert all(torch.equal(log_probs, want) for log_probs in got)


# ------------------------------------------------------------------------------------ weight sync


def test_weight_sync_sends_only_the_adapter_and_the_rollout_samples_as_the_merged_model(cfg, prompts, tmp_path):
    actor, batch = trained_actor(cfg, prompts)
    update = actor.prepare_weights()
    names = [slot.name for layout in update.layouts for slot in layout]
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names)
    assert update.nbytes == adapter_size(cfg) * 4  # float32
    full = sum(t.numel() * t.element_size() for t in load_causal_lm(cfg.actor_rollout_ref.model).state_dict().values())
    assert update.nbytes < full / 3

    rollout = HFRolloutWorker(cfg)
    assert rollout.apply_weights(update) == 1
    generated = rollout.generate(prompts, step=7, sampling=SamplingParams.for_training(cfg))
    actor.save_pretrained(str(tmp_path / "export"))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()  # plain transformers, no peft
    expected, mask = response_log_probs(merged, generated), generated["response_mask"]
    # base + adapter vs the merged weights: the same function up to float32 rounding (atol 1e-5)
    torch.testing.assert_close(generated["rollout_log_probs"][mask], expected[mask], atol=1e-5, rtol=1e-5)
    base = ReferenceWorker(cfg).compute_log_prob(generated)["log_probs"]
    assert (base[mask] - expected[mask]).abs().max() > 1e-3  # and that is not the base model's


def test_a_colocated_actor_samples_in_bfloat16_with_its_merged_weights(overrides, prompts, tmp_path):
    """rollout.dtype=bfloat16: the colocated actor samples with base + adapter merged and cast, which is what the
    merged export loaded in bfloat16 computes; the actor's own model stays in float32."""
    cfg = load_config("grpo_tiny", overrides + ["actor_rollout_ref.rollout.dtype=bfloat16"])
    actor = ColocatedActorWorker(cfg)
    assert actor.update(trainable_batch(cfg, prompts, actor), step=1).metrics["actor/optimizer_steps"] == 1
    generated = actor.generate(prompts, step=7, sampling=SamplingParams.for_training(cfg))
    actor.save_pretrained(str(tmp_path / "export"))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.bfloat16).eval()
    expected, mask = response_log_probs(merged, generated), generated["response_mask"]
    torch.testing.assert_close(generated["rollout_log_probs"][mask], expected[mask], atol=1e-6, rtol=0)
    assert {parameter.dtype for parameter in actor.model.parameters()} == {torch.float32}


def test_a_rollout_without_the_adapter_gets_the_merged_weights(overrides, prompts):
    """The rollout service's replicas (as vLLM) hold a plain model: the actor sends base + adapter merged, under
    the base model's names, and the plain model then computes what the actor does."""
    cfg = load_config("grpo_tiny", overrides + ["actor_rollout_ref.rollout.mode=async"])
    actor, batch = trained_actor(cfg, prompts)
    assert not actor.sends_adapter
    update = actor.prepare_weights()
    plain = load_causal_lm(cfg.actor_rollout_ref.model).eval()
    assert {slot.name for layout in update.layouts for slot in layout} == set(plain.state_dict())
    from ppoflow.workers.weight_sync import WeightReceiver

    WeightReceiver().apply(plain, update, torch.device("cpu"))
    torch.testing.assert_close(
        response_log_probs(plain, batch), response_log_probs(actor.model.eval(), batch), atol=1e-5, rtol=1e-5
    )
    assert all(".base_layer." not in name for name in actor.adapter.merged_weights())  # the model is not merged


# ------------------------------------------------------------------------------------ checkpoints


def test_a_checkpoint_holds_the_adapter_and_resumes_to_the_same_weights(cfg, prompts, tmp_path):
    actor, batch = trained_actor(cfg, prompts)
    entries = actor.save_checkpoint(str(tmp_path / "actor"))
    saved = load_file(str(tmp_path / "actor" / "model.safetensors"))
    trainable = {name for name, p in actor.model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable  # the adapter, not the base
    optimizer = torch.load(tmp_path / "actor" / "optimizer.pt", weights_only=True)["optimizer"]
    assert set(optimizer["state"]) == trainable

    resumed = ActorWorker(cfg)  # the base from model.path, the adapter from the checkpoint
    resumed.load_checkpoint(str(tmp_path / "actor"), entries, weight_version=1)
    assert resumed.weights_digest() == actor.weights_digest()
    for name, tensor in actor.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    # the optimizer's moments came back too: the next update is the same on both
    next_batch = trainable_batch(cfg, prompts, actor, step=2)
    actor.update(next_batch, step=2)
    resumed.update(next_batch, step=2)
    for name, tensor in actor.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, atol=0, rtol=0)


def test_a_full_checkpoint_does_not_load_into_a_lora_actor(tiny_overrides, cfg, prompts, tmp_path):
    from ppoflow.storage.checkpoint import CheckpointError

    full = ActorWorker(load_config("grpo_tiny", tiny_overrides))
    entries = full.save_checkpoint(str(tmp_path / "actor"))
    with pytest.raises(CheckpointError, match="do not fit the model"):
        ActorWorker(cfg).load_checkpoint(str(tmp_path / "actor"), entries, weight_version=1)


# ------------------------------------------------------------------------------------ export


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft asks transformers' old name
def test_the_export_holds_the_merged_model_and_the_adapter(overrides, cfg, prompts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor, batch = trained_actor(cfg, prompts)
    url = str(tmp_path / "huggingface")
    actor.save_pretrained(url)
    expected = response_log_probs(actor.model.eval(), batch)
    merged = AutoModelForCausalLM.from_pretrained(url).eval()
    assert not any(".lora_" in name for name in merged.state_dict())
    torch.testing.assert_close(response_log_probs(merged, batch), expected, atol=1e-5, rtol=1e-5)
    base = load_causal_lm(cfg.actor_rollout_ref.model)
    adapted = PeftModel.from_pretrained(base, f"{url}/{ADAPTER_DIR}").eval()  # the adapter alone, peft's format
    torch.testing.assert_close(response_log_probs(adapted, batch), expected, atol=1e-6, rtol=1e-6)
    adapter_config = json.loads((tmp_path / "huggingface" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)

    # lora_adapter_path goes on from that adapter: actor and rollout start where the export left off
    again = load_config("grpo_tiny", overrides + [f"actor_rollout_ref.model.lora_adapter_path={url}/{ADAPTER_DIR}"])
    continued = ActorWorker(again)
    assert continued.weights_digest() == actor.weights_digest()
    torch.testing.assert_close(response_log_probs(HFRolloutWorker(again).model, batch), expected, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------ configuration


def test_verls_lora_keys_are_keys_of_the_schema(tiny_overrides):
    words = [  # verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, the LoRA part
        "actor_rollout_ref.model.lora_rank=64",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
    ]
    cfg = load_config("grpo_tiny", tiny_overrides + words)
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (64, 32, "all-linear") and model.lora
    listed = load_config("grpo_tiny", tiny_overrides + ["actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    assert listed.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"]
    for key in ("lora_rank", "lora_alpha", "target_modules", "lora_adapter_path"):
        assert verl_answer(f"actor_rollout_ref.model.{key}", "actor_rollout_ref.model") is None
    assert "target_modules" in verl_answer("actor_rollout_ref.model.exclude_modules", "actor_rollout_ref.model")[1]
    critic = cfg.critic.model
    assert (critic.lora_rank, critic.lora_alpha, critic.target_modules) == (0, 16, "all-linear")


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", overrides)
    return dict(caught.value.problems)


def test_lora_on_several_ranks_is_a_config_error_naming_the_keys(overrides):
    found = problems(overrides + ["trainer.n_cpu_ranks_per_node=2"])
    assert list(found) == ["actor_rollout_ref.model.lora_rank"]
    assert "trainer.n_cpu_ranks_per_node" in found["actor_rollout_ref.model.lora_rank"]


def test_a_lora_critic_is_a_config_error(overrides):
    found = problems(overrides + ["algorithm.adv_estimator=gae", "critic.model.lora_rank=8"])
    assert list(found) == ["critic.model.lora_rank"] and "not supported" in found["critic.model.lora_rank"]
    load_config("grpo_tiny", overrides + ["critic.model.lora_rank=8"])  # no critic runs: nothing to refuse


def test_an_adapter_path_must_hold_a_plain_lora_adapter(tiny_overrides, overrides, tmp_path):
    key = "actor_rollout_ref.model.lora_adapter_path"
    assert "no adapter_config.json" in problems(overrides + [f"{key}={tmp_path}"])[key]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    assert "DoRA" in problems(overrides + [f"{key}={tmp_path}"])[key]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    assert "peft_type must be LORA" in problems(overrides + [f"{key}={tmp_path}"])[key]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    cfg = load_config("grpo_tiny", tiny_overrides + [f"{key}={tmp_path}"])  # lora_rank 0: the path turns LoRA on
    assert cfg.actor_rollout_ref.model.lora


# ------------------------------------------------------------------------------------ on Ray


def test_on_ray_the_reference_is_served_by_the_actor_and_a_sync_moves_the_adapter(ray_local, overrides, prompts):
    from ppoflow.workers.launcher import start_workers

    cfg = load_config(
        "grpo_tiny", overrides + ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.hybrid_engine=false"]
    )
    local = ActorWorker(cfg)
    batch = trainable_batch(cfg, prompts, local)
    batch["ref_log_probs"] = ReferenceWorker(cfg).compute_log_prob(batch)["log_probs"]
    workers = start_workers(cfg)
    try:
        assert sorted(workers.placement) == ["actor", "rollout"]  # no reference worker
        assert isinstance(workers.ref, ActorBaseRole)
        torch.testing.assert_close(
            workers.ref.compute_log_prob(batch)["log_probs"], batch["ref_log_probs"], atol=1e-6, rtol=0
        )
        workers.actor.update(batch, step=1)
        update = workers.get(workers.actor.start_prepare_weights())
        assert all(".lora_" in slot.name for layout in update.layouts for slot in layout)
        assert workers.get(workers.rollout.start_apply_weights(update)) == 1
        sampled = workers.rollout.generate(prompts, step=2, sampling=SamplingParams.for_training(cfg))
        torch.testing.assert_close(
            workers.actor.compute_log_prob(sampled)["log_probs"][sampled["response_mask"]],
            sampled["rollout_log_probs"][sampled["response_mask"]],
            atol=1e-5,
            rtol=1e-5,
        )  # the rollout serves the actor's updated policy
    finally:
        workers.shutdown()
