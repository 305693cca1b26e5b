"""The agent-loop workers of the rollout service: asyncio Ray actors that run one agent loop per trajectory
against the replicas (through a :class:`~ppoflow.workers.service.replicas.LoadBalancer`), score finished
trajectories when the rollout streams rewards, and replay or dump prompt groups through the sample cache.
Details: docs/rollout_service.md.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch
from tensordict import TensorDict

from ppoflow.algorithms.scoring import combined_scores, has_scorer, score_one, solution_text
from ppoflow.configs import tool_config_file
from ppoflow.configs.cache_settings import entry_size_bound, run_cache_dir, storage_settings
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.stages import SAMPLE_CACHE_KEY
from ppoflow.storage.batch import concatenate, non_tensor_column, scores_on_last_tokens, with_non_tensor_columns
from ppoflow.storage.bounded import client_timeouts
from ppoflow.storage.fingerprints import model_identities
from ppoflow.storage.step_cache.sample_cache import SampleCache
from ppoflow.workers.models import load_tokenizer
from ppoflow.workers.rollout.sampling import SamplingParams, trajectory_seed
from ppoflow.workers.service.agent_loop import AgentSettings, load_agent_loop_config, make_loops, outputs_to_batch
from ppoflow.workers.service.gateway import Gateway
from ppoflow.workers.service.judge import Judge
from ppoflow.workers.service.openai_agent import agent_function
from ppoflow.workers.service.replicas import LoadBalancer
from ppoflow.workers.service.scorer_process import configured_scorer

logger = logging.getLogger("ppoflow.rollout")


class AgentLoopWorker:
    """Runs agent loops concurrently on one asyncio event loop (a Ray actor with no CPU of its own)."""

    def __init__(self, cfg: PPOConfig, replicas: list, *, judge_replicas: list = (), gateway_token: str | None = None):
        rollout = cfg.actor_rollout_ref.rollout
        self.tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        self.default_loop = rollout.agent.default_agent_loop
        if rollout.agent.agent_loop_config_path:
            load_agent_loop_config(rollout.agent.agent_loop_config_path)
        self.tools = None
        if rollout.multi_turn.tool_config_path:
            from ppoflow.workers.service.tool_config import load_tool_config
            from ppoflow.workers.service.tools import ToolRunner

            self.tools = ToolRunner(
                load_tool_config(tool_config_file(rollout.multi_turn.tool_config_path)),
                processes=rollout.multi_turn.tool_processes,
            )
        self.client = LoadBalancer(replicas, partial_rollout=cfg.trainer.v1.colocate_async.partial_rollout)
        self.custom_scorer = configured_scorer(cfg.custom_reward_function)  # user code: its own process
        judge, self.judge = cfg.reward_model.judge, None
        if judge.prompt_template is not None and judge_replicas:  # a judge model: its replicas, its tokenizer
            judges = LoadBalancer(list(judge_replicas))
            self.judge = Judge(judge, judges, self.tokenizer, load_tokenizer(cfg.judge_model))
        elif judge.prompt_template is not None:  # the policy judges, on its own replicas
            self.judge = Judge(judge, self.client, self.tokenizer)
        self.combine = cfg.reward_model.combine
        self.settings = AgentSettings(
            response_length=cfg.data.max_response_length,
            max_assistant_turns=rollout.multi_turn.max_assistant_turns,
            max_tokens_per_turn=rollout.multi_turn.max_tokens_per_turn,
            max_tool_response_length=rollout.multi_turn.max_tool_response_length,
            tool_format=rollout.multi_turn.format,
            agent_function=agent_function(cfg),
        )
        self.gateway = None
        if rollout.agent.gateway.enable:
            self.gateway = Gateway(
                self.client,
                self.tokenizer,
                self.settings,
                model_name=cfg.actor_rollout_ref.model.path.rstrip("/").rsplit("/", 1)[-1],
                host=rollout.agent.gateway.host,
                port=rollout.agent.gateway.port,
                api_key=gateway_token,
                template_kwargs=cfg.data.apply_chat_template_kwargs,
            )
        self.loops: dict = {}
        self.sample_cache = sample_cache(cfg)

    def loop(self, name: str):
        """The agent loop registered as ``name`` (one instance per worker, made on first use)."""
        if name not in self.loops:
            self.loops.update(
                make_loops(
                    {name},
                    client=self.client,
                    tokenizer=self.tokenizer,
                    settings=self.settings,
                    tools=self.tools,
                    gateway=self.gateway,
                )
            )
        return self.loops[name]

    async def gateway_url(self) -> str | None:
        """The base URL of this worker's gateway (started on first use), None when it is off."""
        return None if self.gateway is None else await self.gateway.start()

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
        if self.gateway is not None:  # served whenever enabled: agents of any loop may call it
            await self.gateway.start()
        rows = prompts.batch_size[0]
        names = _column(prompts, "agent_name") or [None] * rows
        tools_kwargs = _column(prompts, "tools_kwargs") or [None] * rows
        samples = _column(prompts, "sample_id") or [None] * rows
        sources, truths = _column(prompts, "data_source"), _column(prompts, "ground_truth")
        infos = _column(prompts, "extra_info") or [None] * rows
        raw_prompts = _column(prompts, "raw_prompt") or [None] * rows
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
                    extra_info=infos[row],
                    raw_prompt=raw_prompts[row],
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
        extra_info=None,
        raw_prompt=None,
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
                raw_prompt=raw_prompt,
                data_source=source,
                extra_info=extra_info,
            )
            prompt = repr(sample) if sample is not None else f"{position} of step {step}"
            runs.append(
                trajectory
                if source is None
                else self.scored(
                    trajectory,
                    source,
                    truth,
                    extra_info=extra_info,
                    sample=f"response {index} to prompt {prompt} (data source {source!r})",
                    judged=(prompt_ids, f"{session}/{index}", trajectory_seed(sampling.seed, step, position, ~index)),
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

    async def scored(
        self, trajectory, data_source: str, ground_truth, *, extra_info=None, sample: str, judged=None
    ) -> tuple:
        """The trajectory, and its score and extras, scored in a thread as soon as it finishes (a slow
        custom scorer does not hold up the event loop); ``sample`` names it in the scorer's messages. With a
        judge, its score (``judged``: the prompt's tokens, the session, the verdict's seed) is combined with the
        rule's as ``reward_model.combine`` says."""
        output = await trajectory
        solution = output.extra_fields.get("final_answer")  # an openai_agent's own answer
        if solution is None:
            solution = solution_text(output.response_ids, self.tokenizer)
        ruled = self.judge is None or has_scorer(data_source, self.custom_scorer)
        score, extras = (
            await asyncio.to_thread(
                score_one, data_source, solution, ground_truth, self.custom_scorer, sample=sample, extra_info=extra_info
            )
            if ruled
            else (0.0, {})
        )
        if self.judge is None:
            return output, (score, extras)
        prompt_ids, session, seed = judged
        judged_score, judge_extras = await self.judge.score(
            prompt_ids, solution, data_source, ground_truth, session=session, seed=seed, sample=sample,
            extra_info=extra_info,
        )  # fmt: skip
        (score,) = combined_scores([judged_score], {0: score} if ruled else {}, self.combine)
        return output, (score, {**extras, **judge_extras})


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
        models=model_identities(model.path, model.tokenizer_path or model.path, cfg.actor_rollout_ref.rollout.dtype),
        max_entry_bytes=entry_size_bound(cfg, prompts=1),
    )


def _column(batch: TensorDict, name: str) -> list | None:
    return non_tensor_column(batch, name) if name in batch.keys() else None
