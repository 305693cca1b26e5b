"""The rollout as a service (``actor_rollout_ref.rollout.mode=async``): replicas, a load balancer, and
the agent-loop workers that call them (verl's V1 rollout: LLM server replicas + AgentLoop workers).

:class:`RolloutReplica` (a Ray actor with a continuous-batching engine, :mod:`ppoflow.workers.serving`),
:class:`LoadBalancer` (fewest in flight, sticky per session, retries on a dead replica), :class:`AgentLoopWorker`
(an asyncio Ray actor running its share of the agent loops) and :class:`RolloutService` (the rollout role the tasks
call: ``generate``, ``apply_weights``). Details: docs/rollout_service.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from dataclasses import replace

import torch
from tensordict import TensorDict

from ppoflow.algorithms.scoring import score_one, solution_text
from ppoflow.configs import tool_config_file
from ppoflow.configs.cache_settings import entry_size_bound, run_cache_dir, storage_settings
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.stages import SAMPLE_CACHE_KEY
from ppoflow.storage.batch import concatenate, non_tensor_column, scores_on_last_tokens, with_non_tensor_columns
from ppoflow.storage.bounded import client_timeouts
from ppoflow.storage.fingerprints import model_identities
from ppoflow.storage.step_cache.sample_cache import SampleCache
from ppoflow.workers.agent_loop import AgentSettings, load_agent_loop_config, make_loops, outputs_to_batch
from ppoflow.workers.models import load_causal_lm, load_tokenizer, set_up_worker_process
from ppoflow.workers.rollout import SamplingParams
from ppoflow.workers.scorer_process import configured_scorer
from ppoflow.workers.serving import ContinuousBatchingEngine, RequestSampling, TokenOutput
from ppoflow.workers.weight_sync import WeightReceiver, WeightUpdate

logger = logging.getLogger("ppoflow.rollout")


class RolloutReplica:
    """One generation replica: the policy on its device behind a continuous-batching engine."""

    def __init__(self, cfg: PPOConfig):
        rollout = cfg.actor_rollout_ref.rollout
        self.device = set_up_worker_process(rollout.resources)
        tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        self.model = load_causal_lm(cfg.actor_rollout_ref.model).to(self.device).eval()
        self.engine = ContinuousBatchingEngine(
            self.model, eos_token_id=tokenizer.eos_token_id, device=self.device, max_num_seqs=rollout.max_num_seqs
        )
        self.engine.start()
        self.receiver = WeightReceiver()
        self.awake = asyncio.Event()
        self.awake.set()

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput:
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
                return await self.replicas[index].generate.remote(f"{session_id}#{self.requests}", prompt_ids, sampling)
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


def trajectory_seed(seed: int, step: int, position: int, sample: int) -> int:
    """The sampling seed of one trajectory: depends only on the run's seed, the step and the trajectory's
    place in the batch, so replays and resumes sample the same whatever the scheduling."""
    text = f"{seed}/{step}/{position}/{sample}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % (2**63)


class AgentLoopWorker:
    """Runs agent loops concurrently on one asyncio event loop (a Ray actor with no CPU of its own)."""

    def __init__(self, cfg: PPOConfig, replicas: list):
        rollout = cfg.actor_rollout_ref.rollout
        self.tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        self.default_loop = rollout.agent.default_agent_loop
        if rollout.agent.agent_loop_config_path:
            load_agent_loop_config(rollout.agent.agent_loop_config_path)
        self.tools = None
        if rollout.multi_turn.tool_config_path:
            from ppoflow.workers.tool_config import load_tool_config
            from ppoflow.workers.tools import ToolRunner

            self.tools = ToolRunner(
                load_tool_config(tool_config_file(rollout.multi_turn.tool_config_path)),
                processes=rollout.multi_turn.tool_processes,
            )
        self.client = LoadBalancer(replicas, partial_rollout=cfg.trainer.v1.colocate_async.partial_rollout)
        self.custom_scorer = configured_scorer(cfg.custom_reward_function)  # user code: its own process
        self.settings = AgentSettings(
            response_length=cfg.data.max_response_length,
            max_assistant_turns=rollout.multi_turn.max_assistant_turns,
            max_tokens_per_turn=rollout.multi_turn.max_tokens_per_turn,
            max_tool_response_length=rollout.multi_turn.max_tool_response_length,
            tool_format=rollout.multi_turn.format,
        )
        self.loops: dict = {}
        self.sample_cache = sample_cache(cfg)

    def loop(self, name: str):
        """The agent loop registered as ``name`` (one instance per worker, made on first use)."""
        if name not in self.loops:
            self.loops.update(
                make_loops(
                    {name}, client=self.client, tokenizer=self.tokenizer, settings=self.settings, tools=self.tools
                )
            )
        return self.loops[name]

    async def generate(
        self, prompts: TensorDict, *, first_position: int, step: int, sampling: SamplingParams, weight_version: int
    ) -> TensorDict:
        """``sampling.n`` trajectories per prompt (rows prompt-major), ``group_index`` counted from
        ``first_position``; a ``tool_errors`` column lists each trajectory's failed tool calls. When the
        prompts carry ``data_source`` and ``ground_truth`` (streamed reward), each trajectory is scored as
        soon as it finishes, while the others still generate: ``token_level_scores`` and a
        ``reward_extras`` column (what the scorer reported besides the score). With the sample cache, a
        ``sample_cache`` column says per trajectory whether its group was replayed (``hit``), generated
        (``miss``, ``read_failed``, ``dump_failed``) or not cached (``off``)."""
        rows = prompts.batch_size[0]
        names = _column(prompts, "agent_name") or [None] * rows
        tools_kwargs = _column(prompts, "tools_kwargs") or [None] * rows
        samples = _column(prompts, "sample_id") or [None] * rows
        sources, truths = _column(prompts, "data_source"), _column(prompts, "ground_truth")
        call_id = uuid.uuid4().hex[:8]
        groups = await asyncio.gather(
            *(
                self.group(
                    prompts["prompts"][row][prompts["prompt_mask"][row]].tolist(),
                    names[row] or self.default_loop,
                    sampling,
                    step=step,
                    position=first_position + row,
                    session=f"{call_id}/{first_position + row}",
                    weight_version=weight_version,
                    tools_kwargs=tools_kwargs[row],
                    sample=samples[row],
                    source=sources[row] if sources else None,
                    truth=truths[row] if truths else None,
                )
                for row in range(rows)
            )
        )
        batch = concatenate(*(group for group, _ in groups), pad_token_id=self.tokenizer.pad_token_id)
        batch["group_index"] = torch.arange(first_position, first_position + rows).repeat_interleave(sampling.n)
        errors = non_tensor_column(batch, "tool_errors")
        for message in sorted({m for row_errors in errors for m in row_errors})[:5]:
            logger.warning("tool call failed: %s", message)
        if self.sample_cache is None:
            return batch
        return with_non_tensor_columns(
            batch, {"sample_cache": [outcome for _, outcome in groups for _ in range(sampling.n)]}
        )

    async def group(
        self,
        prompt_ids: list[int],
        loop_name: str,
        sampling: SamplingParams,
        *,
        step: int,
        position: int,
        session: str,
        weight_version: int,
        tools_kwargs,
        sample: str | None,
        source: str | None,
        truth,
    ) -> tuple[TensorDict, str]:
        """One prompt's ``n`` trajectories (its prompt unpadded) and how the sample cache served them:
        replayed from the cache when it holds them (stamped with the weights served now: they stand in for
        fresh samples, their manifest keeps the versions they were sampled with), else generated
        concurrently (and scored when ``source`` is given) and recorded as soon as all ``n`` finish."""
        cache = self.sample_cache if sample is not None and self.sample_cache is not None else None
        if cache is not None and not cache.covers(sample):
            cache = None
        outcome = "off"
        if cache is not None:
            found = await asyncio.to_thread(cache.lookup, sample, prompt_ids, sampling.as_dict())
            outcome = found.outcome
            if found.group is not None and ("token_level_scores" in found.group.keys()) == (source is not None):
                now = torch.full_like(found.group["weight_version"], weight_version)
                found.group.update({"weight_version": now, "max_weight_version": now.clone()})
                return found.group, outcome
            if found.group is not None:
                logger.warning(
                    "cached %s was recorded %s scores; generating it",
                    sample,
                    "without" if source is not None else "with",
                )
                outcome = "miss"
        loop = self.loop(loop_name)
        runs = []
        for index in range(sampling.n):
            trajectory = loop.run(
                sampling,
                prompt_ids=prompt_ids,
                session_id=f"{session}/{index}",
                seed=trajectory_seed(sampling.seed, step, position, index),
                tools_kwargs=tools_kwargs,
            )
            prompt = repr(sample) if sample is not None else f"{position} of step {step}"
            runs.append(
                trajectory
                if source is None
                else self.scored(
                    trajectory, source, truth, sample=f"response {index} to prompt {prompt} (data source {source!r})"
                )
            )
        finished = await asyncio.gather(*runs)
        outputs = finished if source is None else [output for output, _ in finished]
        group = outputs_to_batch(
            outputs,
            prompt_width=len(prompt_ids),
            response_width=sampling.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            weight_version=weight_version,
        )
        columns = {"tool_errors": [output.extra_fields.get("tool_errors", []) for output in outputs]}
        if source is not None:
            group["token_level_scores"] = scores_on_last_tokens(
                [score for _, (score, _) in finished], group["response_mask"]
            )
            columns["reward_extras"] = [extras for _, (_, extras) in finished]
        group = with_non_tensor_columns(group, columns)
        if cache is not None:
            versions = group["weight_version"]
            meta = {
                "seed": sampling.seed,
                "train_step": step,
                "weight_version": {"min": int(versions.min()), "max": int(versions.max())},
            }
            if not await asyncio.to_thread(cache.dump, sample, prompt_ids, sampling.as_dict(), group, meta=meta):
                outcome = "dump_failed"
        return group, outcome

    async def scored(self, trajectory, data_source: str, ground_truth, *, sample: str) -> tuple:
        """The trajectory, and its score and extras, scored in a thread as soon as it finishes (a slow
        custom scorer does not hold up the event loop); ``sample`` names it in the scorer's messages."""
        output = await trajectory
        solution = solution_text(output.response_ids, self.tokenizer)
        return output, await asyncio.to_thread(
            score_one, data_source, solution, ground_truth, self.custom_scorer, sample=sample
        )


