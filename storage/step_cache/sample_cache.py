"""verl's ``skip.async_rollout``: the rollout service's trajectories cached one prompt at a time, as each
prompt's group finishes.

An entry is one prompt's ``n`` trajectories, keyed by the prompt's feed index (verl's ``sample_{epoch}_{index}``,
counted from 1 over the run, so a resumed run finds it), stored as a :class:`~.store.StepCache` entry of stage
``async_rollout`` under the run's ``GBS1`` directory, with the step cache's guarantees. ``cache`` needs the same
sampling, model, tokenizer and prompt; ``repeat`` replays another prompt's group. The agent-loop workers write each
group as it finishes; every storage call is bounded by ``timeout_s``.
Details: docs/step_cache.md#per-sample-skipasync_rollout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import NamedTuple

from tensordict import TensorDict

from ppoflow.storage.bounded import bounded
from ppoflow.storage.fingerprints import rollout_identity
from ppoflow.storage.fs import open_fs, remove_stale_temp_files
from ppoflow.storage.step_cache.manifest import SAMPLE_STAGE, recorded_differences
from ppoflow.storage.step_cache.store import CacheCorrupt, StepCache

logger = logging.getLogger(__name__)

_SAMPLE_ID = re.compile(r"(?:uid_)?sample_(0|[1-9][0-9]*)_([1-9][0-9]*)")


def sample_id(epoch: int, index: int) -> str:
    """verl's sample id of the ``index``-th prompt fed (from 1), drawn in ``epoch``."""
    return f"sample_{epoch}_{index}"


def feed_index(sample: str) -> int:
    """The feed index of a sample id ``sample_{epoch}_{index}`` (with at most one ``uid_`` prefix, as verl
    writes uids). Stricter than verl's parser: the epoch and the index are canonical decimal integers
    (``sample_0_007`` is refused, not read as 7) and the index counts from 1."""
    match = _SAMPLE_ID.fullmatch(sample)
    if match is None:
        raise ValueError(f"invalid sample id {sample!r}: expected sample_<epoch>_<feed index from 1>")
    return int(match.group(2))


def prompt_digest(prompt_ids: list[int]) -> str:
    """``sha256:...`` of a prompt's token ids: what a ``cache`` entry must have been generated from."""
    return "sha256:" + hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()


class Lookup(NamedTuple):
    """What a lookup found: the group to replay (None: generate it), and the outcome, one of ``hit``,
    ``miss`` (no usable entry) and ``read_failed`` (the storage failed or stalled)."""

    group: TensorDict | None
    outcome: str


class SampleCache:
    """The run's per-sample entries (see the module docstring). ``models`` is the identity of the model and
    tokenizer the rollout samples with (:func:`~ppoflow.storage.fingerprints.model_identities`);
    ``storage_options`` should carry client timeouts (:func:`~ppoflow.storage.bounded.client_timeouts`)."""

    def __init__(
        self,
        root: str,
        *,
        indexes: list[int],
        action: str,
        storage_options: dict,
        timeout_s: float,
        retries: int,
        allow_mismatch: bool,
        models: dict,
        max_entry_bytes: int,
    ):
        self.indexes, self.action, self.timeout_s = frozenset(indexes), action, timeout_s
        self.allow_mismatch, self.models, self.max_entry_bytes = allow_mismatch, models, max_entry_bytes
        self.entries = StepCache(root, stage=SAMPLE_STAGE, storage_options=storage_options, write_retries=retries)
        remove_stale_temp_files(*open_fs(self.entries.root, storage_options))  # left by writes a crash interrupted

    def covers(self, sample: str) -> bool:
        """Whether the sample's feed index is one of ``skip.async_rollout.steps``."""
        return feed_index(sample) in self.indexes

    def lookup(self, sample: str, prompt_ids: list[int], sampling: dict) -> Lookup:
        """The recorded group that serves ``sample`` (its prompt and ``sampling``, the rollout's settings)
        under the cache's action, if any."""
        try:
            return bounded(
                lambda: self._lookup(feed_index(sample), prompt_ids, sampling),
                timeout_s=self.timeout_s,
                what=f"looking up {sample} in {self.entries.root}",
            )
        except Exception as error:  # unreachable, stalled, or answering garbage: generate without it
            logger.warning("the sample cache cannot be read (%r); generating %s", error, sample)
            return Lookup(None, "read_failed")

    def dump(self, sample: str, prompt_ids: list[int], sampling: dict, group: TensorDict, *, meta: dict) -> bool:
        """Record ``group`` (payload, then marker) as ``sample``'s entry; False (with a warning) when the
        storage fails or stalls: the run goes on without it."""
        index = feed_index(sample)
        meta = {**meta, **self._requires(prompt_ids, sampling), "sample_id": sample}
        try:
            bounded(
                lambda: self.entries.write(index, group, meta=meta),
                timeout_s=self.timeout_s,
                what=f"writing {self.entries.payload_url(index)}",
            )
        except Exception as error:
            logger.warning("could not cache %s: %s", sample, error)
            return False
        return True

    def _requires(self, prompt_ids: list[int], sampling: dict) -> dict:
        """What an entry records so that a lookup can tell whether it may serve: how it was sampled, and
        from which prompt."""
        return {**json.loads(json.dumps(rollout_identity(sampling, self.models))), "prompt": prompt_digest(prompt_ids)}

    def _lookup(self, index: int, prompt_ids: list[int], sampling: dict) -> Lookup:
        load_index = self.entries.resolve(index, self.action)
        if load_index is None:
            return Lookup(None, "miss")
        try:
            group, manifest = self.entries.load(load_index, max_bytes=self.max_entry_bytes)
        except CacheCorrupt as error:
            logger.warning("cached sample %d is damaged (%s); generating sample %d", load_index, error, index)
            return Lookup(None, "miss")
        requires = self._requires(prompt_ids, sampling)
        prompt = requires.pop("prompt")
        wrong_prompt = recorded_differences({"prompt": prompt}, manifest) if self.action == "cache" else []
        other_identity = recorded_differences(requires, manifest)
        tolerated = not wrong_prompt and (not other_identity or self.allow_mismatch)
        if wrong_prompt or other_identity:
            logger.warning(
                "cached sample %d does not match this run (%s); %s",
                load_index,
                "; ".join(wrong_prompt + other_identity),
                "replaying it anyway (skip.async_rollout.allow_mismatch)" if tolerated else "generating it",
            )
        return Lookup(group, "hit") if tolerated else Lookup(None, "miss")
