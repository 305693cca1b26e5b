"""data/datasets.py: verl-style rows, the synthetic task, and rows on disk (parquet, JSON lines)."""

from __future__ import annotations

import json

import pytest

from ppoflow.configs.schema import SyntheticDataConfig
from ppoflow.data.datasets import ensure_datasets, files_to_generate, read_rows, write_rows, write_synthetic_dataset
from tests.datasets_helpers import chat_row, data_config, only_problem

# ---------------------------------------------------------------------------------- synthetic


def test_synthetic_rows_layout(tmp_path):
    spec = SyntheticDataConfig(task="copy", digits=3, train_rows=20, val_rows=5, seed=7)
    write_synthetic_dataset(spec, str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"))
    train = read_rows(str(tmp_path / "train.parquet"), key="k")
    val = read_rows(str(tmp_path / "val.parquet"), key="k")
    assert len(train) == 20 and len(val) == 5
    for rows, split in ((train, "train"), (val, "test")):
        for index, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "reward_model", "extra_info"}
            assert row["data_source"] == "synthetic/copy"
            [message] = row["prompt"]
            assert message["role"] == "user"
            content = message["content"]
            assert len(content) == 4 and content.endswith(">") and content[:3].isdigit()
            assert row["reward_model"] == {"style": "rule", "ground_truth": content[:3]}
            assert row["extra_info"] == {"split": split, "index": index}
    # 20 three-digit draws: not all the same
    assert len({row["reward_model"]["ground_truth"] for row in train}) > 1


