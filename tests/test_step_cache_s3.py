"""The step cache on S3 (the moto server): entries seen across processes, damage, refused writes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import s3fs

from ppoflow.storage.step_cache import CacheWriteError, StepCache, config_dir, scan
from tests.step_cache_helpers import BUCKET, CONFIG, REPO_ROOT, assert_same_batch, make_batch, write_steps

CHILD_PROCESS = """
import json, sys
from ppoflow.storage.batch import non_tensor_column
from ppoflow.storage.step_cache import StepCache

root, options = sys.argv[1], json.loads(sys.argv[2])
cache = StepCache(root, storage_options=options)
assert cache.valid_steps() == [1], cache.steps()
batch, manifest = cache.load(1)
assert non_tensor_column(batch, "uid") == ["a", "a", "b", "b"]
cache.write(2, batch, meta={"writer": "child"})
"""


def test_s3_round_trip_seen_across_processes(s3_server):
    _, storage_options = s3_server
    root = config_dir(f"s3://{BUCKET}/{uuid.uuid4().hex}/dump", **CONFIG)
    cache = StepCache(root, storage_options=storage_options)
    assert cache.valid_steps() == []  # list before the other process writes
    batch = make_batch(["a", "a", "b", "b"])
    cache.write(1, batch)
    assert cache.valid_steps() == [1]

    child = subprocess.run(
        [sys.executable, "-c", CHILD_PROCESS, root, json.dumps(storage_options)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr

    assert cache.valid_steps() == [1, 2]  # the child's key is not hidden by a listing cache
    loaded, manifest = cache.load(2)
    assert_same_batch(loaded, batch)
    assert manifest["writer"] == "child"


def test_s3_damaged_entries_and_scan(s3_server):
    _, storage_options = s3_server
    dump_dir = f"s3://{BUCKET}/{uuid.uuid4().hex}/dump"
    cache = StepCache(config_dir(dump_dir, **CONFIG), storage_options=storage_options)
    write_steps(cache, [1, 2])
    cache.write_payload(3, make_batch(["a"]))
    s3 = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
    s3.pipe_file(cache.payload_url(2), b"truncated")
    assert cache.valid_steps() == [1]
    assert cache.resolve(2, "repeat") == 1
    assert [(entry.step, entry.valid) for entry in scan(dump_dir, storage_options)] == [
        (1, True),
        (2, False),
        (3, False),
    ]


def test_s3_refused_write_is_retried_then_raises(s3_server):
    _, storage_options = s3_server
    root = config_dir(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/dump", **CONFIG)
    cache = StepCache(root, storage_options=storage_options, write_retries=1, retry_backoff_s=0)
    with pytest.raises(CacheWriteError, match="2 attempts") as raised:
        cache.write(4, make_batch(["a"]))
    assert raised.value.path == cache.payload_url(4)
    assert not cache.status(4).valid
