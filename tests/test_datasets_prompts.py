"""data/datasets.py: tokenized prompts (chat templates, overlong prompts, the padded batch) and the prompt loader."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ppoflow.data.datasets import PromptDataset, PromptLoader, load_prompt_dataset, read_prompt_rows, write_rows
from ppoflow.storage.batch import non_tensor_column
from tests.conftest import model_config
from tests.datasets_helpers import chat_row, data_config, only_problem

# The tiny character tokenizer (workers/models.py): <pad>=0 <s>=1 </s>=2 <unk>=3, then one id per
# character of "0123456789+-=>:,|?abcdefghij" from 4: digit d -> 4 + d, '>' -> 17, ':' -> 18, '|' -> 20, 'a' -> 22.


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from ppoflow.workers.models import load_tokenizer

    return load_tokenizer(model_config(tiny_model))


# --------------------------------------------------------------------------- tokenized prompts


def test_prompt_batches_carry_the_agent_columns_only_when_the_dataset_has_them(tmp_path, tokenizer):
    rows = [
        chat_row("60>", "60"),
        {**chat_row("=61>", "61"), "agent_name": "single_turn_agent"},
        {**chat_row("62>", "19"), "extra_info": {"tools_kwargs": {"vault": {"key": "62"}}}},
    ]
    write_rows(str(tmp_path / "agents.jsonl"), rows)
    dataset = load_prompt_dataset(str(tmp_path / "agents.jsonl"), data_config(), tokenizer, key="data.train_files")
    assert dataset.agent_names == [None, "single_turn_agent", None]
    assert dataset.tools_kwargs == [None, None, {"vault": {"key": "62"}}]
    batch = dataset.batch([2, 1], ["a", "b"], pad_token_id=0)
    assert non_tensor_column(batch, "agent_name") == [None, "single_turn_agent"]
    assert non_tensor_column(batch, "tools_kwargs") == [{"vault": {"key": "62"}}, None]
    write_rows(str(tmp_path / "plain.jsonl"), rows[:1])
    plain = load_prompt_dataset(str(tmp_path / "plain.jsonl"), data_config(), tokenizer, key="data.train_files")
    assert not {"agent_name", "tools_kwargs"} & set(plain.batch([0], ["a"], pad_token_id=0).keys())


def test_load_prompt_dataset_chat_and_plain_prompts(tmp_path, tokenizer):
    rows = [
        chat_row("60>", "60"),
        {"data_source": "plain", "prompt": "12>", "reward_model": {"ground_truth": ["a", 1]}},
        {
            "data_source": "multi",
            "prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": "8>"}],
            "reward_model": {"style": "rule"},
        },
    ]
    write_rows(str(tmp_path / "p.jsonl"), rows)
    dataset = load_prompt_dataset(str(tmp_path / "p.jsonl"), data_config(), tokenizer, key="data.train_files")
    assert dataset.prompt_ids == [[10, 4, 17], [5, 6, 17], [13, 12, 17]]
    assert dataset.data_sources == ["synthetic/copy", "plain", "multi"]
    assert dataset.ground_truths == ["60", ["a", 1], None]
    assert dataset.row_indices == [0, 1, 2]
    assert len(dataset) == 3


def test_chat_messages_go_through_the_chat_template(tmp_path, tiny_model):
    from ppoflow.workers.models import load_tokenizer

    tokenizer = load_tokenizer(model_config(tiny_model))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    write_rows(str(tmp_path / "p.jsonl"), [chat_row("12", "12"), {**chat_row("", "3"), "prompt": "3>"}])
    dataset = load_prompt_dataset(str(tmp_path / "p.jsonl"), data_config(), tokenizer, key="data.train_files")
    # "12" -> "12|" + generation prompt "a:"; the plain string is not templated
    assert dataset.prompt_ids == [[5, 6, 20, 22, 18], [7, 17]]

    tokenizer.chat_template = None
    assert only_problem(
        load_prompt_dataset, str(tmp_path / "p.jsonl"), data_config(), tokenizer, key="data.train_files"
    ) == ("data.train_files", "row 0: the prompt is a list of chat messages but the tokenizer has no chat_template")


def test_prompt_key_and_missing_columns(tmp_path, tokenizer):
    write_rows(
        str(tmp_path / "q.jsonl"), [{"data_source": "s", "question": "1>", "reward_model": {"ground_truth": "1"}}]
    )
    dataset = load_prompt_dataset(str(tmp_path / "q.jsonl"), data_config(prompt_key="question"), tokenizer, key="k")
    assert dataset.prompt_ids == [[5, 17]]

    assert only_problem(read_prompt_rows, str(tmp_path / "q.jsonl"), data_config(), key="data.val_files") == (
        "data.val_files",
        "row 0 has no 'prompt' value (columns: ['data_source', 'question', 'reward_model'])",
    )

    write_rows(str(tmp_path / "m.jsonl"), [chat_row("1>", "1"), {"prompt": "2>", "reward_model": {}}])
    assert only_problem(
        load_prompt_dataset, str(tmp_path / "m.jsonl"), data_config(), tokenizer, key="data.train_files"
    ) == ("data.train_files", "row 1 has no 'data_source' value (columns: ['prompt', 'reward_model'])")

    write_rows(str(tmp_path / "null.jsonl"), [{"data_source": "s", "prompt": "1>", "reward_model": "1"}])
    assert only_problem(read_prompt_rows, str(tmp_path / "null.jsonl"), data_config(), key="data.train_files") == (
        "data.train_files",
        "row 0 reward_model must be a mapping with ground_truth, got '1'",
    )

    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert only_problem(read_prompt_rows, str(tmp_path / "list.jsonl"), data_config(), key="data.train_files") == (
        "data.train_files",
        "row 0 is not a mapping of columns, got [1, 2]",
    )

    write_rows(str(tmp_path / "bad.jsonl"), [{"data_source": "s", "prompt": 5, "reward_model": {}}])
    assert only_problem(
        load_prompt_dataset, str(tmp_path / "bad.jsonl"), data_config(), tokenizer, key="data.train_files"
    ) == ("data.train_files", "row 0: a prompt must be a string or a list of {role, content} messages, got 5")


@pytest.fixture
def overlong_file(tmp_path):
    url = str(tmp_path / "long.jsonl")
    # token counts: 6, 2, 4, 3 against max_prompt_length=3
    write_rows(url, [chat_row("12345>", "12345"), chat_row("1>", "1"), chat_row("123>", "123"), chat_row("99>", "99")])
    return url


def test_overlong_prompts_filtered(overlong_file, tokenizer):
    dataset = load_prompt_dataset(
        overlong_file, data_config(max_prompt_length=3, filter_overlong_prompts=True), tokenizer, key="data.train_files"
    )
    assert dataset.prompt_ids == [[5, 17], [13, 13, 17]]
    assert dataset.row_indices == [1, 3]
    assert dataset.ground_truths == ["1", "99"]


def test_overlong_prompts_truncated(overlong_file, tokenizer):
    left = load_prompt_dataset(overlong_file, data_config(max_prompt_length=3, truncation="left"), tokenizer, key="k")
    assert left.prompt_ids == [[8, 9, 17], [5, 17], [6, 7, 17], [13, 13, 17]]  # "45>", "1>", "23>", "99>"
    right = load_prompt_dataset(overlong_file, data_config(max_prompt_length=3, truncation="right"), tokenizer, key="k")
    assert right.prompt_ids == [[5, 6, 7], [5, 17], [5, 6, 7], [13, 13, 17]]  # "123", "1>", "123", "99>"
    assert left.row_indices == right.row_indices == [0, 1, 2, 3]


def test_overlong_prompts_error(overlong_file, tokenizer):
    assert only_problem(
        load_prompt_dataset, overlong_file, data_config(max_prompt_length=3), tokenizer, key="data.train_files"
    ) == (
        "data.train_files",
        "row 0 prompt has 6 tokens > data.max_prompt_length=3 "
        "(set data.filter_overlong_prompts=true or data.truncation)",
    )
    assert only_problem(
        load_prompt_dataset,
        overlong_file,
        data_config(max_prompt_length=1, filter_overlong_prompts=True),
        tokenizer,
        key="data.val_files",
    ) == ("data.val_files", "every prompt is longer than data.max_prompt_length=1")


def test_prompt_batch_is_left_padded():
    dataset = PromptDataset(
        prompt_ids=[[5, 6, 17], [13, 17], [4]],
        data_sources=["a", "b", "c"],
        agent_names=[None] * 3,
        tools_kwargs=[None] * 3,
        ground_truths=["56", ["x", 2], None],
        row_indices=[0, 1, 5],
    )
    batch = dataset.batch([1, 0, 2], ["u1", "u0", "u2"], pad_token_id=0)
    assert batch.batch_size == torch.Size([3])
    assert batch["prompts"].dtype == torch.int64
    assert batch["prompts"].tolist() == [[0, 13, 17], [5, 6, 17], [0, 0, 4]]
    assert batch["prompt_mask"].dtype == torch.bool
    assert batch["prompt_mask"].tolist() == [[False, True, True], [True, True, True], [False, False, True]]
    assert non_tensor_column(batch, "uid") == ["u1", "u0", "u2"]
    assert non_tensor_column(batch, "data_source") == ["b", "a", "c"]
    assert non_tensor_column(batch, "ground_truth") == [["x", 2], "56", None]

    single = dataset.batch([2, 2], ["v", "w"], pad_token_id=9)
    assert single["prompts"].tolist() == [[4], [4]] and single["prompt_mask"].all()
    padded = dataset.batch([2, 0], ["v", "w"], pad_token_id=9)
    assert padded["prompts"].tolist() == [[9, 9, 4], [5, 6, 17]]
    with pytest.raises(ValueError, match="column 'uid' has 1 values for a batch of 2"):
        dataset.batch([0, 1], ["only-one"], pad_token_id=0)


# -------------------------------------------------------------------------------- prompt loader


def take(loader: PromptLoader, count: int) -> list[tuple[int, list[int]]]:
    return list(itertools.islice(iter(loader), count))


def test_loader_without_shuffle_keeps_order_and_drops_the_partial_batch():
    loader = PromptLoader(10, 4, shuffle=False, seed=0)
    assert loader.batches_per_epoch == 2
    assert take(loader, 5) == [
        (0, [0, 1, 2, 3]),
        (0, [4, 5, 6, 7]),  # rows 8 and 9 never form a batch
        (1, [0, 1, 2, 3]),
        (1, [4, 5, 6, 7]),
        (2, [0, 1, 2, 3]),
    ]
    assert loader.state_dict() == {"epoch": 2, "batch_in_epoch": 1}


def test_loader_shuffles_deterministically_and_reshuffles_each_epoch():
    batches = take(PromptLoader(12, 4, shuffle=True, seed=5), 9)
    assert batches == take(PromptLoader(12, 4, shuffle=True, seed=5), 9)
    assert [epoch for epoch, _ in batches] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    orders = [sum((rows for _, rows in batches[start : start + 3]), []) for start in (0, 3, 6)]
    for order in orders:  # every row exactly once per epoch, across the epoch boundary without a gap
        assert sorted(order) == list(range(12))
    assert orders[0] != list(range(12))
    assert orders[0] != orders[1] and orders[1] != orders[2]
    assert take(PromptLoader(12, 4, shuffle=True, seed=6), 3) != batches[:3]
    assert all(len(rows) == 4 for _, rows in batches)


def test_loader_resumes_exactly_mid_epoch():
    reference = take(PromptLoader(12, 4, shuffle=True, seed=2), 8)

    first = PromptLoader(12, 4, shuffle=True, seed=2)
    iterator = iter(first)
    consumed = [next(iterator) for _ in range(4)]
    assert consumed == reference[:4]
    state = first.state_dict()
    assert state == {"epoch": 1, "batch_in_epoch": 1}

    resumed = PromptLoader(12, 4, shuffle=True, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert take(resumed, 4) == reference[4:8]
    # the original iterator carries on identically
    assert [next(iterator) for _ in range(4)] == reference[4:8]


def test_loader_resumes_at_an_epoch_end():
    reference = take(PromptLoader(8, 4, shuffle=True, seed=0), 4)
    loader = PromptLoader(8, 4, shuffle=True, seed=0)
    take(loader, 2)
    assert loader.state_dict() == {"epoch": 0, "batch_in_epoch": 2}
    resumed = PromptLoader(8, 4, shuffle=True, seed=0)
    resumed.load_state_dict({"epoch": 0, "batch_in_epoch": 2})
    assert take(resumed, 2) == reference[2:4]
    assert [epoch for epoch, _ in reference] == [0, 0, 1, 1]


def test_loader_needs_a_full_batch():
    assert only_problem(PromptLoader, 3, 4, shuffle=True, seed=0) == (
        "data.train_batch_size",
        "4 is larger than the 3 train prompts",
    )
    assert take(PromptLoader(4, 4, shuffle=False, seed=0), 2) == [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3])]
