"""A GRPO group's samples packed behind one copy of their prompt (``use_remove_padding`` under sdpa and eager):
each response attends to the prompt and to itself only, so log-probs, values and updates equal the padded path's
within float32 rounding while the prompt's tokens are computed once."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ppoflow.workers.training import packing
from ppoflow.workers.training.critic import CriticWorker
from ppoflow.workers.training.data_parallel import DataParallel
from ppoflow.workers.training.learner import attention_pair_weight, micro_batches, response_logits, sequence_inputs
from ppoflow.workers.training.packing import pack, prompt_groups, response_positions, sharing_pays, to_rows
from ppoflow.workers.training.policy import ActorWorker
from tests.packing_helpers import FLOAT32, PACKED, PROMPT, RESPONSE, config, long_tailed_batch, updated

SAMPLES = 4
BUDGET = PROMPT + RESPONSE  # the smallest budget the config accepts
DYNAMIC = [*PACKED, "actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true"]
DYNAMIC += [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}", f"critic.ppo_max_token_len_per_gpu={BUDGET}"]


@pytest.fixture
def groups_batch() -> TensorDict:
    return long_tailed_batch(prompts=SAMPLES)  # 4 prompts x 4 samples, the groups' rows interleaved


def test_a_groups_rows_share_one_copy_of_its_prompt():
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [4, 3, 2, 1, 0]])  # P = 3, R = 2
    kept = input_ids != 0
    groups = torch.tensor([0, 0, 1])
    positions = kept[:, 3:]
    ids, position_ids, index, mask = pack(
        input_ids, kept, (kept.cumsum(1) - 1).clamp(min=0), 3, positions, in_rows=True, groups=groups
    )
    assert ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 1, 0]]  # rows of the longest unit: 2 + 2 + 1 tokens
    assert position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 0]]  # 9 sits where it would alone: after 6
    assert index.tolist() == [1, 2, 1, 7]  # 6 predicts 7 and 9, 7 predicts 8, 2 (slot 7) predicts 1
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].long().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # 9 sees its prompt, not its sibling's 7 and 8
    ]
    assert mask[1, 0, 4].long().tolist() == [0, 0, 0, 0, 1]  # the row's unused slot sees only itself


def test_prompt_groups_follow_the_prompt_tokens_and_their_padding(groups_batch):
    assert prompt_groups(groups_batch).view(SAMPLES, 4).unique(dim=0).shape == (1, 4)  # row i: prompt i % 4
    shifted = groups_batch.clone()
    shifted["prompt_mask"][1, 0] = True  # the same ids, a pad counted as a token: another prompt
    assert len(prompt_groups(shifted).unique()) == 5


def test_sharing_pays_until_attention_over_the_responses_outweighs_the_prompts_saved(groups_batch):
    _, kept, _ = sequence_inputs(groups_batch)
    groups = prompt_groups(groups_batch)
    assert sharing_pays(kept, PROMPT, groups, pair_weight=1e-4)
    assert not sharing_pays(kept, PROMPT, torch.arange(len(kept)), pair_weight=1e-4)  # no prompt repeats
    # one-token prompts, 24-token responses: 4 rows of 97 against 16 of 25 tokens
    long_answers = torch.ones(16, 1 + RESPONSE, dtype=torch.bool)
    assert sharing_pays(long_answers, 1, groups, pair_weight=1e-4)  # 4 x 97 x 1.01 against 16 x 25 x 1.00
    assert not sharing_pays(long_answers, 1, groups, pair_weight=1e-2)  # 4 x 97 x 1.97 against 16 x 25 x 1.25


def test_a_token_budget_keeps_a_groups_rows_together_where_they_fit(groups_batch):
    # rows 0, 2, 3 share a prompt: 0 and 2 fit in 12 tokens, 3 starts a chunk of its own
    assert packing.budget_items([0, 1, 2, 3], [5, 5, 5, 5], torch.tensor([0, 1, 0, 0]), 12) == [[0, 2], [3], [1]]
    assert packing.budget_items([0, 1], [5, 5], None, 12) == [[0], [1]]
    groups = prompt_groups(groups_batch)
    cuts = list(micro_batches(groups_batch, DataParallel(), size=None, max_tokens=BUDGET, keep_together=groups))
    assert sorted(row for rows, _ in cuts for row in rows) == list(range(len(groups_batch)))
    assert all(sum(packing.sequence_lengths(micro)) <= BUDGET for _, micro in cuts)
    for group in (1, 2):  # prompts of 3 and 1 tokens: 16 and 12 tokens for the four samples, one micro-batch each
        members = set((groups == groups[group]).nonzero().flatten().tolist())
        assert sum(members <= set(rows) for rows, _ in cuts) == 1


@pytest.mark.parametrize("words", [PACKED, DYNAMIC], ids=["rows", "token budget"])
def test_shared_prompt_log_probs_and_values_equal_the_padded_ones(tiny_overrides, groups_batch, words):
    mask = groups_batch["response_mask"]
    actor = ActorWorker(config(tiny_overrides, *words))
    _, kept, _ = sequence_inputs(groups_batch)
    assert sharing_pays(kept, PROMPT, prompt_groups(groups_batch), attention_pair_weight(actor.model))
    padded = ActorWorker(config(tiny_overrides)).compute_log_prob(groups_batch)["log_probs"]
    torch.testing.assert_close(actor.compute_log_prob(groups_batch)["log_probs"][mask], padded[mask], **FLOAT32)
    values = CriticWorker(config(tiny_overrides)).compute_values(groups_batch)["values"]
    shared = CriticWorker(config(tiny_overrides, *words)).compute_values(groups_batch)["values"]
    torch.testing.assert_close(shared, values, **FLOAT32)


def test_a_sample_changes_none_of_its_siblings_log_probs(tiny_overrides, groups_batch):
    """The test can fail: under a plain causal mask over the unit, the siblings after the changed sample would
    read its tokens."""
    model = ActorWorker(config(tiny_overrides, *PACKED)).model.eval()
    changed = groups_batch.clone()
    changed["responses"][0] = torch.where(groups_batch["response_mask"][0], 35 - groups_batch["responses"][0], 0)
    positions = response_positions(groups_batch)
    with torch.no_grad():
        outputs = [
            to_rows(response_logits(model, rows, remove_padding=True), positions) for rows in (groups_batch, changed)
        ]
        torch.testing.assert_close(outputs[0][1:], outputs[1][1:], atol=1e-6, rtol=0)
        input_ids, kept, position_ids = sequence_inputs(changed)
        groups = prompt_groups(changed)
        ids, packed_positions, index, mask = pack(
            input_ids, kept, position_ids, PROMPT, positions, in_rows=True, groups=groups
        )
        causal = torch.ones_like(mask).tril()  # the unit as one sequence
        leaked = model(input_ids=ids, position_ids=packed_positions, attention_mask=causal).logits.flatten(0, 1)
    assert not torch.allclose(to_rows(leaked[index], positions)[1:], outputs[1][1:], atol=1e-3)


@pytest.mark.parametrize("attention, packed", [("sdpa", PACKED), ("eager", PACKED), ("sdpa", DYNAMIC)])
def test_shared_prompt_updates_equal_the_padded_ones(tiny_overrides, groups_batch, attention, packed):
    """The actor on-policy and the critic: the same metrics and weights from padded rows as from shared prompts,
    in one micro-batch or cut by a token budget. Weights within 5% of AdamW's first step (lr = 1e-3): a weight
    whose gradient is near AdamW's eps (1e-8) moves by lr x g / (|g| + eps), where the rounding of another
    summation order shows (2.66e-9 against 2.35e-9 moved one weight by 2e-5 with the token budget)."""
    results = []
    for words in ([], packed):
        cfg = config(tiny_overrides, *words)
        actor, critic = ActorWorker(cfg), CriticWorker(cfg)
        for model in (actor.model, critic.model):
            model.config._attn_implementation = attention
        results.append([updated(actor, groups_batch.exclude("values", "returns")), updated(critic, groups_batch)])
    for (expected, expected_weights), (got, got_weights) in zip(*results):
        expected, got = getattr(expected, "metrics", expected), getattr(got, "metrics", got)  # actor, critic
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        for name, tensor in expected_weights.items():
            torch.testing.assert_close(got_weights[name], tensor, atol=5e-5, rtol=1e-4)
