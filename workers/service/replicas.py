"""The generation replicas of the rollout service and the load balancer the agent loops call them through.

A :class:`RolloutReplica` (a Ray actor on ``rollout.resources``) holds the policy behind a continuous-batching
engine, a :class:`JudgeReplica` the judge model (``reward_model.judge.model``); :class:`LoadBalancer` sends each
request to the replica with the fewest in flight, sticky per session, and retries one a crashed replica dropped on
another. Details: docs/rollout_service.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import replace

from ppoflow.configs.schema import ModelConfig, PPOConfig, ResourcesConfig
from ppoflow.workers.models import load_causal_lm, load_tokenizer, set_up_worker_process
from ppoflow.workers.rollout.requests import RequestSampling, TokenOutput
from ppoflow.workers.rollout.serving import ContinuousBatchingEngine
from ppoflow.workers.weight_sync import WeightReceiver, WeightUpdate

logger = logging.getLogger("ppoflow.rollout")


class RolloutReplica:
    """One generation replica: the policy on its device behind a continuous-batching engine."""

    def __init__(self, cfg: PPOConfig):
        rollout = cfg.actor_rollout_ref.rollout
        self._serve(cfg.actor_rollout_ref.model, rollout.resources, cfg, dtype=rollout.dtype)

    def _serve(self, model: ModelConfig, resources: ResourcesConfig, cfg: PPOConfig, dtype: str | None = None) -> None:
        self.device = set_up_worker_process(resources)
        tokenizer = load_tokenizer(model)
        self.model = load_causal_lm(model, dtype).to(self.device).eval()
        self.engine = ContinuousBatchingEngine(
            self.model,
            eos_token_id=tokenizer.eos_token_id,
            device=self.device,
            max_num_seqs=cfg.actor_rollout_ref.rollout.max_num_seqs,
        )
        self.engine.start()
        self.receiver = WeightReceiver()
        self.awake = asyncio.Event()
        self.awake.set()

    async def generate_tokens(self, request_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput:
        """Generate one request's tokens (batched with whatever else is in flight on this replica); while the
        replica sleeps, the request waits for it to wake."""
        await self.awake.wait()
        return await asyncio.wrap_future(self.engine.submit(request_id, prompt_ids, sampling))

    async def sleep(self) -> int:
        """verl's abort + sleep of a colocated rollout: every request in flight ends now with the tokens it
        has (``finish_reason="abort"``; the caller resumes it after :meth:`wake`), its KV cache is freed,
        and new requests wait. Returns how many requests were aborted."""
        self.awake.clear()
        return self.engine.abort_all()

    async def wake(self) -> None:
        """Serve again (after the new weights are loaded): waiting and resumed requests start."""
        self.awake.set()

    async def apply_weights(self, update: WeightUpdate) -> int:
        """Load the actor's weights between two decoding steps; returns the version now served. The buckets
        are fetched from the object store without blocking the event loop, which keeps taking requests."""
        fetched = [payload if isinstance(payload, list) else await payload for payload in update.payloads]
        return await asyncio.to_thread(self._load, replace(update, payloads=fetched))

    def _load(self, update: WeightUpdate) -> int:
        with self.engine.paused():
            self.engine.weight_version = self.receiver.apply(self.model, update, self.device)
        return self.engine.weight_version

    async def weight_version(self) -> int:
        """The version of the weights served (0, the initial ones, after Ray restarted this replica)."""
        return self.engine.weight_version

    async def stats(self) -> dict:
        """The engine's counters (requests admitted, tokens generated, mean running batch size, ...)."""
        return self.engine.stats()


class JudgeReplica(RolloutReplica):
    """One replica of the judge model (``reward_model.judge.model``, on ``reward_model.judge.resources``): it
    generates verdicts only and is sent no weights, so a restart reloads all it serves."""

    def __init__(self, cfg: PPOConfig):
        self._serve(cfg.judge_model, cfg.reward_model.judge.resources, cfg)


class LoadBalancer:
    """Routes requests over replicas: least in flight, sticky per session, retried elsewhere on failure."""

    def __init__(self, replicas: list, *, partial_rollout: bool = True, max_sessions: int = 100_000, retries: int = 3):
        self.replicas, self.retries, self.max_sessions = replicas, retries, max_sessions
        self.partial_rollout = partial_rollout
        """Resume an aborted request from its partial output (else start it over)."""
        self.in_flight = [0] * len(replicas)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.requests = 0

    def pick(self, session_id: str, avoid: set[int]) -> int:
        """The session's replica if it has one (and it is not to be avoided), else the least loaded."""
        index = self.sessions.get(session_id)
        if index is None or index in avoid:
            candidates = [i for i in range(len(self.replicas)) if i not in avoid] or list(range(len(self.replicas)))
            index = min(candidates, key=lambda i: self.in_flight[i])
        self.sessions[session_id] = index
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return index

    async def generate(self, session_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput:
        """One model turn's tokens. A request that its replica aborted (it was put to sleep for training:
        colocate_async) is resumed from its partial output once the replica serves again, with the weights
        it then serves (partial rollout): the turn's tokens may span weight versions, which the output's
        ``weight_versions`` record. Without partial rollout the request starts over with those weights."""
        output = await self._generate_once(session_id, prompt_ids, sampling)
        while not self.partial_rollout and output.finish_reason == "abort":
            output = await self._generate_once(session_id, prompt_ids, sampling)
        while output.finish_reason == "abort" and len(output.token_ids) < sampling.max_new_tokens:
            rest = await self._generate_once(
                session_id,
                prompt_ids + output.token_ids,
                replace(
                    sampling,
                    max_new_tokens=sampling.max_new_tokens - len(output.token_ids),
                    seed=continuation_seed(sampling.seed, len(output.token_ids)),
                ),
            )
            output = TokenOutput(
                output.token_ids + rest.token_ids,
                output.log_probs + rest.log_probs,
                rest.finish_reason,
                (
                    min(output.weight_versions[0], rest.weight_versions[0]),
                    max(output.weight_versions[1], rest.weight_versions[1]),
                ),
            )
        return replace(output, finish_reason="length") if output.finish_reason == "abort" else output

    async def _generate_once(self, session_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput:
        import ray

        failed: set[int] = set()
        for attempt in range(len(self.replicas) + self.retries):
            index = self.pick(session_id, failed)
            self.requests += 1
            self.in_flight[index] += 1
            try:
                return await self.replicas[index].generate_tokens.remote(
                    f"{session_id}#{self.requests}", prompt_ids, sampling
                )
            except ray.exceptions.RayActorError as error:
                logger.warning(
                    "rollout replica %d failed a request (%s); retrying on another", index, type(error).__name__
                )
                failed.add(index)
                if len(failed) == len(self.replicas):  # all down at once: wait for Ray to restart them
                    failed.clear()
                    await asyncio.sleep(min(2.0**attempt, 10.0))
            finally:
                self.in_flight[index] -= 1
        raise RuntimeError(f"no rollout replica could serve session {session_id}")


def continuation_seed(seed: int, generated: int) -> int:
    """The sampling seed of a request resumed after ``generated`` tokens: its own random stream, so the
    resumed tokens do not replay the draws of the first ones."""
    return int.from_bytes(hashlib.sha256(f"{seed}/resumed@{generated}".encode()).digest()[:8], "little") % (2**63)
