"""Nothing read from a step cache may choose how it is deserialized or run code.

Each test plants what someone with write access to a shared cache folder or bucket could plant: a
Prefect record naming the pickle serializer and a payload of their choice, a marker replaced by such a
record, a payload replaced by a pickle with a marker that vouches for it, verl's pickle formats. Every
pickle, if ever unpickled, creates a sentinel file; the tests assert it never appears, that Prefect
sees no record for a poisoned entry, and (end to end) that the step is regenerated.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import pickle
import shutil

import pytest
import torch
from prefect.results import ResultRecordMetadata, ResultStore
from prefect.serializers import PickleSerializer
from tensordict import TensorDict

from ppoflow.flows.cached_stages.records import DerivedRecords, ManifestSerializer, StepCacheStorage
from ppoflow.storage.batch import with_non_tensor_columns
from ppoflow.storage.step_cache import StepCache, scan
from ppoflow.storage.step_cache.entry_check import StageRecord
from ppoflow.storage.step_cache.store import CacheCorrupt
from tests.flow_runs import CONFIG, PROJECT, copy_dump, generate_states, rollout_skip, train, train_run

pytestmark = pytest.mark.reliability


class Sentinel:
    """Unpickling this creates ``path`` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def evil_pickle(sentinel) -> bytes:
    return pickle.dumps(Sentinel(sentinel))


def prefect_pickle_metadata(storage_key: str) -> dict:
    """Prefect's own record metadata, naming the pickle serializer and a storage key of our choice."""
    return json.loads(ResultRecordMetadata(storage_key=storage_key, serializer=PickleSerializer()).dump_bytes())


def prefect_single_record(sentinel) -> bytes:
    """Prefect's default single-file record: metadata plus a base64 pickle of the result."""
    return json.dumps(
        {"metadata": prefect_pickle_metadata("x"), "result": base64.b64encode(evil_pickle(sentinel)).decode()}
    ).encode()


def step_batch(rows: int = 2) -> TensorDict:
    batch = TensorDict(
        {"responses": torch.ones(rows, 3, dtype=torch.int64), "response_mask": torch.ones(rows, 3, dtype=torch.bool)},
        batch_size=[rows],
    )
    return with_non_tensor_columns(
        batch, {"uid": ["u"] * rows, "data_source": ["d"] * rows, "ground_truth": ["1"] * rows}
    )


def vouch_for(step_dir, payload: bytes) -> None:
    """Replace the rollout payload with ``payload`` and rewrite the marker to match its size and checksum."""
    (step_dir / "rollout.safetensors").write_bytes(payload)
    manifest = json.loads((step_dir / "meta.json").read_text())
    manifest["files"]["rollout.safetensors"] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (step_dir / "meta.json").write_text(json.dumps(manifest))


def poison(root, dump, sentinel) -> dict[int, str]:
    """Plant one attack per step under the config directory ``root``; returns what each step holds."""
    (dump / "evil.pkl").write_bytes(base64.b64encode(evil_pickle(sentinel)))  # what PickleSerializer reads
    # 1: Prefect's record of step 1 (where Prefect kept it before) names pickle and our evil.pkl;
    #    our marker and payload stay valid, so the step replays - from our files, never from evil.pkl
    record = dump / ".prefect" / PROJECT / CONFIG / "1" / "meta.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(prefect_pickle_metadata("evil.pkl")))
    # 2: the marker replaced by a Prefect single-file record carrying a base64 pickle
    (root / "2" / "meta.json").write_bytes(prefect_single_record(sentinel))
    # 3: the marker replaced by Prefect metadata naming pickle and evil.pkl
    (root / "3" / "meta.json").write_text(json.dumps(prefect_pickle_metadata("evil.pkl")))
    # 4: the payload replaced by a pickle, and the marker edited to vouch for its size and checksum
    vouch_for(root / "4", evil_pickle(sentinel))
    # verl's pickle formats beside every step: never read
    for step in (1, 2, 3, 4):
        (root / str(step) / "gen_batch.dp").write_bytes(evil_pickle(sentinel))
    return {1: "valid", 2: "single record", 3: "pickle metadata", 4: "pickle payload"}


