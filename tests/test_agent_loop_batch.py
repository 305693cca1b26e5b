"""Multi-turn batches from agent loops: the padded batch, every loss, KL and advantage ignoring the tools'
tokens, the per-batch agent metrics and log line, and a tool run's generate task through Prefect."""

from __future__ import annotations

import pytest
import torch

from ppoflow.algorithms.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage
from ppoflow.algorithms.kl import kl_penalty
from ppoflow.algorithms.losses import agg_loss
from ppoflow.algorithms.policy_losses import compute_policy_loss
from ppoflow.storage.batch import last_model_token, response_extent, trim_response_padding
from ppoflow.workers.service.agent_loop import AgentLoopOutput, outputs_to_batch
from tests.agent_loop_helpers import multi_turn_outputs


def test_outputs_pad_into_a_multi_turn_batch():
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    assert batch["prompts"].tolist() == [[7, 8], [0, 9]] and batch["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["responses"][0].tolist() == [10, 11, 20, 21, 12, 2, 0, 0]
    assert batch["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert batch["turn_ids"][0].tolist() == [1, 1, -1, -1, 2, 2, 0, 0]
    assert batch["weight_version"].tolist() == [4, 5]  # a trajectory's oldest weights
    assert batch["num_turns"].tolist() == [3, 1] and batch["tool_calls"].tolist() == [1, 0]
    assert response_extent(batch).tolist() == [6, 2] and last_model_token(batch["response_mask"]).tolist() == [5, 1]
    assert trim_response_padding(batch)["responses"].shape[1] == 6
    with pytest.raises(ValueError, match="9 response tokens > 8"):
        outputs_to_batch(
            [AgentLoopOutput([1], [3] * 9, [1] * 9, [0.0] * 9, [1] * 9, 1)],
            prompt_width=1,
            response_width=8,
            pad_token_id=0,
            weight_version=0,
        )


def test_losses_kl_and_advantages_ignore_the_tools_tokens():
    """Whatever the log-probs, advantages or values say at the tool's positions, nothing changes."""
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    mask = batch["response_mask"]
    tool = batch["turn_ids"] < 0
    torch.manual_seed(0)
    old, new, ref = (torch.randn(2, 8) for _ in range(3))
    advantages, values = torch.randn(2, 8), torch.randn(2, 8)
    rewards = torch.zeros(2, 8)
    rewards[0, 5], rewards[1, 1] = 1.0, 0.5
    noise = torch.where(tool, torch.full((2, 8), 100.0), torch.zeros(2, 8))

    def everything(old, new, ref, advantages, values):
        loss, _ = compute_policy_loss(
            old,
            new,
            advantages,
            mask,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=3.0,
            loss_agg_mode="token-mean",
        )
        kl = agg_loss(kl_penalty(new, ref, "low_var_kl"), mask, "token-mean")
        gae, returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
        grpo, _ = compute_grpo_outcome_advantage(rewards, mask, torch.tensor([0, 0]))
        return loss, kl, gae * mask, returns * mask, grpo * mask

    clean = everything(old, new, ref, advantages, values)
    noisy = everything(old + noise, new - noise, ref + noise, advantages + noise, values + noise)
    for a, b in zip(clean, noisy):
        torch.testing.assert_close(a, b)
    # GAE bridges the tool's answer: the same advantages as the trajectory with the tool's tokens cut out
    gae, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.95)
    kept = [0, 1, 4, 5, 6, 7, 2, 3]  # row 0 without its tool tokens (moved to the padding's end, masked)
    cut, _ = compute_gae_advantage_return(
        torch.stack([rewards[0, kept], rewards[1]]),
        torch.stack([values[0, kept], values[1]]),
        torch.stack([mask[0, kept], mask[1]]),
        gamma=0.9,
        lam=0.95,
    )
    torch.testing.assert_close(gae[0, [0, 1, 4, 5]], cut[0, :4])


def test_failed_tool_calls_are_counted_and_logged_for_the_run(caplog):
    from ppoflow.tasks.generate import agent_metrics

    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    import logging

    rollout_logger = logging.getLogger("ppoflow.rollout")  # the ppoflow loggers may not propagate to the root
    rollout_logger.addHandler(caplog.handler)
    try:
        metrics = agent_metrics(batch, [["vault: error: timed out"], []])
    finally:
        rollout_logger.removeHandler(caplog.handler)
    assert metrics["agent/tool_errors/count"] == 1 and metrics["agent/tool_call_ratio"] == 0.5
    assert metrics["agent/num_turns/max"] == 3 and metrics["agent/tool_calls/mean"] == 0.5
    assert "1 tool call(s) failed in this batch, e.g. vault: error: timed out" in caplog.text


def test_a_batchs_agent_loops_are_summed_up_in_one_line(caplog):
    import logging

    from ppoflow.storage.batch import with_non_tensor_columns
    from ppoflow.tasks.generate import rollout_metrics

    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    batch = with_non_tensor_columns(batch, {"tool_errors": [["vault: error: timed out"], []]})
    batch["token_level_scores"] = torch.zeros(2, 8)  # scored in the rollout service
    rollout_logger = logging.getLogger("ppoflow.rollout")
    rollout_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ppoflow.rollout"):
            rollout, _ = rollout_metrics(batch)
    finally:
        rollout_logger.removeHandler(caplog.handler)
    assert "tool_errors" not in rollout.keys()
    assert (
        "2 trajectories: 2.00 turns on average (at most 3), 1 tool call(s) in 1 of them, 1 failed; rewards "
        "scored in the rollout service as each trajectory finished, so there is no reward task"
    ) in caplog.text


@pytest.mark.slow  # a tool run read back from the server (~35 s)
def test_a_tool_runs_generate_task_logs_its_turns_and_the_table_shows_them(
    prefect_api, ray_local, tiny_model, tmp_path
):
    """One step of the vault preset through Prefect: the generate task run's logs sum up its agent loops
    and say why there is no reward task; the metrics artifact has the agent columns."""
    import json
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterTaskRunId

    from ppoflow.flows.train import ppo_train
    from tests.conftest import drain_prefect_logs
    from tests.flow_runs import task_runs_by_name

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=16",
        "data.synthetic.copy_share=0",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
    ]
    state = ppo_train(config="vault_tool", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    generate = task_runs_by_name(flow_run_id, ["generate[step=1]"])["generate[step=1]"]
    drain_prefect_logs()
    with get_client(sync_client=True) as client:
        for _ in range(60):  # the logs reach the server in batches
            log = "\n".join(
                record.message
                for record in client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[generate.id])))
            )
            if "16 trajectories:" in log:
                break
            time.sleep(0.5)
    assert "16 trajectories:" in log and "turns on average" in log and "tool call(s) in" in log, log
    assert "rewards scored in the rollout service" in log
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    [table] = [json.loads(artifact.data) for artifact in artifacts if artifact.key.endswith("-metrics")]
    assert {"turns", "tool_calls", "tool_errors", "staleness", "gen_s", "update_actor_s"} <= set(table[0]), table[0]
    assert table[0]["turns"] >= 1 and table[0]["tool_errors"] == 0
