"""The transformers rollout worker (``rollout.name=hf``): holds a copy of the policy in a long-lived Ray actor and
samples with :func:`~ppoflow.workers.rollout.sampling.sample_responses`; takes the actor's new weights (with LoRA: its
adapter's tensors, into the same LoRA layers)."""

from __future__ import annotations

from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig
from ppoflow.workers.memory import ReportsMemory
from ppoflow.workers.models import load_causal_lm, load_tokenizer, set_up_worker_process
from ppoflow.workers.profiler import Profiles
from ppoflow.workers.rollout.sampling import SamplingParams, sample_responses
from ppoflow.workers.stage import worker_stage
from ppoflow.workers.training.lora import rollout_holds_adapter, with_lora
from ppoflow.workers.weight_sync import WeightReceiver, WeightUpdate, join_group


class HFRolloutWorker(ReportsMemory, Profiles):
    """Sampling with a transformers causal LM (CPU or GPU) in ``rollout.dtype``; a weight sync casts into it."""

    PROFILE_ROLES = ("rollout",)

    def __init__(self, cfg: PPOConfig):
        self.device = set_up_worker_process(cfg.actor_rollout_ref.rollout.resources)
        model_config = cfg.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model_config)
        model = load_causal_lm(model_config, cfg.actor_rollout_ref.rollout.dtype)
        if rollout_holds_adapter(cfg):  # LoRA: the actor's adapter, wrapped alike; a sync sends only its tensors
            model = with_lora(model, model_config, seed=cfg.data.seed).get_base_model()
        self.model = model.to(self.device).eval()
        self.weight_version = 0
        self.backend = cfg.actor_rollout_ref.rollout.weight_sync.backend
        self.receiver = WeightReceiver()

    @worker_stage("rollout_generate")
    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict:
        """Sample ``sampling.n`` responses per prompt; rows come out prompt-major (p0 s0..s(n-1), p1 ...)."""
        return sample_responses(
            self.model,
            self.tokenizer,
            prompts,
            step=step,
            sampling=sampling,
            weight_version=self.weight_version,
            device=self.device,
        )

    def apply_weights(self, update: WeightUpdate) -> int:
        """Take the actor's weights (see :mod:`ppoflow.workers.weight_sync`); returns the version now served."""
        self.weight_version = self.receiver.apply(self.model, update, self.device)
        return self.weight_version

    def join_weight_group(self, group: str) -> None:
        join_group(self.backend, group, rank=1)
        self.receiver.group = group
