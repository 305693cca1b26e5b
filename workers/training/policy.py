"""The actor and reference workers: the policy's log-probs, its PPO update, and its weights.

Both hold a causal LM in a long-lived Ray actor; the reference is a frozen copy of the initial
policy that only computes log-probs (for KL terms); the colocated actor, which also generates, is in
:mod:`ppoflow.workers.training.colocated`. The
update follows verl's actor: for each PPO epoch, for each mini-batch, accumulate the loss of its
micro-batches (normalised by the whole mini-batch, so micro-batching does not change the gradient),
clip, step.
"""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict

from ppoflow.algorithms.kl import kl_penalty
from ppoflow.algorithms.losses import agg_loss, log_probs_and_entropy
from ppoflow.configs.modes import needs_of
from ppoflow.configs.rules_policy_loss import configured_policy_loss
from ppoflow.configs.schema import PPOConfig, ResourcesConfig, TrainingEngineConfig
from ppoflow.storage.batch import StageResult
from ppoflow.storage.fs import join
from ppoflow.workers.memory import ReportsMemory
from ppoflow.workers.models import (
    keep_attention_off_cudnn_if_padded,
    load_causal_lm,
    load_tokenizer,
    save_pretrained,
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
    trained_state_names,
    weights_digest,
)
from ppoflow.workers.training.lora import ADAPTER_DIR, Adapter, rollout_holds_adapter, with_lora
from ppoflow.workers.training.packing import response_positions, to_rows
from ppoflow.workers.weight_sync import WeightSender, WeightUpdate, join_group