def sample_cache(cfg: PPOConfig) -> SampleCache | None:
    """The run's sample cache (``skip.async_rollout``), if enabled."""
    skip = cfg.skip.get(SAMPLE_CACHE_KEY)
    if skip is None or not skip.enable:
        return None
    model = cfg.actor_rollout_ref.model
    return SampleCache(
        run_cache_dir(skip, cfg, key=SAMPLE_CACHE_KEY),
        indexes=skip.steps,
        action=skip.action,
        storage_options=client_timeouts(
            skip.dump_dir, storage_settings(skip), timeout_s=skip.timeout_s, retries=skip.retries
        ),
        timeout_s=skip.timeout_s,
        retries=skip.retries,
        allow_mismatch=skip.allow_mismatch,
        models=model_identities(model.path, model.tokenizer_path or model.path),
        max_entry_bytes=entry_size_bound(cfg, prompts=1),
    )


def _column(batch: TensorDict, name: str) -> list | None:
    return non_tensor_column(batch, name) if name in batch.keys() else None


class RolloutFailing(RuntimeError):
    """Every prompt group the rollout service generated lately failed; the message gives the last reason."""


class RolloutService:
    """The rollout role of ``rollout.mode=async``: the replicas and the agent-loop workers, called through
    the same ``submit(method, ...)`` as any role (see :mod:`ppoflow.workers.group`)."""

    def __init__(self, replicas: list, agents: list, *, pad_token_id: int):
        import ray

        self.replicas, self.agents, self.pad_token_id = replicas, agents, pad_token_id
        self._next_agent = -1
        self._concatenate = ray.remote(num_cpus=0)(concatenate)
        self.weight_version = 0
        self.last_update = None
        """The last weights pushed (a reference: it keeps their buckets alive), for a restarted replica."""

    def submit(self, method: str, *args, **kwargs):
        if method == "generate":
            return self.generate(*args, **kwargs)
        if method == "apply_weights":
            return self.apply_weights(*args)
        raise AttributeError(f"the rollout service has no {method!r}")

    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams):
        """A reference to the generated rollout batch: the prompts split into contiguous shares, one per
        agent worker, their trajectories concatenated in prompt order."""
        self.resync_restarted()
        rows = prompts.batch_size[0]
        share = -(-rows // len(self.agents))
        parts = [
            agent.generate.remote(
                prompts[start : start + share],
                first_position=start,
                step=step,
                sampling=sampling,
                weight_version=self.weight_version,
            )
            for agent, start in zip(self.agents, range(0, rows, share))
        ]
        return self._concatenate.remote(*parts, pad_token_id=self.pad_token_id)

    def submit_group(self, prompt: TensorDict, *, position: int, step: int, sampling: SamplingParams):
        """A reference to one prompt's group (``sampling.n`` trajectories), generated on the next agent worker
        in turn: the async trainer modes feed prompts one at a time and take each group as it finishes.
        ``position`` (the prompt's feed index) keeps the trajectories' seeds apart."""
        self._next_agent = (self._next_agent + 1) % len(self.agents)
        return self.agents[self._next_agent].generate.remote(
            prompt, first_position=position, step=step, sampling=sampling, weight_version=self.weight_version
        )

    def cancel(self, groups: list, timeout_s: float = 10.0) -> None:
        """End the generations of ``groups`` (references from :meth:`submit_group`) and wait, up to
        ``timeout_s``, until they have: each agent worker's task is cancelled, and the replica requests its
        loops made with it (Ray cancels what a cancelled task submitted), so that no request is left waiting
        on a replica when the run kills the actors (which Ray reports as a failed task). Their results are
        dropped; one that failed is logged."""
        import ray

        if not groups:
            return
        for group in groups:
            ray.cancel(group)
        ended, _ = ray.wait(groups, num_returns=len(groups), timeout=timeout_s)
        for group in ended:  # read, or Ray reports each cancellation as an unhandled error when it is freed
            try:
                ray.get(group)
            except ray.exceptions.TaskCancelledError:
                pass
            except ray.exceptions.RayError as error:
                logger.warning("a generation ended at the end of the run failed: %r", error)

    def sleep(self) -> list:
        """References to every replica going to sleep (:meth:`RolloutReplica.sleep`: requests in flight are
        aborted and resumed after :meth:`wake`; each returns how many it aborted)."""
        return [replica.sleep.remote() for replica in self.replicas]

    def wake(self) -> list:
        """References to every replica serving again."""
        return [replica.wake.remote() for replica in self.replicas]

    def apply_weights(self, update) -> list:
        """References to every replica taking the update (a :class:`WeightUpdate` or a reference to one;
        each returns the version it now serves)."""
        import ray

        self.weight_version = (ray.get(update) if isinstance(update, ray.ObjectRef) else update).version
        self.last_update = update
        return [replica.apply_weights.remote(update) for replica in self.replicas]

    def resync_restarted(self) -> None:
        """Give every replica that serves other weights than the last pushed (Ray restarted it after a crash)
        those weights again before it takes requests. A replica restarted in the middle of a batch serves
        its initial weights until the next batch; the trainer sees their version on the trajectories and
        generates that batch again."""
        import ray

        if self.last_update is None:
            return
        versions = ray.get([replica.weight_version.remote() for replica in self.replicas])
        stale = [index for index, version in enumerate(versions) if version != self.weight_version]
        if stale:
            logger.warning(
                "rollout replica(s) %s serve weight version(s) %s instead of %d (restarted): re-syncing",
                stale,
                [versions[i] for i in stale],
                self.weight_version,
            )
            ray.get([self.replicas[index].apply_weights.remote(self.last_update) for index in stale])