def poisoned_cache(tmp_path):
    """Four valid entries written under ``tmp_path/dump``, then :func:`poison`-ed; returns
    ``(sentinel, dump_dir, config directory)``."""
    dump = tmp_path / "dump"
    root = dump / PROJECT / CONFIG
    for step in (1, 2, 3, 4):
        StepCache(str(root)).write(step, step_batch())
    poison(root, dump, tmp_path / "pwned")
    return tmp_path / "pwned", dump, root


def test_prefect_reads_only_records_derived_from_valid_markers(tmp_path):
    """The result store a cached stage task uses: a valid entry reads back through the manifest
    serializer; every poisoned one is "no record" to Prefect, and no pickle is ever loaded."""
    sentinel, dump, root = poisoned_cache(tmp_path)
    store = ResultStore(
        result_storage=StepCacheStorage(basepath=str(dump)),
        metadata_storage=DerivedRecords(basepath=str(dump)),
        serializer=ManifestSerializer(),
        cache_result_in_memory=False,
    )

    def key(step: int) -> str:
        return f"{PROJECT}/{CONFIG}/{step}/meta.json"

    record = store.read(key(1)).result
    assert isinstance(record, StageRecord) and record.fields is None and record.manifest["global_steps"] == 1
    for step in (2, 3):
        assert not store.exists(key(step))
        with pytest.raises(CacheCorrupt, match="unreadable meta.json"):
            store.read(key(step))
    # 4 has a marker that decodes: Prefect may call it Cached, but the load that follows refuses the payload
    assert store.exists(key(4))
    with pytest.raises(Exception, match="undecodable payload"):
        StepCache(str(root)).load(4)
    for bad_key in (
        "evil.pkl",
        ".prefect/x/y/1/meta.json",
        f"{PROJECT}/{CONFIG}/01/meta.json",
        f"{PROJECT}/{CONFIG}/1/gen_batch.dp",
        f"{PROJECT}/{CONFIG}/1/rollout.safetensors",
    ):
        assert not store.exists(bad_key)
    assert not sentinel.exists()


def test_cache_ls_checks_what_a_load_checks(tmp_path):
    sentinel, dump, root = poisoned_cache(tmp_path)
    quick = {entry.step: entry.valid for entry in scan(str(dump))}
    assert quick == {1: True, 2: False, 3: False, 4: True}  # step 4's marker vouches for the pickle's size
    verified = {entry.step: (entry.valid, entry.reason) for entry in scan(str(dump), verify=True)}
    assert verified[1] == (True, "") and not verified[4][0] and "undecodable" in verified[4][1]
    assert not sentinel.exists()


def test_a_poisoned_cache_runs_no_code_and_its_steps_regenerate(prefect_api, ray_local, golden, tmp_path):
    sentinel = tmp_path / "pwned"
    dump = copy_dump(golden, tmp_path)
    root = dump / PROJECT / CONFIG
    poison(root, dump, sentinel)
    rows, _, flow_run_id = train_run(golden.overrides, tmp_path / "run", 4, rollout_skip(dump, [1, 2, 3, 4]))
    assert not sentinel.exists()
    assert [row["skip/rollout/hit"] for row in rows] == [1, 0, 0, 0]
    assert [row.get("skip/rollout/rejected") for row in rows] == [None, 1, 1, 1]
    # each poisoned step is a rejected replay (2, 3: Prefect has no record, so the body refuses; 4: the record's
    # read refuses the payload), never Cached, then generated again
    assert generate_states(flow_run_id, 7) == ["Cached"] + ["Failed", "Completed"] * 3
    for before, after in zip(golden.rows, rows):  # the regenerated steps are the golden run's steps
        assert before["actor/pg_loss"] == after["actor/pg_loss"]
    assert all(StepCache(str(root)).status(step).valid for step in (2, 3, 4))  # and were dumped again
    assert not sentinel.exists()


@pytest.mark.slow
def test_replaying_a_copied_entry_needs_no_prefect_record(prefect_api, ray_local, golden, tmp_path):
    """An entry copied in by hand (no Prefect record anywhere) is still a ``Cached`` task run."""
    dump = tmp_path / "dump"
    shutil.copytree(golden.dump / PROJECT / CONFIG / "2", dump / PROJECT / CONFIG / "2")
    rows, states = train(golden.overrides, tmp_path / "run", 2, rollout_skip(dump, [2]))
    assert states == ["Completed", "Cached"] and rows[1]["skip/rollout/hit"] == 1
    assert not (dump / ".prefect").exists()  # and none is written: records are derived from markers