class PolicyModel(ReportsMemory, Profiles):
    """A causal LM on its device that computes response log-probs at the rollout temperature; one rank of
    its role's data-parallel group (``ranks``; None: the only one), sharded by the role's engine. ``lora``: wrap
    it with the LoRA adapter ``model.lora_rank`` / ``lora_adapter_path`` ask for (the actor; :attr:`adapter`)."""

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        resources: ResourcesConfig,
        micro_batch_size: int | None,
        max_token_len: int | None,
        engine: TrainingEngineConfig,
        ranks: RankInfo | None,
        gradient_checkpointing: bool = False,
        lora: bool = False,
    ):
        self.device = set_up_worker_process(resources)
        self.parallel = DataParallel.join(ranks, self.device)
        rollout = cfg.actor_rollout_ref.rollout
        self.temperature = rollout.temperature if rollout.temperature > 0 else 1.0
        self.micro_batch_size, self.max_token_len = micro_batch_size, max_token_len
        self.remove_padding = cfg.actor_rollout_ref.model.use_remove_padding
        keep_attention_off_cudnn_if_padded(self.device, self.remove_padding)
        model = with_gradient_checkpointing(load_causal_lm(cfg.actor_rollout_ref.model), gradient_checkpointing)
        self.adapter: Adapter | None = None
        if lora and cfg.actor_rollout_ref.model.lora:  # the actor trains LoRA adapters on the frozen base
            model = with_lora(model, cfg.actor_rollout_ref.model, seed=cfg.data.seed)
            self.adapter = Adapter(model)
        self.model = self.parallel.shard(model.to(self.device), engine.fsdp_config)
        self.compute_dtype = autocast_dtype(self.model, engine.fsdp_config, self.parallel)

    def compute_log_prob(self, batch: TensorDict) -> TensorDict | None:
        """Per-token ``log_probs`` of the responses, [N, R]; no gradient. Each rank computes its rows;
        rank 0 returns them all (the others: None)."""
        self.model.eval()
        parts, rows = [], []
        together = sharing_groups(self.model, batch, self.remove_padding) if self.max_token_len else None
        cuts = micro_batches(
            batch, self.parallel, size=self.micro_batch_size, max_tokens=self.max_token_len, keep_together=together
        )
        with torch.no_grad():
            for group, micro in cuts:
                parts.append(self.token_log_probs(micro.to(self.device))[0].float().cpu())
                rows += group
        log_probs = self.parallel.gather_indexed(rows, pad_responses(parts, batch["responses"].shape[1]), len(batch))
        return None if log_probs is None else TensorDict({"log_probs": log_probs}, batch_size=batch.batch_size)

    def token_log_probs(
        self, micro: TensorDict, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's response ``log_probs`` [n, r] at the rollout temperature and (``with_entropy``) the
        entropy of each position's distribution, [n, r]; zero outside each row's extent."""
        logits = response_logits(
            self.model, micro, remove_padding=self.remove_padding, compute_dtype=self.compute_dtype
        )
        positions = response_positions(micro)
        log_probs, entropy = log_probs_and_entropy(
            logits / self.temperature, micro["responses"][positions], with_entropy=with_entropy
        )
        return to_rows(log_probs, positions), None if entropy is None else to_rows(entropy, positions)

    def weights_digest(self) -> str | None:
        """Checksum of the current weights (guards a cached log-prob pass); with LoRA, of the adapter and the
        base's digest, which is computed once."""
        if self.adapter is not None:
            return self.adapter.digest()
        return weights_digest(self.model, self.parallel)


class ReferenceWorker(PolicyModel):
    """A frozen copy of the initial policy, for KL terms."""

    PROFILE_ROLES = ("ref",)

    def __init__(self, cfg: PPOConfig, ranks: RankInfo | None = None):
        ref = cfg.actor_rollout_ref.ref
        super().__init__(
            cfg,
            resources=ref.resources,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
            engine=ref,
            ranks=ranks,
        )

    compute_log_prob = worker_stage("ref_compute_log_prob")(PolicyModel.compute_log_prob)


class ActorWorker(PolicyModel):
    """The trained policy: log-probs, the PPO update, and weight export for the rollout workers."""

    PROFILE_ROLES = ("actor",)

    def __init__(self, cfg: PPOConfig, ranks: RankInfo | None = None):
        actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        super().__init__(
            cfg,
            resources=actor.resources,
            micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
            max_token_len=rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None,
            engine=actor,
            ranks=ranks,
            gradient_checkpointing=cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
            lora=True,
        )
        self.cfg = actor
        self.policy_loss = configured_policy_loss(actor.policy_loss)  # imports a user's loss_module here too
        self.model_config = cfg.actor_rollout_ref.model
        self.mini_batch_size = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
        self.response_length = cfg.data.max_response_length
        self.seed = cfg.data.seed
        self.learner = Learner(
            self.model,
            actor.optim,
            grad_clip=actor.grad_clip,
            device=self.device,
            parallel=self.parallel,
            nonfinite=cfg.trainer.nonfinite,
            remove_padding=self.remove_padding,
        )
        # A mode that is not on-policy may sample with weights older than the actor's: keep what was last pushed.
        on_policy = needs_of(cfg.trainer.mode).on_policy
        self.sender = WeightSender(cfg.actor_rollout_ref.rollout.weight_sync, keep_copy=not on_policy)
        self._outgoing: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        # With LoRA the rollout takes the adapter alone when it holds one too, else the merged weights.
        self.sends_adapter = rollout_holds_adapter(cfg)
        # The log-prob passes of actor and reference (the same model with LoRA: its adapter switched off for one)
        # run one at a time; in process the forward passes of a step are called side by side.
        self._passes = threading.Lock()

    def snapshot_weights(self) -> None:
        """Keep a copy of the current trained weights (with LoRA: the adapter's): the step's first π_old, for the
        later mini-batch updates of a separate_async step (verl's CPU weight slot 0 for decoupled PPO)."""
        self._step_start = self._trained_state()

    @worker_stage("actor_compute_log_prob")
    def compute_log_prob(self, batch: TensorDict, *, at_step_start: bool = False) -> TensorDict:
        """Per-token ``log_probs`` of the responses, [N, R], no gradient; ``at_step_start``: under the weights
        :meth:`snapshot_weights` kept, loaded in place for the pass and the current ones put back after it
        (the optimizer's parameters stay the same tensors)."""
        with self._passes:
            if not at_step_start:
                return super().compute_log_prob(batch)
            current = self._trained_state()
            self.model.load_state_dict(self._step_start, strict=False)
            try:
                return super().compute_log_prob(batch)
            finally:
                self.model.load_state_dict(current, strict=False)

    @worker_stage("ref_compute_log_prob")
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """The reference's ``log_probs`` when it is this model's base (``ref_in_actor``, LoRA): the same pass
        with the adapter disabled."""
        with self._passes, self.adapter.disabled():
            return PolicyModel.compute_log_prob(self, batch)

    def ref_weights_digest(self) -> str:
        """The reference's weights digest when it is this model's base: the base model's, computed once."""
        return self.adapter.base_digest()

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """A copy of the state the optimizer trains (aliases of tied weights left out)."""
        names = trained_state_names(self.model)
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items() if name in names}

    @worker_stage("actor_update")
    def update(self, batch: TensorDict, *, step: int) -> StageResult:
        """PPO epochs over ``batch`` (needs ``advantages``; ``ref_log_probs`` for a KL loss); metrics ``actor/*``.

        ``old_log_probs`` come with the batch, except when the update is on-policy (one epoch over one
        mini-batch): then they are the update's own log-probs, detached - the same values a separate
        forward pass would give, one pass cheaper - and are returned as the result's field."""
        cfg = self.cfg
        rows = batch.batch_size[0]
        on_policy = "old_log_probs" not in batch.keys()
        if on_policy and (cfg.ppo_epochs != 1 or rows > self.mini_batch_size):
            raise ValueError(
                f"the batch has no old_log_probs, but the update is not on-policy ({cfg.ppo_epochs} "
                f"epochs, mini-batches of {self.mini_batch_size} of {rows} trajectories)"
            )
        own_log_probs: list[torch.Tensor] = []
        own_rows: list[torch.Tensor] = []
        if on_policy:  # each row's index, to put the own log-probs of every rank's micro-batches back in order
            batch = batch.copy()
            batch["row"] = torch.arange(rows)

        # A loss that samples tokens (clip_cov) draws from its own seeded stream, so a replayed step repeats it.
        loss_generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 500_000_000)

        def micro_loss(micro: TensorDict, num_tokens: float, num_seqs: float):
            # Global normalisers; the padded horizon is max_response_length, whatever padding was trimmed.
            normalizers = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_factor": self.response_length}
            mask = micro["response_mask"]
            log_probs, token_entropy = self.token_log_probs(micro, with_entropy=True)
            if on_policy:
                own_log_probs.append(log_probs.detach().float().cpu())
                own_rows.append(micro["row"].cpu())
            old_log_probs = log_probs.detach() if on_policy else micro["old_log_probs"]
            pg_loss, pg_metrics = self.policy_loss(
                old_log_probs,
                log_probs,
                micro["advantages"],
                mask,
                loss_agg_mode=cfg.loss_agg_mode,
                config=cfg,
                rollout_is_weights=micro.get("rollout_is_weights", None),
                generator=loss_generator,
                **normalizers,
            )
            entropy = agg_loss(token_entropy, mask, cfg.loss_agg_mode, **normalizers)
            loss = pg_loss - cfg.entropy_coeff * entropy
            summed = {"actor/pg_loss": pg_loss, "actor/entropy": entropy}
            if cfg.use_kl_loss:
                kl = agg_loss(
                    kl_penalty(log_probs, micro["ref_log_probs"], cfg.kl_loss_type),
                    mask,
                    cfg.loss_agg_mode,
                    **normalizers,
                )
                loss = loss + cfg.kl_loss_coef * kl
                summed["actor/kl_loss"] = kl
            return loss, summed, {f"actor/{name}": value for name, value in pg_metrics.items()}

        # On-policy, the one mini-batch holds every row whatever its order: keep the batch's order, so the
        # log-probs collected micro-batch by micro-batch line up with its rows.
        metrics = self.learner.train(
            batch,
            micro_loss,
            epochs=cfg.ppo_epochs,
            mini_batch_size=self.mini_batch_size,
            micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
            max_token_len=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            shuffle=cfg.shuffle and not on_policy,
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + step),
            prefix="actor",
            step=step,
        )
        if metrics["actor/optimizer_steps"]:  # else every step was skipped on non-finite values: the trainer drops it
            self.weight_version += 1
        if not on_policy:
            return StageResult(None, metrics) if self.parallel.is_rank_zero else None
        old_log_probs = self.parallel.gather_indexed(
            torch.cat(own_rows).tolist(), pad_responses(own_log_probs, batch["responses"].shape[1]), rows
        )
        if old_log_probs is None:
            return None
        return StageResult(TensorDict({"old_log_probs": old_log_probs}, batch_size=batch.batch_size), metrics)

    def skip_update(self) -> None:
        """A step whose update was dropped (non-finite values, ``trainer.nonfinite=skip``): the weights stay
        as they are and take the step's version, as the trainer's count of steps does."""
        self.weight_version += 1

    def save_checkpoint(self, directory: str) -> dict[str, dict]:
        """Write weights and optimizer into ``directory`` (a checkpoint's ``actor/``); manifest entries."""
        return self.learner.save(directory)

    def load_checkpoint(self, directory: str, entries: dict[str, dict], weight_version: int) -> None:
        """Restore weights, optimizer and the weight version from a checkpoint's ``actor/``."""
        self.learner.load(directory, entries)
        self.weight_version = weight_version
        self.sender.forget()  # the next sync sends everything

    def save_pretrained(self, url: str) -> None:
        """Write the current policy, unsharded, and its tokenizer as a Hugging Face model directory at ``url``;
        with LoRA the merged model (base + adapter: loads without peft), and the adapter alone in peft's format
        in ``url/adapter``."""
        if self.adapter is not None:
            tokenizer = load_tokenizer(self.model_config)
            base, merged = self.adapter.base_weights(), self.adapter.merged_items()  # merged one layer at a time
            save_pretrained(self.adapter.base, tokenizer, url, weights=base, stream=merged)
            save_pretrained(self.model, tokenizer, join(url, ADAPTER_DIR), weights=self.model.state_dict())
            return
        weights = self.parallel.full_state_dict(self.model)
        if self.parallel.is_rank_zero:  # written one tensor at a time, not serialized whole first
            save_pretrained(self.model, load_tokenizer(self.model_config), url, weights=weights, stream=weights.items())

    def prepare_weights(self, again: bool = False, version: int | None = None) -> WeightUpdate:
        """Lay out (and, through the object store, publish) the current weights for the rollout worker,
        stamped ``version`` (the trainer's count of steps; default: this worker's count of updates, the same
        unless a step makes several, as separate_async does); ``again``: the weights pushed last time
        instead, whole (for a restarted rollout worker). With LoRA: the adapter's tensors, or the merged full
        weights for a rollout that holds no adapter (:func:`~ppoflow.workers.training.lora.rollout_holds_adapter`)."""
        version = self.weight_version if version is None else version
        if not again and self.adapter is not None:
            weights = self.adapter.weights() if self.sends_adapter else self.adapter.merged_weights()
        elif not again:
            weights = self.parallel.full_state_dict(self.model)  # every rank takes part in gathering them
        if not self.parallel.is_rank_zero:  # rank 0 sends, and keeps what it sent
            return None
        update, self._outgoing = self.sender.prepare_again() if again else self.sender.prepare(weights, version)
        return update

    def broadcast_weights(self, update: WeightUpdate) -> None:
        """Collective backends: send the prepared update's buckets to the rollout worker (from rank 0)."""
        if self.parallel.is_rank_zero:
            self.sender.broadcast(self._outgoing, update, self.device)

    def join_weight_group(self, group: str) -> None:
        """Rank 0 joins the weight-sync group as its sender."""
        if self.parallel.is_rank_zero:
            join_group(self.sender.sync.backend, group, rank=0)
            self.sender.group = group
