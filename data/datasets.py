"""Prompt datasets: verl-style parquet/JSONL rows read through fsspec, the built-in synthetic task,
and a resumable, epoch-crossing prompt loader.

A row follows verl's layout::

    {"data_source": "synthetic/copy", "prompt": [{"role": "user", "content": "60>"}],  # or a plain string
     "reward_model": {"style": "rule", "ground_truth": "60"}, "extra_info": {"split": "train", "index": 0}}

Chat-message prompts go through the tokenizer's chat template (with the generation prompt); plain strings are
tokenized as they are. A row's ``extra_info`` reaches its scorer; ``reward_model.style`` is ``rule`` or ``model``
(or absent), as in verl. Details: docs/configuration.md#models-data-rewards-resources.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import torch
from tensordict import TensorDict

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import DataConfig, SyntheticDataConfig
from ppoflow.data.vault import vault_code
from ppoflow.storage.batch import with_non_tensor_columns
from ppoflow.storage.fs import atomic_write, open_fs, path_problem

SYNTHETIC_SOURCES = {"copy": "synthetic/copy", "vault": "synthetic/vault", "prefer": "synthetic/prefer"}


def write_synthetic_dataset(spec: SyntheticDataConfig, train_url: str, val_url: str | None) -> None:
    """Write the synthetic task's train (and validation) rows as parquet files.

    ``copy``: the prompt is ``digits`` random digits followed by ``>``; the answer repeats them and
    stops. ``vault``: the same prompt is a key, and the answer is the code its vault holds
    (:mod:`ppoflow.data.vault`; the row fixes the key for the ``vault`` tool); ``copy_share`` of its train
    rows are copy rows instead: a vault row up to the tool's answer, with random digits for the answer
    (``37>?=58>``, answer ``58``): the skill that reading the tool's answer needs. ``prefer``: the same prompt,
    no answer and no scorer (``reward_model.style`` ``model``): only a reward model scores it. The validation rows are
    drawn after the train rows from the same seeded stream; the train
    rows are drawn even when only ``val_url`` is written, so the validation file is the same whether
    or not the train file already existed (it never restarts the stream and repeats the train rows).
    """
    rng = random.Random(spec.seed)
    for url, rows, split in ((train_url, spec.train_rows, "train"), (val_url, spec.val_rows, "test")):
        records = []
        for index in range(rows):
            digits = "".join(rng.choice("0123456789") for _ in range(spec.digits))
            task, prompt = spec.task, f"{digits}>"
            if task == "vault" and split == "train" and spec.copy_share > 0 and rng.random() < spec.copy_share:
                task = "copy"
                key = "".join(rng.choice("0123456789") for _ in range(spec.digits))
                prompt = f"{key}>?={digits}>"  # a vault row up to the tool's answer, the answer's digits random
            extra_info = {"split": split, "index": index}
            if task == "vault":
                extra_info["tools_kwargs"] = {"vault": {"key": digits}}
            truth = vault_code(digits) if task == "vault" else None if task == "prefer" else digits
            record = {
                "data_source": SYNTHETIC_SOURCES[task],
                "prompt": [{"role": "user", "content": prompt}],
                "reward_model": {"style": "model" if task == "prefer" else "rule", "ground_truth": truth},
                "extra_info": extra_info,
            }
            if task != spec.task:  # a copy row among vault rows: answered without tools (verl's per-row agent_name)
                record["agent_name"] = "single_turn_agent"
            records.append(record)
        if url is not None:
            write_rows(url, records)


def files_to_generate(data: DataConfig) -> dict[str, str]:
    """The data files :func:`ensure_datasets` will write, by key (``data.train_files``/``data.val_files``):
    those missing when ``data.synthetic`` is set; none otherwise."""
    if data.synthetic is None:
        return {}
    files = {
        key: _single_file(value, key)
        for key, value in (("data.train_files", data.train_files), ("data.val_files", data.val_files))
        if value is not None
    }
    return {key: url for key, url in files.items() if not _exists(url, key)}


def ensure_datasets(data: DataConfig) -> None:
    """Generate the configured synthetic files when ``data.synthetic`` is set and they are missing, saying so."""
    missing = files_to_generate(data)
    for url in missing.values():
        # print, not a logger: inside the flow (log_prints) it reaches the console and the Prefect UI
        print(f"writing the synthetic {data.synthetic.task} task to {url} (data.synthetic is set and {url} is missing)")
    if missing:
        write_synthetic_dataset(data.synthetic, missing.get("data.train_files"), missing.get("data.val_files"))


def write_rows(url: str, rows: list[dict]) -> None:
    """Write rows as parquet (``.parquet``) or JSON lines (``.jsonl``/``.json``), atomically."""
    if not url.endswith((".parquet", ".jsonl", ".json")):
        raise ValueError(f"{url!r}: write .parquet or .jsonl files")
    fs, path = open_fs(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        columns = dict.fromkeys(name for row in rows for name in row)  # a column some rows lack is null there
        pq.write_table(pa.Table.from_pylist([{**dict.fromkeys(columns), **row} for row in rows]), buffer)
        atomic_write(fs, path, buffer.getvalue())
    else:
        atomic_write(fs, path, "".join(json.dumps(row) + "\n" for row in rows).encode())


def read_rows(files: str | Sequence[str], *, key: str) -> list[dict]:
    """Read every row of the parquet/JSONL ``files``; a missing, unreadable, malformed or empty file is a
    :class:`ConfigError` naming ``key`` and the file."""
    rows: list[dict] = []
    for url in [files] if isinstance(files, str) else files:
        rows += _read_file(url, key)
    if not rows:
        raise ConfigError([(key, f"{files!r} holds no rows")])
    return rows


def _read_file(url: str, key: str) -> list[dict]:
    if not url.endswith((".parquet", ".jsonl", ".json")):
        raise ConfigError([(key, f"{url!r} is neither .parquet nor .jsonl")])
    if not _exists(url, key):
        raise ConfigError([(key, f"no such file {url!r}")])
    try:
        with fsspec.open(os.path.expanduser(url), "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise ConfigError([(key, f"cannot read {url!r}: {error}")]) from None
    if url.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as pq

        try:
            # one file, read whole: ParquetFile, unlike read_table, needs neither pyarrow.dataset nor pandas
            return pq.ParquetFile(io.BytesIO(data)).read().to_pylist()
        except pyarrow.ArrowException as error:  # a zero-byte or truncated file, or not parquet at all
            raise ConfigError([(key, f"{url!r} is not a readable parquet file: {error}")]) from None
    try:
        return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError([(key, f"{url!r} is not JSON lines (one JSON object per line): {error}")]) from None


def read_prompt_rows(files: str | Sequence[str], data: DataConfig, *, key: str) -> list[dict]:
    """:func:`read_rows`, then every row must hold verl's columns: the prompt (``data.prompt_key``),
    ``data_source``, and a ``reward_model`` mapping whose ``style`` (when given) is verl's ``rule`` or ``model``
    (informative only: the config decides what scores a row); :class:`ConfigError`
    naming ``key`` and the row if not."""
    rows = read_rows(files, key=key)
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError([(key, f"row {index} is not a mapping of columns, got {row!r:.80}")])
        for column in (data.prompt_key, "data_source", "reward_model"):
            if row.get(column) is None:
                raise ConfigError([(key, f"row {index} has no {column!r} value (columns: {sorted(row)})")])
        if not isinstance(row["reward_model"], dict):
            raise ConfigError(
                [
                    (
                        key,
                        f"row {index} reward_model must be a mapping with ground_truth, "
                        f"got {row['reward_model']!r:.80}",
                    )
                ]
            )
        style = row["reward_model"].get("style") or "rule"
        if style not in ("rule", "model"):
            raise ConfigError(
                [
                    (
                        key,
                        f"row {index} reward_model.style is {style!r}, not verl's 'rule' or 'model' (the config's "
                        "scorers and reward model score every row: docs/reward_models.md)",
                    )
                ]
            )
    return rows


@dataclass(frozen=True)
class PromptDataset:
    """Tokenized prompts plus the per-row fields the reward needs (``extra_infos``: None when no row has one),
    and those the agent loops read when the dataset has them: a row's ``agent_name`` and its
    ``extra_info.tools_kwargs`` (None where absent)."""

    prompt_ids: list[list[int]]
    data_sources: list[str]
    ground_truths: list
    row_indices: list[int]
    agent_names: list[str | None]
    tools_kwargs: list[dict | None]
    extra_infos: list[dict | None] | None = None
    raw_prompts: list | None = None
    """The prompts as the dataset has them (text or chat messages), for agents that render their own turns."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def reward_columns(self, rows: Sequence[int]) -> dict[str, list]:
        """The per-prompt columns a scorer reads, of ``rows``: ``data_source``, ``ground_truth``, ``extra_info``."""
        return {
            "data_source": [self.data_sources[row] for row in rows],
            "ground_truth": [self.ground_truths[row] for row in rows],
            "extra_info": [self.extra_infos[row] if self.extra_infos else None for row in rows],
        }

    def batch(self, rows: Sequence[int], uids: Sequence[str], pad_token_id: int) -> TensorDict:
        """A prompt batch (one row per prompt): left-padded ``prompts``/``prompt_mask`` plus columns."""
        width = max(len(self.prompt_ids[row]) for row in rows)
        prompts = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for position, row in enumerate(rows):
            ids = self.prompt_ids[row]
            prompts[position, width - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
            mask[position, width - len(ids) :] = True
        batch = TensorDict({"prompts": prompts, "prompt_mask": mask}, batch_size=[len(rows)])
        columns = {"uid": list(uids), **self.reward_columns(rows)}
        named = (
            ("agent_name", self.agent_names),
            ("tools_kwargs", self.tools_kwargs),
            ("raw_prompt", self.raw_prompts),
        )
        for name, values in named:
            if values is not None and any(value is not None for value in values):
                columns[name] = [values[row] for row in rows]
        return with_non_tensor_columns(batch, columns)


def load_prompt_dataset(files: str | Sequence[str], data: DataConfig, tokenizer, *, key: str) -> PromptDataset:
    """Read and tokenize a dataset (:func:`read_prompt_rows`, :func:`tokenize_rows`)."""
    return tokenize_rows(read_prompt_rows(files, data, key=key), data, tokenizer, key=key)


def tokenize_rows(rows: list[dict], data: DataConfig, tokenizer, *, key: str) -> PromptDataset:
    """Tokenize the prompts of :func:`read_prompt_rows`' rows, filtering or truncating those longer than
    ``data.max_prompt_length``; a prompt that cannot be used is a :class:`ConfigError` naming ``key``."""
    prompt_ids, sources, truths, indices, agents, tools_kwargs, extra_infos, raw = [], [], [], [], [], [], [], []
    for index, row in enumerate(rows):
        ids = _tokenize_prompt(row[data.prompt_key], tokenizer, data.apply_chat_template_kwargs, key=key, index=index)
        if len(ids) > data.max_prompt_length:
            if data.filter_overlong_prompts:
                continue
            if data.truncation == "error":
                raise ConfigError(
                    [
                        (
                            key,
                            f"row {index} prompt has {len(ids)} tokens > data.max_prompt_length="
                            f"{data.max_prompt_length} (set data.filter_overlong_prompts=true or "
                            "data.truncation)",
                        )
                    ]
                )
            ids = ids[-data.max_prompt_length :] if data.truncation == "left" else ids[: data.max_prompt_length]
        prompt_ids.append(ids)
        sources.append(row["data_source"])
        truths.append(row["reward_model"].get("ground_truth"))
        indices.append(index)
        agents.append(row.get("agent_name"))
        extra_infos.append(row.get("extra_info"))
        tools_kwargs.append((extra_infos[-1] or {}).get("tools_kwargs"))
        raw.append(row[data.prompt_key])
    if not prompt_ids:
        raise ConfigError([(key, f"every prompt is longer than data.max_prompt_length={data.max_prompt_length}")])
    return PromptDataset(prompt_ids, sources, truths, indices, agents, tools_kwargs, extra_infos, raw)


def check_batch_fits(num_rows: int, batch_size: int) -> None:
    """A step trains on ``batch_size`` distinct prompts: :class:`ConfigError` when the train set has fewer."""
    if num_rows < batch_size:
        raise ConfigError([("data.train_batch_size", f"{batch_size} is larger than the {num_rows} train prompts")])


class PromptLoader:
    """Batches of dataset row indices, epoch after epoch, reproducible from ``(seed, epoch)``.

    Only full batches are yielded (verl drops the last partial batch). The position is a plain
    ``(epoch, batch_in_epoch)`` pair, so a checkpoint can resume mid-epoch exactly.
    """

    def __init__(self, num_rows: int, batch_size: int, *, shuffle: bool, seed: int):
        check_batch_fits(num_rows, batch_size)
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.epoch, self.batch_in_epoch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        """Yield ``(epoch, row_indices)`` forever, crossing epoch boundaries without a pause."""
        while True:
            order = self._epoch_order(self.epoch)
            while self.batch_in_epoch < self.batches_per_epoch:
                start = self.batch_in_epoch * self.batch_size
                self.batch_in_epoch += 1
                yield self.epoch, order[start : start + self.batch_size]
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order


def _tokenize_prompt(prompt, tokenizer, template_kwargs: dict, *, key: str, index: int) -> list[int]:
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                [(key, f"row {index}: the prompt is a list of chat messages but the tokenizer has no chat_template")]
            )
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **template_kwargs)
    else:
        raise ConfigError(
            [
                (
                    key,
                    f"row {index}: a prompt must be a string or a list of {{role, content}} messages, "
                    f"got {prompt!r:.80}",
                )
            ]
        )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _single_file(files: str | list[str], key: str) -> str:
    if isinstance(files, list):
        if len(files) != 1:
            raise ConfigError([(key, f"data.synthetic writes one file, got {len(files)}")])
        return files[0]
    return files


def _exists(url: str, key: str) -> bool:
    """Whether the data file ``url`` exists; :class:`ConfigError` naming ``key`` when it is a path no read
    should open (a symlink loop, a dangling symlink, a FIFO, a directory; :func:`path_problem`)."""
    problem = path_problem(url)
    if problem is not None:
        raise ConfigError([(key, f"{url} {problem}")])
    fs, path = open_fs(url)
    return fs.exists(path)
