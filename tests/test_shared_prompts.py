"""A GRPO group's samples packed behind one copy of their prompt (``use_remove_padding`` under sdpa and eager):
each response attends to the prompt and to itself only, so log-probs, values and updates equal the padded path's
within float32 rounding while the prompt's tokens are computed once."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ppoflow.workers.training.critic import CriticWorker
from ppoflow.workers.training.learner import attention_pair_weight, response_logits, sequence_inputs
from ppoflow.workers.training.packing import pack, prompt_groups, response_positions, sharing_pays, to_rows
from ppoflow.workers.training.policy import ActorWorker
from tests.packing_helpers import FLOAT32, PACKED, PROMPT, RESPONSE, WEIGHTS, config, long_tailed_batch, updated

SAMPLES = 4


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


def test_shared_prompt_log_probs_and_values_equal_the_padded_ones(tiny_overrides, groups_batch):
    mask = groups_batch["response_mask"]
    actor = ActorWorker(config(tiny_overrides, *PACKED))
    _, kept, _ = sequence_inputs(groups_batch)
    assert sharing_pays(kept, PROMPT, prompt_groups(groups_batch), attention_pair_weight(actor.model))
    padded = ActorWorker(config(tiny_overrides)).compute_log_prob(groups_batch)["log_probs"]
    torch.testing.assert_close(actor.compute_log_prob(groups_batch)["log_probs"][mask], padded[mask], **FLOAT32)
    values = CriticWorker(config(tiny_overrides)).compute_values(groups_batch)["values"]
    shared = CriticWorker(config(tiny_overrides, *PACKED)).compute_values(groups_batch)["values"]
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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_updates_equal_the_padded_ones(tiny_overrides, groups_batch, attention):
    """The actor on-policy and the critic: the same metrics and weights from padded rows as from shared prompts."""
    results = []
    for words in ([], PACKED):
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
            torch.testing.assert_close(got_weights[name], tensor, **WEIGHTS)
