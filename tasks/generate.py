"""Stage 1, generate: sample ``rollout.n`` responses per prompt on the rollout worker."""

from __future__ import annotations

import logging

from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.configs.stages import SAMPLE_CACHE_KEY
from ppoflow.storage.batch import AGENT_FIELDS, NON_TENSOR_FIELDS, StageResult, non_tensor_column
from ppoflow.tasks.reward import extra_means, unless_a_scorer_failed
from ppoflow.tasks.task_inputs import recorded_task
from ppoflow.workers.rollout.sampling import SamplingParams

logger = logging.getLogger("ppoflow.rollout")
"""The rollout's records: inside a run they reach the logs of the task run that logged them."""


@recorded_task(
    name="generate", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1, retry_condition_fn=unless_a_scorer_failed
)
def generate(
    workers, prompts: TensorDict, step: int, sampling: SamplingParams, keep_extras: bool = False
) -> StageResult:
    """The rollout part of the step batch (see ``storage.batch``) for one prompt batch.

    Only tensors travel to the rollout worker - and, to a rollout that scores trajectories as they
    finish (``workers.streams_reward``), each prompt's data source and ground truth; the per-prompt columns
    are repeated onto the prompt's ``n`` responses here. Retried: a rollout worker that died
    mid-generation is restarted by Ray, and the flow re-syncs its weights; a custom scorer's failure (in a
    rollout that scores) is not retried. ``keep_extras`` (validation) keeps such a rollout's ``reward_extras``.
    """
    sent = prompts.exclude("uid") if workers.streams_reward else prompts.exclude(*NON_TENSOR_FIELDS)
    rollout = workers.rollout.generate(sent, step=step, sampling=sampling)
    extras = rollout.get("reward_extras") if keep_extras and "reward_extras" in rollout.keys() else None
    rollout, metrics = rollout_metrics(rollout)
    if extras is not None:
        rollout.set("reward_extras", extras)
    return StageResult(rollout.update(prompts.select(*NON_TENSOR_FIELDS)[rollout["group_index"]]), metrics)


def rollout_metrics(rollout: TensorDict) -> tuple[TensorDict, dict[str, float]]:
    """What the rollout service reported beside the trajectories, as metrics - the agent loops' turns, tool
    calls and failures, the scorer's extras (scored while generating), the sample cache's outcomes - and
    the rollout without those columns. The agent loops' summary is logged, on the task run that asked."""
    metrics = {}
    if "tool_errors" in rollout.keys():  # the rollout service: agent loops, maybe with tools
        metrics = agent_metrics(rollout, non_tensor_column(rollout, "tool_errors"))
        logger.info(agent_summary(rollout, metrics, scored="token_level_scores" in rollout.keys()))
    if "reward_extras" in rollout.keys():  # scored while generating: the reward stage's metrics, here
        extras: dict[str, list[float]] = {}
        for trajectory in non_tensor_column(rollout, "reward_extras"):
            for name, value in trajectory.items():
                extras.setdefault(name, []).append(value)
        metrics.update(extra_means(extras))
    if "sample_cache" in rollout.keys():  # the rollout service's per-sample cache (skip.async_rollout)
        metrics.update(sample_cache_metrics(non_tensor_column(rollout, "sample_cache")))
    return rollout.exclude(*AGENT_FIELDS, "tool_errors", "reward_extras", "sample_cache"), metrics


def sample_cache_metrics(outcomes: list[str]) -> dict[str, float]:
    """``skip/async_rollout/hit``: the share of the step's trajectories replayed from the sample cache; the
    ``read_failed`` and ``dump_failed`` shares say how often its storage failed (the samples were
    generated, and not recorded)."""
    return {
        f"skip/{SAMPLE_CACHE_KEY}/{outcome}": outcomes.count(outcome) / len(outcomes)
        for outcome in ("hit", "read_failed", "dump_failed")
    }


def agent_metrics(rollout: TensorDict, tool_errors: list[list[str]]) -> dict[str, float]:
    """How the agent loops went: turns, tool calls and failed tool calls per trajectory; failures are
    logged (they reach the flow run's logs) since a failing tool quietly teaches the model to avoid it."""
    failed = sum(len(errors) for errors in tool_errors)
    if failed:
        examples = sorted({message for errors in tool_errors for message in errors})[:3]
        logger.warning("%d tool call(s) failed in this batch, e.g. %s", failed, "; ".join(examples))
    calls = rollout["tool_calls"].float()
    return {
        "agent/num_turns/mean": float(rollout["num_turns"].float().mean()),
        "agent/num_turns/max": float(rollout["num_turns"].max()),
        "agent/tool_calls/mean": float(calls.mean()),
        "agent/tool_call_ratio": float((calls > 0).float().mean()),
        "agent/tool_errors/count": float(failed),
    }


def agent_summary(rollout: TensorDict, metrics: dict[str, float], *, scored: bool) -> str:
    """One line on how the batch's agent loops went (``metrics``: their :func:`agent_metrics`) -
    trajectories, turns, tool calls and failures - and, when the rollout service scored them
    (``scored``), why the step has no reward task."""
    calls = rollout["tool_calls"]
    line = (
        f"{len(calls)} trajectories: {metrics['agent/num_turns/mean']:.2f} turns on average (at most "
        f"{metrics['agent/num_turns/max']:.0f}), {int(calls.sum())} tool call(s) in {int((calls > 0).sum())} "
        f"of them, {metrics['agent/tool_errors/count']:.0f} failed"
    )
    if scored:
        line += "; rewards scored in the rollout service as each trajectory finished, so there is no reward task"
    return line
