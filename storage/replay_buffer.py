"""The staleness-bounded replay buffer of verl's V1 trainer (``ReplayBufferAsync``), as a small in-process store.

It holds the submitted prompts (keyed ``{uid}``, tagged ``status``, ``dispatch_step``, ``partition``) and the
finished groups (``{uid}_{session}_0``) between the rollout and the trainer of the async modes, and bounds how stale
a sampled group may be: its *span* ``s - dispatch_step + 1`` against ``max_off_policy_threshold``, with the
``drop`` or ``wait`` strategy. :meth:`ReplayBuffer.save` / :meth:`ReplayBuffer.load` use the commit-marker protocol
(nothing unpickled). Not thread-safe: completions arrive through the ``poll`` hook on the sampling thread.
Details: docs/async_modes.md#the-replay-buffer.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch
from tensordict import TensorDict

from ppoflow.storage.batch import concatenate, with_non_tensor_columns
from ppoflow.storage.replay_buffer_files import MARKER, ReplayBufferError, read_buffer, write_buffer
from ppoflow.storage.replay_buffer_metrics import sample_metrics

logger = logging.getLogger(__name__)

SAMPLER_CONFIG = "trainer.v1.sampler"
STRATEGIES = ("drop", "wait")
STATUSES = ("pending", "running", "finished", "failure")
IN_FLIGHT = ("pending", "running")
METRIC_PREFIXES = {"train": "training/", "val": "validation/"}
"""The partitions and the prefix of their metrics (verl: ``training/`` for train, ``validation/`` otherwise)."""
GROUP_FIELDS = ("prompts", "prompt_mask", "responses", "response_mask", "weight_version", "max_weight_version")
"""The fields every finished group must carry; any others are kept as they arrive."""


class ReplayBuffer:
    """Submitted prompts and finished groups between the rollout and the trainer (see the module docstring).

    ``refill(k)`` must submit exactly ``k`` fresh train prompts (adding them here with :meth:`add_prompts`);
    :meth:`sample` calls it after evicting ``k`` train groups, so the number of groups in the pipeline stays
    constant. Without ``refill`` evicted groups are still removed, but nothing replaces them.
    """

    def __init__(
        self,
        *,
        pad_token_id: int,
        max_off_policy_threshold: int = 8,
        max_off_policy_strategy: str = "drop",
        refill: Callable[[int], None] | None = None,
    ):
        if (
            isinstance(max_off_policy_threshold, bool)
            or not isinstance(max_off_policy_threshold, int)
            or max_off_policy_threshold <= 0
        ):
            raise ValueError(
                f"{SAMPLER_CONFIG}.max_off_policy_threshold must be an int > 0, got {max_off_policy_threshold!r}"
            )
        if max_off_policy_strategy not in STRATEGIES:
            raise ValueError(
                f"{SAMPLER_CONFIG}.max_off_policy_strategy must be one of {STRATEGIES}, got {max_off_policy_strategy!r}"
            )
        self.pad_token_id = pad_token_id
        self.max_off_policy_threshold = max_off_policy_threshold
        self.max_off_policy_strategy = max_off_policy_strategy
        self.refill = refill
        self._prompts: dict[str, dict] = {}
        """Tags by prompt uid, in insertion order (the tie-break of oldest-first selection)."""
        self._trajectories: dict[str, TensorDict] = {}
        """One-row TensorDicts keyed ``{uid}_{session}_0``."""

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer({len(self._prompts)} prompts, strategy={self.max_off_policy_strategy!r}, "
            f"threshold={self.max_off_policy_threshold})"
        )

    # -- the rollout's side -----------------------------------------------------------------

    def add_prompts(self, uids: list[str], step: int, partition: str = "train") -> None:
        """Record prompts submitted to the rollout at training step ``step``, all ``pending``.

        A uid that is already in the buffer (or twice in ``uids``) raises ``ValueError``: a uid names one
        group, and its trajectories' keys derive from it.
        """
        check_partition(partition)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        repeated = sorted({uid for uid, count in Counter(uids).items() if count > 1 or uid in self._prompts})
        if repeated:
            raise ValueError(f"prompt uids already in the replay buffer or repeated: {repeated}")
        for uid in uids:
            self._prompts[uid] = {"status": "pending", "dispatch_step": step, "partition": partition}

    def mark_running(self, uid: str) -> None:
        """Note that the rollout started generating ``uid`` (verl's ``running``; in flight like ``pending``)."""
        self._in_flight_tags(uid, "mark running")["status"] = "running"

    def finish(self, uid: str, group: TensorDict) -> None:
        """Store the finished group of ``uid``: ``group`` has one row per trajectory (batch_size [n], n >= 1)
        and at least :data:`GROUP_FIELDS`; row ``session`` is kept under ``{uid}_{session}_0``."""
        tags = self._in_flight_tags(uid, "finish")
        missing = [name for name in GROUP_FIELDS if name not in group.keys()]
        if group.batch_dims != 1 or group.batch_size[0] == 0 or missing:
            raise ValueError(
                f"the group of prompt {uid!r} must have batch_size [n >= 1] and the fields "
                f"{list(GROUP_FIELDS)}; got batch_size {list(group.batch_size)}, missing {missing}"
            )
        for session in range(group.batch_size[0]):
            self._trajectories[trajectory_key(uid, session)] = group[session : session + 1]
        tags.update(status="finished", num_trajectories=group.batch_size[0])

    def reissue(self, uid: str, step: int) -> None:
        """Dispatch an in-flight prompt again at ``step`` (verl's ``_reissue_inflight_prompts`` on resume: its
        rollout died with the old process, so its span counts from now)."""
        self._in_flight_tags(uid, "reissue").update(status="pending", dispatch_step=step)

    def fail(self, uid: str, reason: str) -> None:
        """Record that the rollout of ``uid`` failed (``reason`` is kept in its tags); the next
        :meth:`sample` of its partition evicts it."""
        self._in_flight_tags(uid, "fail").update(status="failure", reason=reason)

    # -- queries ----------------------------------------------------------------------------

    def status(self, uid: str) -> str:
        """The status of prompt ``uid``; ``KeyError`` once it was sampled or evicted (or never added)."""
        return self._tags(uid)["status"]

    def in_flight(self, partition: str = "train") -> dict[str, int]:
        """The pending and running prompts of ``partition``, with their dispatch steps: what the rollout
        still owes (and, after :meth:`load`, what the trainer must submit again)."""
        check_partition(partition)
        return {
            uid: tags["dispatch_step"]
            for uid, tags in self._prompts.items()
            if tags["partition"] == partition and tags["status"] in IN_FLIGHT
        }

    def finished_count(self, partition: str = "train") -> int:
        """How many finished groups of ``partition`` wait to be sampled (stale ones not yet evicted included)."""
        check_partition(partition)
        return len(self._finished_uids(partition))

    def trajectory_keys(self, uid: str) -> list[str]:
        """The keys of a finished prompt's trajectories, ``{uid}_{session}_0`` in session order."""
        tags = self._tags(uid)
        if tags["status"] != "finished":
            raise ValueError(f"prompt {uid!r} is {tags['status']}, it has no trajectories")
        return [trajectory_key(uid, session) for session in range(tags["num_trajectories"])]

    # -- the trainer's side -----------------------------------------------------------------

    def sample(
        self,
        step: int,
        batch_size: int,
        *,
        partition: str = "train",
        poll: Callable[[float], None],
        poll_interval_s: float = 0.05,
        timeout_s: float | None = None,
        in_order: bool = False,
    ) -> tuple[TensorDict, dict[str, float]]:
        """The ``batch_size`` oldest finished groups of ``partition`` for training step ``step``, and the metrics.

        Loops as verl's ``ReplayBufferAsync.sample``: evict (failed groups; under ``drop`` also train groups
        whose span exceeds the threshold) and refill; return once enough groups are finished (and, under
        ``wait``, no in-flight train prompt has a span >= the threshold); else ``poll(poll_interval_s)``: the
        caller's hook, which delivers completions by calling :meth:`finish` / :meth:`fail`.

        The selected groups (oldest ``dispatch_step`` first, ties in insertion order) leave the buffer. Their
        trajectories come back as one batch, prompt-major and sessions in order, prompts left-padded to the
        widest, with ``group_index`` (0..batch_size-1, per trajectory) and a ``uid`` column added.

        The ``val`` partition never waits on or evicts stale groups. Its failed groups are removed without a
        replacement and are simply missing from the batch: once no val prompt is in flight, the finished ones
        come back even if fewer than ``batch_size`` (``RuntimeError`` if none), since nothing more can arrive.

        ``timeout_s`` (None: wait forever) raises ``TimeoutError`` saying how many groups were found.

        ``in_order`` takes the ``batch_size`` oldest prompts whatever their status, waiting until all of them
        are finished: which groups a step trains then never depends on which finished first (a run that
        replays cached samples must train exactly as the run that recorded them).
        """
        check_partition(partition)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stale_spans: list[int] = []
        failed = 0
        while True:
            round_spans, round_failed = self._evict(step, partition)
            stale_spans += round_spans
            failed += round_failed
            evicted = len(round_spans) + round_failed
            if partition == "train" and evicted and self.refill is not None:
                self.refill(evicted)
            ready = self._finished_uids(partition)
            if in_order:
                queue = sorted(
                    (uid for uid, tags in self._prompts.items() if tags["partition"] == partition),
                    key=lambda uid: self._prompts[uid]["dispatch_step"],
                )[:batch_size]
                ready = queue if all(self._prompts[uid]["status"] == "finished" for uid in queue) else []
            blocking = self._blocking_uids(step) if partition == "train" else []
            if len(ready) >= batch_size and not blocking:
                break
            if partition == "val" and not self.in_flight("val"):
                if not ready:
                    raise RuntimeError(
                        f"no val group to sample at step {step}: every val prompt failed or none was submitted"
                    )
                logger.warning(
                    "val sample at step %d: %d of %d groups, the others failed", step, len(ready), batch_size
                )
                break
            if deadline is not None and time.monotonic() >= deadline:
                waiting = (
                    f"; {len(blocking)} in-flight prompt(s) with span >= {self.max_off_policy_threshold} "
                    f"block it (max_off_policy_strategy=wait)"
                    if blocking
                    else ""
                )
                raise TimeoutError(
                    f"{partition} sample at step {step} timed out after {timeout_s} s: found "
                    f"{len(ready)} finished group(s), wanted {batch_size}{waiting}"
                )
            poll(poll_interval_s)
        selected = sorted(ready, key=lambda uid: self._prompts[uid]["dispatch_step"])[:batch_size]
        batch = self._take(selected)
        return batch, sample_metrics(METRIC_PREFIXES[partition], step, batch, stale_spans, failed)

    # -- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs: ``prompts`` (each prompt's tags with its ``uid``, in insertion
        order; JSON) and ``groups`` ({uid: the finished group as one TensorDict})."""
        return {
            "prompts": [{"uid": uid, **tags} for uid, tags in self._prompts.items()],
            "groups": {
                uid: concatenate(
                    *(self._trajectories[key] for key in self.trajectory_keys(uid)), pad_token_id=self.pad_token_id
                )
                for uid in self._prompts
                if self._prompts[uid]["status"] == "finished"
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` gave (into an empty buffer): finished and failed prompts as they
        were, pending and running ones ``pending`` (their rollout died with the old process), listed by
        :meth:`in_flight` for the trainer to :meth:`reissue`. ``ValueError`` when the state does not fit."""
        if self._prompts:
            raise ValueError("load_state_dict needs an empty replay buffer")
        self._restore(state["prompts"], state["groups"])

    def save(self, url: str, storage_options: dict | None = None) -> None:
        """Write the buffer under the folder ``url`` (any fsspec URL): one safetensors payload per finished
        group (``groups/{n}.safetensors``), then the marker ``buffer.json`` listing them with their sizes and
        sha256 and carrying every prompt's tags.

        The old marker is removed first (then the old payloads), so a save interrupted anywhere leaves no
        valid buffer rather than a mix of two; a failed write raises, and saving again starts over.
        """
        write_buffer(url, storage_options, self.state_dict())

    @classmethod
    def load(cls, url: str, storage_options: dict | None = None, **init_kwargs) -> ReplayBuffer:
        """The buffer :meth:`save` wrote under ``url``, built with ``init_kwargs`` (the current sampler config).

        Every payload is checked against the marker (size, then sha256) before it is decoded; a missing or
        damaged marker or payload raises :class:`ReplayBufferError` naming it. Finished and failed prompts
        come back as they were; pending and running ones come back ``pending`` with their dispatch steps
        (their rollout died with the old process), listed by :meth:`in_flight` for the trainer to submit
        again.
        """
        prompts, groups, marker_path = read_buffer(url, storage_options)
        buffer = cls(**init_kwargs)
        try:
            buffer._restore(prompts, groups)
        except (KeyError, TypeError, ValueError) as error:
            raise ReplayBufferError(marker_path, f"inconsistent {MARKER}: {error!r}") from error
        return buffer

    # -- internals --------------------------------------------------------------------------

    def _tags(self, uid: str) -> dict:
        try:
            return self._prompts[uid]
        except KeyError:
            raise KeyError(f"prompt {uid!r} is not in the replay buffer") from None

    def _in_flight_tags(self, uid: str, action: str) -> dict:
        """The tags of ``uid`` if it is pending or running; ``ValueError`` otherwise (a second completion)."""
        tags = self._tags(uid)
        if tags["status"] not in IN_FLIGHT:
            raise ValueError(f"cannot {action} prompt {uid!r}: it is already {tags['status']}")
        return tags

    def _finished_uids(self, partition: str) -> list[str]:
        return [
            uid
            for uid, tags in self._prompts.items()
            if tags["partition"] == partition and tags["status"] == "finished"
        ]

    def _blocking_uids(self, step: int) -> list[str]:
        """Under ``wait``: the in-flight train prompts whose span at ``step`` reached the threshold."""
        if self.max_off_policy_strategy != "wait":
            return []
        return [
            uid
            for uid, dispatch_step in self.in_flight("train").items()
            if span(step, dispatch_step) >= self.max_off_policy_threshold
        ]

    def _evict(self, step: int, partition: str) -> tuple[list[int], int]:
        """Remove the failed groups of ``partition`` and, for train under ``drop``, the finished groups whose
        span exceeds the threshold; return the spans of the stale ones and the number of failed ones."""
        drops_stale = partition == "train" and self.max_off_policy_strategy == "drop"
        stale_spans, failed = [], 0
        for uid, tags in list(self._prompts.items()):
            if tags["partition"] != partition:
                continue
            if tags["status"] == "failure":
                failed += 1
                self._remove(uid)
            elif (
                drops_stale
                and tags["status"] == "finished"
                and span(step, tags["dispatch_step"]) > self.max_off_policy_threshold
            ):
                stale_spans.append(span(step, tags["dispatch_step"]))
                self._remove(uid)
        if stale_spans or failed:
            logger.info(
                "step %d: evicted %d stale and %d failed %s group(s)", step, len(stale_spans), failed, partition
            )
        return stale_spans, failed

    def _remove(self, uid: str) -> None:
        """Remove prompt ``uid`` and its trajectories."""
        if self._prompts[uid]["status"] == "finished":
            for key in self.trajectory_keys(uid):
                del self._trajectories[key]
        del self._prompts[uid]

    def _take(self, uids: list[str]) -> TensorDict:
        """Remove the groups of ``uids`` and return their trajectories as one batch (see :meth:`sample`)."""
        rows, row_uids, sizes = [], [], []
        for uid in uids:
            keys = self.trajectory_keys(uid)
            rows += [self._trajectories[key] for key in keys]
            row_uids += [uid] * len(keys)
            sizes.append(len(keys))
            self._remove(uid)
        batch = concatenate(*rows, pad_token_id=self.pad_token_id)
        batch["group_index"] = torch.repeat_interleave(torch.arange(len(uids), dtype=torch.int64), torch.tensor(sizes))
        return with_non_tensor_columns(batch, {"uid": row_uids})

    def _restore(self, prompts: list, groups: dict[str, TensorDict]) -> None:
        """Rebuild the buffer from saved tags and groups (see :meth:`load`); ``KeyError`` / ``TypeError`` /
        ``ValueError`` when they do not fit together."""
        unclaimed = dict(groups)
        for entry in prompts:
            uid, status = entry["uid"], entry["status"]
            if not isinstance(uid, str) or status not in STATUSES:
                raise ValueError(f"prompt entry {entry!r} has no str uid or a status outside {STATUSES}")
            self.add_prompts([uid], entry["dispatch_step"], entry["partition"])
            if status == "finished":
                self.finish(uid, unclaimed.pop(uid))
                if self._prompts[uid]["num_trajectories"] != entry["num_trajectories"]:
                    raise ValueError(
                        f"the group of {uid!r} has {self._prompts[uid]['num_trajectories']} "
                        f"trajectories, {entry['num_trajectories']} recorded"
                    )
            elif status == "failure":
                self.fail(uid, entry["reason"])
        if unclaimed:
            raise ValueError(f"groups of prompts that are not finished: {sorted(unclaimed)}")


def trajectory_key(uid: str, session: int) -> str:
    """verl's TransferQueue key of a trajectory: ``{uid}_{session}_{index}``, index 0 (one per session)."""
    return f"{uid}_{session}_0"


def span(step: int, dispatch_step: int) -> int:
    """How many training steps a group submitted at ``dispatch_step`` spans when sampled at ``step``."""
    return step - dispatch_step + 1


def check_partition(partition: str) -> None:
    """``ValueError`` unless ``partition`` is ``"train"`` or ``"val"``."""
    if partition not in METRIC_PREFIXES:
        raise ValueError(f"partition must be one of {tuple(METRIC_PREFIXES)}, got {partition!r}")
