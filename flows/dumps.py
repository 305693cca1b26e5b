"""Generation dumps (verl's ``trainer.rollout_data_dir`` / ``validation_data_dir``): one ``<step>.jsonl`` per step
on any fsspec URL, a line per sample with verl's fields (``input``, ``output``, ``gts``, ``score``, ``step``) and
ppoflow's (``uid``, ``data_source``, ``weight_version``, ``reward_extras``; ``turns`` and ``tool_calls`` for a
multi-turn trajectory). Decoding and writing happen on a background thread, each file written atomically: a slow
bucket never stalls a step (past :data:`MAX_PENDING` waiting dumps one is dropped) and a failed write warns and
counts in ``training/dump_write_failures``. ``ppoflow dump show`` reads them (:mod:`ppoflow.flows.cli_dump`).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from ppoflow.flows.validation import turn_pieces
from ppoflow.storage.batch import non_tensor_column, response_extent
from ppoflow.storage.fs import atomic_write, join, open_fs
from ppoflow.tasks.reward import decode_responses

logger = logging.getLogger(__name__)

MAX_PENDING = 8
"""Dumps waiting for the writer beyond which a new one is dropped (and counted as failed)."""
FAILURES = "training/dump_write_failures"


def generation_rows(batch, tokenizer, step: int) -> list[dict]:
    """One dump line (a dict) per trajectory of ``batch``."""
    keys = set(batch.keys())
    inputs = tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True)
    outputs = decode_responses(batch, tokenizer)
    scores = batch["token_level_scores"].sum(dim=-1).tolist()
    columns = {
        name: non_tensor_column(batch, source)
        for name, source in (
            ("uid", "uid"),
            ("data_source", "data_source"),
            ("gts", "ground_truth"),
            ("reward_extras", "reward_extras"),
        )
        if source in keys
    }
    versions = batch["weight_version"].tolist() if "weight_version" in keys else None
    rows = []
    for index, (text_in, text_out, score) in enumerate(zip(inputs, outputs, scores)):
        row = {"step": step, "input": text_in, "output": text_out, "score": score}
        row.update({name: values[index] for name, values in columns.items()})
        if versions is not None:
            row["weight_version"] = versions[index]
        rows.append(row)
    if "turn_ids" in keys:
        extents = response_extent(batch).tolist()
        for row, tokens, turns, extent in zip(rows, batch["responses"].tolist(), batch["turn_ids"].tolist(), extents):
            pieces = turn_pieces(tokens[:extent], turns[:extent], tokenizer)
            row["turns"] = [{"role": role, "text": text} for role, text in pieces]
            row["tool_calls"] = sum(role == "tool" for role, _ in pieces)
    return rows


def dump_url(directory: str, step: int) -> str:
    return join(directory, f"{step}.jsonl")


def read_dump(directory: str, step: int) -> list[dict]:
    """The lines of one step's dump."""
    fs, path = open_fs(dump_url(directory, step))
    return [json.loads(line) for line in fs.cat_file(path).splitlines() if line.strip()]


def dumped_steps(directory: str) -> list[int]:
    """The steps ``directory`` holds a dump of, in order."""
    fs, path = open_fs(directory)
    names = [entry.rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    return sorted(int(name[: -len(".jsonl")]) for name in names if name.endswith(".jsonl") and name[:-6].isdigit())


class GenerationDumper:
    """The background writer of the dumps of one run."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-dump")
        self.pending: list[Future] = []
        self.failures = 0

    def dump(self, directory: str | None, step: int, batch=None, rows: list[dict] | None = None) -> None:
        """Queue ``step``'s dump to ``directory`` (nothing when it is None): ``rows``, or those of ``batch``."""
        if directory is None:
            return
        self.pending = [future for future in self.pending if not future.done()]
        if len(self.pending) >= MAX_PENDING:
            self.failures += 1
            logger.warning(
                "dropping the dump of step %d to %s: %d dumps still being written", step, directory, MAX_PENDING
            )
            return
        self.pending.append(self.pool.submit(self._write, directory, step, batch, rows))

    def _write(self, directory: str, step: int, batch, rows: list[dict] | None) -> None:
        url = dump_url(directory, step)
        try:
            rows = generation_rows(batch, self.tokenizer, step) if rows is None else rows
            data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
            fs, path = open_fs(url)
            atomic_write(fs, path, data)
        except Exception as error:  # the run goes on; the metric counts it
            self.failures += 1
            logger.warning("could not write the generation dump %s: %r", url, error)

    def metrics(self) -> dict[str, float]:
        return {FAILURES: float(self.failures)}

    def close(self) -> None:
        """Wait for the dumps still being written."""
        self.pool.shutdown(wait=True)
