"""The colocated actor (``actor_rollout_ref.hybrid_engine``, verl's hybrid engine): every actor rank also hosts a
rollout engine that samples its share of a step with the weights the rank trains, and sleeps, its memory freed,
while the ranks train. With ``rollout.mode=async`` the ranks' engines are the rollout service's replicas
(:class:`~ppoflow.workers.service.rollout_service.ColocatedRolloutService`). Layouts: docs/scale_out.md#layouts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import ray
import torch
from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig
from ppoflow.workers.memory import memory_in_use_gb, release_freed_memory
from ppoflow.workers.models import copy_in_dtype, load_tokenizer
from ppoflow.workers.rollout.requests import RequestSampling, TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams, outputs_batch, prompt_token_ids, sample_trajectories
from ppoflow.workers.rollout.serving import ContinuousBatchingEngine
from ppoflow.workers.stage import worker_stage
from ppoflow.workers.training.data_parallel import RankInfo
from ppoflow.workers.training.policy import ActorWorker


class ColocatedActorWorker(ActorWorker):
    """The actor whose ranks also generate (``actor_rollout_ref.hybrid_engine``, verl's hybrid engine): each rank
    hosts a rollout engine on the weights it trains, so weight_sync moves nothing.

    The engine is awake only while it generates. :meth:`wake` gives it a model to sample with: the actor's own (one
    rank, ``rollout.dtype`` = ``model.dtype``), else a copy in ``rollout.dtype`` (with LoRA: merged) filled tensor by
    tensor in this process, every rank gathering its FSDP2 shards from the others (no copy between workers);
    :meth:`sleep` drops the copy and the engine's KV cache and gives their memory back, so neither adds to the
    update's peak. :meth:`generate` wakes, samples the rank's share of a batch and sleeps; the rollout service
    (``rollout.mode=async``) wakes every rank, sends it agent loops' requests (:meth:`generate_tokens`) and puts it
    to sleep once the step's trajectories are in. The memory read around both is reported as
    ``perf/actor/rollout_{wake,sleep}_{before,after}_gb``."""

    PROFILE_ROLES = ("actor", "rollout")
    SERVING = "rollout"
    """The Ray concurrency group of :meth:`generate_tokens`: requests wait on threads of their own beside the one
    thread that runs every other call in turn (the launcher defines it, ``rollout.max_num_seqs`` wide)."""

    def __init__(self, cfg: PPOConfig, ranks: RankInfo | None = None):
        super().__init__(cfg, ranks)
        self.tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
        self.rollout_dtype = rollout.dtype
        self.samples_with_actor = rollout.dtype == model.dtype and not self.parallel.sharded
        self.max_num_seqs = rollout.max_num_seqs
        self.rollout_model: torch.nn.Module | None = None
        """What the engine samples with while awake (None asleep)."""
        self.engine: ContinuousBatchingEngine | None = None
        """The serving engine while awake for the rollout service."""
        self.serving = threading.Condition()
        """Held to start a request or change the engine; notified when it starts serving."""
        self.engine_memory: dict[str, float] = {}
        self.vllm = None
        """``rollout.name=vllm``: the rank's vLLM engine, asleep except while it generates."""
        if rollout.name == "vllm":
            from ppoflow.workers.rollout.vllm_worker import ColocatedVLLMEngine

            self.vllm = ColocatedVLLMEngine(cfg)

    def memory_stats(self) -> dict[str, float]:
        return {**super().memory_stats(), **self.engine_memory}

    @worker_stage("rollout_generate")
    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict | None:
        """The rollout worker's ``generate`` on the actor's weights, stamped with its weight version: this rank samples
        its share of the prompts (:meth:`~ppoflow.workers.training.data_parallel.DataParallel.prompt_shares`) with
        the seeds of their places in the batch, so the tokens do not depend on the number of ranks; rank 0 returns
        the whole batch in prompt order (the others: None)."""
        rows = self.parallel.prompt_shares(prompts)[self.parallel.rank]
        ids = prompt_token_ids(prompts)
        mine = [ids[row] for row in rows]
        self.wake()
        try:
            if self.vllm is not None:
                outputs = self.vllm.sample(mine, rows, step=step, sampling=sampling)
            else:
                outputs = sample_trajectories(
                    self.rollout_model,
                    mine,
                    rows,
                    step=step,
                    sampling=sampling,
                    eos_token_id=self.tokenizer.eos_token_id,
                    device=self.device,
                )
        finally:
            self.sleep()
        n = sampling.n
        groups = self.parallel.gather_rows(rows, [outputs[i * n : (i + 1) * n] for i in range(len(rows))], len(ids))
        if groups is None:
            return None
        return outputs_batch(
            prompts,
            sampling,
            [output for group in groups for output in group],
            weight_version=self.weight_version,
            tokenizer=self.tokenizer,
        )

    def wake(self, *, serve: bool = False) -> None:
        """Make the model the engine samples with (:attr:`rollout_model`; at several ranks a collective, so every rank
        wakes at once); ``serve``: also start a continuous-batching engine on it for :meth:`generate_tokens`,
        stamped with the actor's weight version (the rollout service's replica)."""
        self.engine_memory["rollout_wake_before_gb"] = memory_in_use_gb(self.device)
        if self.vllm is not None:  # vLLM loads the full weights into its own model, tensor by tensor
            self.vllm.wake(self._full_weights())
        else:
            self.rollout_model = self._rollout_model()
        if serve:
            engine = ContinuousBatchingEngine(
                self.rollout_model,
                eos_token_id=self.tokenizer.eos_token_id,
                device=self.device,
                max_num_seqs=self.max_num_seqs,
            )
            engine.weight_version = self.weight_version
            engine.start()
            with self.serving:
                self.engine = engine
                self.serving.notify_all()
        self.engine_memory["rollout_wake_after_gb"] = memory_in_use_gb(self.device)

    def sleep(self) -> int:
        """Free what generation holds - the engine with its KV cache (its requests in flight aborted: how many is
        returned) and the model copy :meth:`wake` made - and give the memory back, before the ranks train."""
        self.engine_memory["rollout_sleep_before_gb"] = memory_in_use_gb(self.device)
        with self.serving:
            engine, self.engine = self.engine, None
        aborted = 0
        if engine is not None:
            aborted = engine.abort_all()
            engine.stop()
        del engine
        self.rollout_model = None
        if self.vllm is not None:
            self.vllm.sleep()
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.engine_memory["rollout_sleep_after_gb"] = memory_in_use_gb(self.device)
        return aborted

    @ray.method(concurrency_group=SERVING)
    def generate_tokens(self, request_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput:
        """One request of an agent loop (the rollout service's call to a replica), batched with the others in flight
        on this rank's engine; while the engine sleeps, it waits for the next :meth:`wake`."""
        with self.serving:
            self.serving.wait_for(lambda: self.engine is not None)
            future = self.engine.submit(request_id, prompt_ids, sampling)
        return future.result()

    def _rollout_model(self) -> torch.nn.Module:
        """The model to sample with: the actor's own, or a copy of its full weights in ``rollout.dtype``."""
        if self.samples_with_actor:
            return self.model
        return copy_in_dtype(
            self.adapter.base if self.adapter else self.model, self._full_weights(), self.rollout_dtype
        )

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full weights, one tensor at a time: gathered from the ranks' shards, or with LoRA merged."""
        return self.adapter.merged_items() if self.adapter is not None else self.parallel.full_weights(self.model)
