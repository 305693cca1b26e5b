"""Padding-free forward passes, token-budget micro-batches and one-rank mixed precision (workers in process).

The reference is always the padded path with row-count micro-batches: the same tiny Llama (float32) gives the same
log-probs, values, losses and updated weights packed and cut by tokens, on a long-tailed batch (responses of 1 to
24 tokens, prompts of 1 to 8: up to the 32-token budget).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ppoflow.configs import ConfigError
from ppoflow.workers.training.critic import CriticWorker
from ppoflow.workers.training.data_parallel import DataParallel
from ppoflow.workers.training.learner import micro_batches, response_logits
from ppoflow.workers.training.packing import (
    karmarkar_karp,
    pack,
    response_positions,
    sequence_lengths,
    to_rows,
    token_budget_parts,
)
from ppoflow.workers.training.policy import ActorWorker
from tests.packing_helpers import FLOAT32, PACKED, PROMPT, RESPONSE, WEIGHTS, config, long_tailed_batch, updated

BUDGET = PROMPT + RESPONSE  # the smallest budget the config accepts
DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=true"]  # ref, rollout and critic follow (verl's interpolations)


@pytest.fixture
def batch() -> TensorDict:
    return long_tailed_batch(prompts=16)  # a prompt of its own in every row


def test_pack_lays_sequences_end_to_end_and_to_rows_puts_them_back():
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 0, 0]])  # P = 3, R = 3
    kept = torch.tensor([[False, True, True, True, True, False], [True, True, True, True, False, False]])
    positions = kept[:, 3:]
    ids, position_ids, index, mask = pack(input_ids, kept, (kept.cumsum(1) - 1).clamp(min=0), 3, positions)
    assert mask is None  # one sequence per unit: the position ids keep attention inside each
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]  # restarting per sequence
    # the outputs at 6 (predicting 7), 7 (predicting 8) and 11 (predicting 12)
    assert index.tolist() == [1, 2, 6] and ids[0, index + 1].tolist() == [7, 8, 12]
    assert to_rows(torch.tensor([1.0, 2.0, 3.0]), positions).tolist() == [[1, 2, 0], [3, 0, 0]]


def test_pack_in_rows_fills_them_first_fit_and_gives_each_remainder_a_block_of_its_own():
    input_ids = torch.tensor([[0, 0, 5, 6, 0, 0], [9, 10, 11, 12, 13, 0], [0, 1, 2, 3, 0, 0], [0, 0, 7, 8, 4, 0]])
    kept = input_ids != 0  # lengths 2, 5, 3, 3; rows of 5: [5], [3, 2], [3] (by decreasing length, first fit)
    positions = kept[:, 3:]
    ids, position_ids, index, _ = pack(input_ids, kept, (kept.cumsum(1) - 1).clamp(min=0), 3, positions, in_rows=True)
    assert ids.tolist() == [[9, 10, 11, 12, 13], [1, 2, 3, 5, 6], [7, 8, 4, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    # each index predicts a response token of its own sequence, in row-major order: 6 | 12, 13 | 3 | 8, 4
    assert ids.flatten()[index + 1].tolist() == [6, 12, 13, 3, 8, 4]


def test_karmarkar_karp_balances_and_the_budget_cut_fits_every_share():
    # differencing: 8-7 -> 1, 6-5 -> 1, then 4 against them: 16 and 14 (the heaviest group first; the optimum 15 / 15)
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    assert karmarkar_karp([3, 1], 3) == [[0], [1], []]
    lengths = [1, 1, 2, 1, 3, 9, 2, 1, 30, 1, 1, 2, 17, 1, 3, 32]
    (cut,) = token_budget_parts([lengths], 32)
    assert sorted(row for group in cut for row in group) == list(range(len(lengths)))
    assert max(sum(lengths[row] for row in group) for group in cut) <= 32 and len(cut) == 4  # 107 tokens: >= 4
    # two ranks' shares: as many micro-batches on each, the one needing most deciding
    short, long = token_budget_parts([[1, 2, 3], [32, 32, 5]], 32)
    assert len(short) == len(long) == 3 and all(short)
    with pytest.raises(ValueError, match="a sequence of 33 tokens exceeds the micro-batch token budget of 32"):
        token_budget_parts([[33]], 32)


@pytest.mark.parametrize("budget", [BUDGET, 2 * BUDGET])
def test_token_budget_micro_batches_hold_the_budget_and_every_row_once(batch, budget):
    cuts = list(micro_batches(batch, DataParallel(), size=None, max_tokens=budget))
    assert sorted(row for rows, _ in cuts for row in rows) == list(range(len(batch)))
    assert len(cuts) == -(-sum(sequence_lengths(batch)) // budget)  # this batch balances into the fewest parts
    for rows, micro in cuts:
        assert sum(sequence_lengths(micro)) <= budget
        assert torch.equal(micro["responses"], batch["responses"][rows][:, : micro["responses"].shape[1]])


def test_packed_attention_stays_inside_each_sequence(tiny_overrides, batch):
    """Changing the first sequence of a pack changes nothing of the others' log-probs; without the restart of the
    position ids (one long sequence) it would change them all (the test can fail)."""
    model = ActorWorker(config(tiny_overrides, *PACKED)).model.eval()
    changed = batch.clone()
    changed["prompts"][0] = torch.where(batch["prompt_mask"][0], 35 - batch["prompts"][0], 0)
    positions = response_positions(batch)
    with torch.no_grad():
        outputs = [to_rows(response_logits(model, rows, remove_padding=True), positions) for rows in (batch, changed)]
        assert not torch.allclose(outputs[0][0], outputs[1][0])  # the changed sequence itself
        torch.testing.assert_close(outputs[0][1:], outputs[1][1:], atol=1e-6, rtol=0)
        leaked = []
        for rows in (batch, changed):
            input_ids, kept = (
                torch.cat([rows["prompts"], rows["responses"]], 1),
                torch.cat([rows["prompt_mask"], positions], 1),
            )
            ids, _, index, _ = pack(input_ids, kept, kept.cumsum(1) - 1, PROMPT, positions)
            leaked.append(model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, index])
    assert not torch.allclose(leaked[0][positions[0].sum() :], leaked[1][positions[0].sum() :], atol=1e-3)


def test_packed_and_token_budget_log_probs_equal_the_padded_ones(tiny_overrides, batch):
    mask = batch["response_mask"]
    padded = ActorWorker(config(tiny_overrides)).compute_log_prob(batch)["log_probs"]
    for words in (PACKED, DYNAMIC, PACKED + DYNAMIC):
        actor = ActorWorker(
            config(tiny_overrides, *words, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}")
        )
        log_probs = actor.compute_log_prob(batch)["log_probs"]  # in the batch's row order, however it was cut
        torch.testing.assert_close(log_probs[mask], padded[mask], **FLOAT32)
        assert (log_probs[~mask] == 0).all()


def test_packed_and_token_budget_values_equal_the_padded_ones(tiny_overrides, batch):
    padded = CriticWorker(config(tiny_overrides)).compute_values(batch)["values"]
    for words in (PACKED, ["critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={BUDGET}", *PACKED]):
        values = CriticWorker(config(tiny_overrides, *words)).compute_values(batch)["values"]
        torch.testing.assert_close(values, padded, **FLOAT32)


def test_packed_token_budget_updates_equal_the_padded_row_count_ones(tiny_overrides, batch):
    """The actor on-policy (its own log-probs come back in row order) and the critic: the same metrics and weights
    from the padded path in micro-batches of 4 rows as packed in micro-batches of at most 32 tokens."""
    rows = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
    budget = [*PACKED, *DYNAMIC, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}"]
    budget += [f"critic.ppo_max_token_len_per_gpu={BUDGET}"]
    results = []
    for words in (rows, budget):
        cfg = config(tiny_overrides, *words)
        actor, actor_weights = updated(ActorWorker(cfg), batch.exclude("values", "returns"))
        critic_metrics, critic_weights = updated(CriticWorker(cfg), batch)
        results.append((actor, actor_weights, critic_metrics, critic_weights))
    (actor_a, weights_a, critic_a, critic_weights_a), (actor_b, weights_b, critic_b, critic_weights_b) = results
    mask = batch["response_mask"]
    own = actor_a.fields["old_log_probs"], actor_b.fields["old_log_probs"]
    torch.testing.assert_close(own[1][mask], own[0][mask], **FLOAT32)
    for name, value in {**actor_a.metrics, **critic_a}.items():
        assert {**actor_b.metrics, **critic_b}[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for expected, got in ((weights_a, weights_b), (critic_weights_a, critic_weights_b)):
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, **WEIGHTS)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_normalisation_does_not_depend_on_the_cut(tiny_overrides, batch, mode):
    """Two mini-batches of 8 rows each (two optimizer steps): whole, or cut by 32 or 64 tokens, packed or not, the
    losses and weights are the same (each micro-batch is normalised by its whole mini-batch)."""
    base = [f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    cuts = [[], [*DYNAMIC, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}"]]
    cuts += [[*PACKED, *DYNAMIC, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={2 * BUDGET}"]]
    trainable = batch.exclude("values", "returns")
    trainable["old_log_probs"] = ActorWorker(config(tiny_overrides)).compute_log_prob(batch)["log_probs"] + 0.05
    results = [updated(ActorWorker(config(tiny_overrides, *base, *words)), trainable) for words in cuts]
    (expected, expected_weights), others = results[0], results[1:]
    assert expected.metrics["actor/optimizer_steps"] == 2
    for result, weights in others:
        for name in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
            assert result.metrics[name] == pytest.approx(expected.metrics[name], rel=1e-4, abs=1e-6), name
        for name, tensor in expected_weights.items():
            torch.testing.assert_close(weights[name], tensor, **WEIGHTS)


@pytest.mark.parametrize(
    "words, keys",
    [
        (  # the rollout's log-prob budget interpolates the actor's, and is as short
            DYNAMIC + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=31"],
            [
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            ],
        ),
        (
            ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=16"],
            ["critic.forward_max_token_len_per_gpu"],
        ),
    ],
)
def test_a_budget_shorter_than_the_longest_sequence_is_a_config_error(tiny_overrides, words, keys):
    with pytest.raises(ConfigError) as caught:
        config(tiny_overrides, *words)
    problems = dict(caught.value.problems)
    assert [key for key in problems if "max_token_len" in key] == keys
    for key in keys:
        assert problems[key].startswith("31 tokens" if "actor" in key else "16 tokens")
        assert "data.max_prompt_length + data.max_response_length = 32 tokens" in problems[key]


def test_bf16_compute_at_one_rank_keeps_float32_weights_and_optimizer_state(tiny_overrides, batch):
    """``param_dtype=bfloat16`` at one rank: forward and backward under autocast, weights, gradients and AdamW
    moments in float32. Tolerances for bf16's 8-bit mantissa: log-probs within 1e-2 (measured 1.5e-3), losses within
    0.5% (3e-4), the step's direction within cosine 0.98 of float32's (0.996)."""
    trainable = batch.exclude("values", "returns")
    trainable["old_log_probs"] = ActorWorker(config(tiny_overrides)).compute_log_prob(batch)["log_probs"] + 0.05
    workers = {}
    for name, words in (
        ("fp32", []),
        ("bf16", ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bfloat16"]),
    ):
        workers[name] = ActorWorker(config(tiny_overrides, *PACKED, *words))
    assert (workers["fp32"].compute_dtype, workers["bf16"].compute_dtype) == (None, torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in workers["fp32"].model.state_dict().items()}
    mask = batch["response_mask"]
    log_probs = {name: worker.compute_log_prob(batch)["log_probs"] for name, worker in workers.items()}
    assert not torch.equal(log_probs["bf16"], log_probs["fp32"])  # autocast did act
    torch.testing.assert_close(log_probs["bf16"][mask], log_probs["fp32"][mask], atol=1e-2, rtol=1e-2)
    results = {name: updated(worker, trainable) for name, worker in workers.items()}
    (fp32, fp32_weights), (bf16, bf16_weights) = results["fp32"], results["bf16"]
    assert bf16.metrics["actor/pg_loss"] != fp32.metrics["actor/pg_loss"]
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert bf16.metrics[name] == pytest.approx(fp32.metrics[name], rel=5e-3, abs=1e-4), name
    worker = workers["bf16"]
    assert {parameter.dtype for parameter in worker.model.parameters()} == {torch.float32}
    moments = [state[key] for state in worker.learner.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert moments and {moment.dtype for moment in moments} == {torch.float32}
    # the step: each weight's move from bf16 gradients points as float32's does
    moves = [(bf16_weights[name] - tensor).flatten() for name, tensor in before.items()]
    reference = [(fp32_weights[name] - tensor).flatten() for name, tensor in before.items()]
    cosine = torch.nn.functional.cosine_similarity(torch.cat(moves), torch.cat(reference), dim=0)
    assert cosine > 0.98, cosine


def test_a_tool_answer_inside_a_response_is_context_packed_as_padded(tiny_overrides, batch):
    """Multi-turn: row 15's response is 10 model tokens, a 5-token tool answer (out of response_mask) and 9 model
    tokens; both paths feed the answer to the model (as the rollout did), so changing it moves the second turn's
    log-probs, and packed equals padded."""
    turn_ids = batch["response_mask"].long()
    turn_ids[15] = torch.tensor([1] * 10 + [-1] * 5 + [2] * 9)
    batch["turn_ids"], batch["response_mask"] = turn_ids, turn_ids > 0
    changed = batch.clone()
    changed["responses"][15, 10:15] = 35 - batch["responses"][15, 10:15]
    mask = batch["response_mask"]
    results = []
    for words in ([], PACKED):
        actor = ActorWorker(config(tiny_overrides, *words))
        results.append([actor.compute_log_prob(rows)["log_probs"] for rows in (batch, changed)])
    (padded, padded_changed), (packed, packed_changed) = results
    torch.testing.assert_close(packed[mask], padded[mask], **FLOAT32)
    torch.testing.assert_close(packed_changed[mask], padded_changed[mask], **FLOAT32)
    torch.testing.assert_close(padded_changed[15, :10], padded[15, :10], **FLOAT32)  # before the answer: the same
    # after it: moved, beyond the first token (whose logits come from the answer's last position in any case)
    assert (padded_changed[15, 16:] - padded[15, 16:]).abs().min() > 1e-4


@pytest.mark.parametrize("device, remove_padding, cudnn_after", [("cuda", False, False), ("cuda", True, True),
                                                                  ("cpu", False, True)])  # fmt: skip
def test_a_padded_gpu_worker_keeps_attention_off_cudnn(device, remove_padding, cudnn_after):
    """cuDNN's SDPA gave NaN bf16 gradients for left padding's unattended rows on an H200: a GPU worker on the padded
    path turns that backend off for its process; packed passes and CPU workers leave it as it is."""
    from ppoflow.workers.models import keep_attention_off_cudnn_if_padded

    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        keep_attention_off_cudnn_if_padded(torch.device(device), remove_padding)
        assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_after
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
