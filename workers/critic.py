"""The critic worker: a value head on the causal LM (verl: token classification with one label),
its value predictions for GAE, and its clipped value-loss update.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from configs.schema import PPOConfig
from tasks.algorithms.advantages import masked_mean
from tasks.algorithms.losses import compute_value_loss
from workers.models import load_value_model
from workers.training import clipped_step, make_optimizer, mean_metrics, micro_batches, mini_batches, sequence_inputs


class CriticWorker:
    """Values V(s_t) of every response position, and the value-function update."""

    def __init__(self, cfg: PPOConfig):
        critic = cfg.critic
        torch.set_num_threads(critic.resources.num_threads)
        self.device = torch.device("cuda" if critic.resources.num_gpus > 0 else "cpu")
        self.cfg = critic
        self.mini_batch_size = critic.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
        self.seed = cfg.data.seed
        self.model = load_value_model(critic.model).to(self.device)
        self.optimizer, self.scheduler = make_optimizer(self.model, critic.optim)

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """``values`` [N, R]: the value of the state before each response token, zero after EOS."""
        self.model.eval()
        with torch.no_grad():
            values = [self._values(micro.to(self.device)).float().cpu()
                      for micro in micro_batches(batch, self.cfg.forward_micro_batch_size_per_gpu)]
        return TensorDict({"values": torch.cat(values)}, batch_size=batch.batch_size)

    def update(self, batch: TensorDict, *, step: int) -> dict[str, float]:
        """Clipped value-loss epochs over ``batch`` (needs ``values`` and ``returns``)."""
        cfg = self.cfg
        self.model.train()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = []
        for _ in range(cfg.ppo_epochs):
            for mini in mini_batches(batch, self.mini_batch_size, shuffle=cfg.shuffle, generator=generator):
                num_tokens = float(mini["response_mask"].sum())
                num_seqs = float(mini["response_mask"].any(dim=1).sum())
                totals: dict[str, float] = {}
                for micro in micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu):
                    micro = micro.to(self.device)
                    share = micro.batch_size[0] / mini.batch_size[0]
                    vpreds = self._values(micro)
                    vf_loss, vf_clipfrac = compute_value_loss(
                        vpreds, micro["returns"], micro["values"], micro["response_mask"],
                        cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
                        num_tokens=num_tokens, num_seqs=num_seqs)
                    vf_loss.backward()
                    totals["critic/vf_loss"] = totals.get("critic/vf_loss", 0.0) + float(vf_loss.detach())
                    totals["critic/vf_clipfrac"] = totals.get("critic/vf_clipfrac", 0.0) + float(vf_clipfrac) * share
                    totals["critic/vpred_mean"] = totals.get("critic/vpred_mean", 0.0) + float(
                        masked_mean(vpreds.detach(), micro["response_mask"])) * share
                totals["critic/grad_norm"] = clipped_step(self.model, self.optimizer, self.scheduler, cfg.grad_clip)
                totals["critic/lr"] = self.optimizer.param_groups[0]["lr"]
                rows.append(totals)
        return mean_metrics(rows)

    def _values(self, batch: TensorDict) -> torch.Tensor:
        input_ids, attention_mask, position_ids = sequence_inputs(batch)
        scores = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).logits.squeeze(-1)
        prompt_length, response_length = batch["prompts"].shape[1], batch["responses"].shape[1]
        values = scores[:, prompt_length - 1: prompt_length + response_length - 1]
        return values * batch["response_mask"]
