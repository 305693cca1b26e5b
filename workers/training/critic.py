"""The critic worker: a value head on the causal LM (verl: token classification with one label),
its value predictions for GAE, and its clipped value-loss update.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppoflow.algorithms.losses import compute_value_loss
from ppoflow.algorithms.masked import masked_mean
from ppoflow.configs.schema import PPOConfig
from ppoflow.workers.memory import ReportsMemory
from ppoflow.workers.models import (
    keep_attention_off_cudnn_if_padded,
    load_value_model,
    set_up_worker_process,
    with_gradient_checkpointing,
)
from ppoflow.workers.profiler import Profiles
from ppoflow.workers.stage import worker_stage
from ppoflow.workers.training.data_parallel import DataParallel, RankInfo
from ppoflow.workers.training.learner import (
    Learner,
    autocast_dtype,
    micro_batches,
    pad_responses,
    response_logits,
    sharing_groups,
    weights_digest,
)
from ppoflow.workers.training.packing import response_positions, to_rows


class CriticWorker(ReportsMemory, Profiles):
    """Values V(s_t) of every response position, and the value-function update; one rank of the critic's
    data-parallel group (``ranks``; None: the only one)."""

    PROFILE_ROLES = ("critic",)

    def __init__(self, cfg: PPOConfig, ranks: RankInfo | None = None):
        critic = cfg.critic
        self.device = set_up_worker_process(critic.resources)
        self.parallel = DataParallel.join(ranks, self.device)
        keep_attention_off_cudnn_if_padded(self.device, critic.model.use_remove_padding)
        self.cfg = critic
        self.mini_batch_size = critic.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
        self.response_length = cfg.data.max_response_length
        self.seed = cfg.data.seed
        model = with_gradient_checkpointing(
            load_value_model(critic.model, seed=cfg.data.seed), critic.model.enable_gradient_checkpointing
        )
        self.model = self.parallel.shard(model.to(self.device), critic.fsdp_config)
        self.compute_dtype = autocast_dtype(self.model, critic.fsdp_config, self.parallel)
        self.learner = Learner(
            self.model,
            critic.optim,
            grad_clip=critic.grad_clip,
            device=self.device,
            parallel=self.parallel,
            nonfinite=cfg.trainer.nonfinite,
            remove_padding=critic.model.use_remove_padding,
        )

    @worker_stage("critic_compute_values")
    def compute_values(self, batch: TensorDict) -> TensorDict | None:
        """``values`` [N, R]: the value of the state before each response token, zero after EOS. Each rank
        computes its rows; rank 0 returns them all (the others: None)."""
        self.model.eval()
        cfg, values, rows = self.cfg, [], []
        budget = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        together = sharing_groups(self.model, batch, cfg.model.use_remove_padding) if budget else None
        cuts = micro_batches(
            batch, self.parallel, size=cfg.forward_micro_batch_size_per_gpu, max_tokens=budget, keep_together=together
        )
        with torch.no_grad():
            for group, micro in cuts:
                values.append(self._values(micro.to(self.device)).float().cpu())
                rows += group
        values = self.parallel.gather_indexed(rows, pad_responses(values, batch["responses"].shape[1]), len(batch))
        return None if values is None else TensorDict({"values": values}, batch_size=batch.batch_size)

    def save_checkpoint(self, directory: str) -> dict[str, dict]:
        """Write weights and optimizer into ``directory`` (a checkpoint's ``critic/``); manifest entries."""
        return self.learner.save(directory)

    def load_checkpoint(self, directory: str, entries: dict[str, dict]) -> None:
        self.learner.load(directory, entries)

    def weights_digest(self) -> str | None:
        """Checksum of the current weights (guards a cached value pass)."""
        return weights_digest(self.model, self.parallel)

    @worker_stage("critic_update")
    def update(self, batch: TensorDict, *, step: int) -> dict[str, float] | None:
        """Clipped value-loss epochs over ``batch`` (needs ``values`` and ``returns``); metrics on rank 0."""
        cfg = self.cfg

        def micro_loss(micro: TensorDict, num_tokens: float, num_seqs: float):
            vpreds = self._values(micro)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                micro["returns"],
                micro["values"],
                micro["response_mask"],
                cliprange_value=cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                loss_scale_factor=self.response_length,
            )
            averaged = {
                "critic/vf_clipfrac": vf_clipfrac,
                "critic/vpred_mean": masked_mean(vpreds.detach(), micro["response_mask"]),
            }
            return vf_loss, {"critic/vf_loss": vf_loss}, averaged

        metrics = self.learner.train(
            batch,
            micro_loss,
            epochs=cfg.ppo_epochs,
            mini_batch_size=self.mini_batch_size,
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            max_token_len=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            shuffle=cfg.shuffle,
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + step),
            prefix="critic",
            step=step,
        )
        return metrics if self.parallel.is_rank_zero else None

    def _values(self, batch: TensorDict) -> torch.Tensor:
        scores = response_logits(
            self.model, batch, remove_padding=self.cfg.model.use_remove_padding, compute_dtype=self.compute_dtype
        )
        return to_rows(scores.squeeze(-1), response_positions(batch)) * batch["response_mask"]