def test_vault_rows_fix_the_key_for_the_tool_and_mix_in_copy_rows(tmp_path):
    from ppoflow.data.vault import vault, vault_code

    spec = SyntheticDataConfig(task="vault", digits=2, train_rows=200, val_rows=20, seed=3, copy_share=0.5)
    write_synthetic_dataset(spec, str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"))
    train = read_rows(str(tmp_path / "train.parquet"), key="k")
    val = read_rows(str(tmp_path / "val.parquet"), key="k")
    vaults = [row for row in train if row["data_source"] == "synthetic/vault"]
    copies = [row for row in train if row["data_source"] == "synthetic/copy"]
    assert 60 < len(copies) < 140 and len({row["prompt"][0]["content"][:2] for row in copies}) > 30
    assert all(row["data_source"] == "synthetic/vault" for row in val)
    for row in vaults + val:
        key = row["prompt"][0]["content"][:-1]
        assert row["prompt"][0]["content"] == f"{key}>" and row.get("agent_name") is None
        assert row["extra_info"]["tools_kwargs"] == {"vault": {"key": key}}
        assert row["reward_model"]["ground_truth"] == vault_code(key) == vault(key)
    for row in copies:  # a vault row up to the tool's answer (random digits), answered without tools
        key, answer = row["prompt"][0]["content"][:2], row["reward_model"]["ground_truth"]
        assert row["prompt"][0]["content"] == f"{key}>?={answer}>" and key.isdigit() and answer.isdigit()
        assert row["agent_name"] == "single_turn_agent" and row["extra_info"].get("tools_kwargs") is None
    assert sorted(vault_code(f"{k:02d}") for k in range(100)) == [f"{k:02d}" for k in range(100)]  # a shuffle
    assert sum(vault_code(f"{k:02d}") == f"{k:02d}" for k in range(100)) < 5  # that hardly keeps a key


@pytest.mark.parametrize("task", ["copy", "prefer"])
def test_only_vault_rows_open_a_vault(tmp_path, monkeypatch, task):
    """A vault code is a shuffle of every code of the key's length (10^8 for 8 digits): copy and prefer rows of
    long keys must not draw one."""

    def no_vault(key):
        raise AssertionError(f"a {task} row drew the vault code of {key}")

    monkeypatch.setattr("ppoflow.data.datasets.vault_code", no_vault)
    spec = SyntheticDataConfig(task=task, digits=8, train_rows=4, val_rows=1, seed=0)
    write_synthetic_dataset(spec, str(tmp_path / "train.parquet"), None)
    assert len(read_rows(str(tmp_path / "train.parquet"), key="k")) == 4


def test_synthetic_rows_are_deterministic_per_seed_and_val_continues_the_stream(tmp_path):
    spec = SyntheticDataConfig(task="copy", digits=4, train_rows=30, val_rows=10, seed=3)
    write_synthetic_dataset(spec, str(tmp_path / "a/train.parquet"), str(tmp_path / "a/val.parquet"))
    write_synthetic_dataset(spec, str(tmp_path / "b/train.jsonl"), str(tmp_path / "b/val.jsonl"))
    train_a = read_rows(str(tmp_path / "a/train.parquet"), key="k")
    val_a = read_rows(str(tmp_path / "a/val.parquet"), key="k")
    assert read_rows(str(tmp_path / "b/train.jsonl"), key="k") == train_a
    assert read_rows(str(tmp_path / "b/val.jsonl"), key="k") == val_a

    def truths(rows):
        return [row["reward_model"]["ground_truth"] for row in rows]

    # the validation rows are not the first train rows again
    assert truths(val_a) != truths(train_a)[:10]
    # writing only one of the files gives the same rows as writing both
    write_synthetic_dataset(spec, None, str(tmp_path / "c/val.parquet"))
    assert read_rows(str(tmp_path / "c/val.parquet"), key="k") == val_a
    assert not (tmp_path / "c/train.parquet").exists()
    write_synthetic_dataset(spec, str(tmp_path / "d/train.parquet"), None)
    assert read_rows(str(tmp_path / "d/train.parquet"), key="k") == train_a
    # another seed, other rows
    other = SyntheticDataConfig(task="copy", digits=4, train_rows=30, val_rows=10, seed=4)
    write_synthetic_dataset(other, str(tmp_path / "e/train.parquet"), None)
    assert truths(read_rows(str(tmp_path / "e/train.parquet"), key="k")) != truths(train_a)


def test_ensure_datasets_only_writes_missing_files(tmp_path, capsys):
    train, val = str(tmp_path / "d/train.parquet"), str(tmp_path / "d/val.parquet")
    spec = SyntheticDataConfig(task="copy", digits=2, train_rows=12, val_rows=4, seed=0)
    data = data_config(train_files=train, val_files=val, synthetic=spec)
    assert files_to_generate(data) == {"data.train_files": train, "data.val_files": val}
    ensure_datasets(data)
    assert capsys.readouterr().out.splitlines() == [  # generating announces itself, file by file
        f"writing the synthetic copy task to {url} (data.synthetic is set and {url} is missing)" for url in (train, val)
    ]
    assert files_to_generate(data) == {}
    first_val = read_rows(val, key="k")
    assert len(read_rows(train, key="k")) == 12 and len(first_val) == 4

    marker = [chat_row("7>", "7", source="marker")]
    write_rows(train, marker)
    (tmp_path / "d/val.parquet").unlink()
    ensure_datasets(data)
    assert read_rows(train, key="k") == marker  # kept: it existed
    assert read_rows(val, key="k") == first_val  # regenerated, same rows as before

    capsys.readouterr()
    ensure_datasets(data)  # nothing missing: nothing written, nothing said
    assert read_rows(train, key="k") == marker
    assert capsys.readouterr().out == ""

    # without `synthetic` nothing is generated
    ensure_datasets(data_config(train_files=str(tmp_path / "x.parquet"), val_files=None))
    assert not (tmp_path / "x.parquet").exists()
    # a val-less config writes the train file only
    ensure_datasets(data_config(train_files=str(tmp_path / "y/t.parquet"), synthetic=spec))
    assert [p.name for p in (tmp_path / "y").iterdir()] == ["t.parquet"]
    assert only_problem(ensure_datasets, data_config(train_files=[train, val], synthetic=spec)) == (
        "data.train_files",
        "data.synthetic writes one file, got 2",
    )


# ------------------------------------------------------------------------------- rows on disk

ROWS = [
    {
        "data_source": "synthetic/copy",
        "prompt": [{"role": "user", "content": "12>"}],
        "reward_model": {"style": "rule", "ground_truth": "12"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"split": "train", "index": 1},
    },
]


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl", "rows.json", "deeper/dir/rows.parquet"])
def test_write_read_round_trip(tmp_path, name):
    url = str(tmp_path / name)
    write_rows(url, ROWS)
    assert read_rows(url, key="data.train_files") == ROWS
    assert read_rows([url, url], key="data.train_files") == ROWS + ROWS
    assert [p.name for p in (tmp_path / name).parent.iterdir()] == [name.rsplit("/", 1)[-1]]  # no temp file left


def test_jsonl_is_one_json_object_per_line(tmp_path):
    write_rows(str(tmp_path / "r.jsonl"), ROWS)
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == ROWS
    (tmp_path / "blank.jsonl").write_text("\n" + lines[0] + "\n\n")
    assert read_rows(str(tmp_path / "blank.jsonl"), key="k") == ROWS[:1]


def test_read_rows_errors(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    assert only_problem(read_rows, missing, key="data.val_files") == ("data.val_files", f"no such file {missing!r}")
    write_rows(str(tmp_path / "exists.jsonl"), ROWS)
    assert only_problem(read_rows, [str(tmp_path / "exists.jsonl"), missing], key="data.train_files") == (
        "data.train_files",
        f"no such file {missing!r}",
    )

    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n1,2\n")
    assert only_problem(read_rows, str(csv), key="data.train_files") == (
        "data.train_files",
        f"{str(csv)!r} is neither .parquet nor .jsonl",
    )

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert only_problem(read_rows, str(empty), key="data.train_files") == (
        "data.train_files",
        f"{str(empty)!r} holds no rows",
    )
    write_rows(str(tmp_path / "empty.parquet"), [])
    assert only_problem(read_rows, str(tmp_path / "empty.parquet"), key="data.train_files")[1].endswith("holds no rows")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("zero.parquet", b"", "is not a readable parquet file"),
        ("text.parquet", b"not parquet at all", "is not a readable parquet file"),
        ("broken.jsonl", b'{"prompt": "1>"}\n{"prompt": ', "is not JSON lines (one JSON object per line)"),
        ("binary.jsonl", b"\xff\xfe\x00", "is not JSON lines (one JSON object per line)"),
    ],
)
def test_malformed_files_name_the_key_and_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    key, problem = only_problem(read_rows, str(tmp_path / name), key="data.train_files")
    assert key == "data.train_files" and problem.startswith(f"{str(tmp_path / name)!r} {message}")
