"""An optional cache store that hangs or disappears in the middle of a run costs warnings and metrics,
never the run: on the real moto S3 server, behind a proxy that acts out the outage."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.flow_runs import rollout_skip, small, train
from tests.outage_proxy import OutageProxy

pytestmark = pytest.mark.reliability

STEPS = 3


@pytest.fixture
def proxy(s3_server):
    endpoint, _ = s3_server
    proxy = OutageProxy(int(endpoint.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


def s3_skip(proxy: OutageProxy, dump: str, **bounds: str) -> dict[str, str]:
    return {
        **rollout_skip(dump, list(range(1, STEPS + 1))),
        "rollout.storage_options": f"{{client_kwargs: {{endpoint_url: '{proxy.endpoint}'}}}}",
        **{f"rollout.{key}": value for key, value in bounds.items()},
    }


def train_with_an_outage(
    proxy: OutageProxy, words: list[str], run: Path, skip: dict[str, str], mode: str
) -> list[dict]:
    """Train :data:`STEPS` steps into ``run``, putting the proxy into ``mode`` as soon as step 1 is logged;
    returns the metrics rows."""
    metrics, stop = run / "metrics.jsonl", threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if metrics.exists() and metrics.read_text().strip():
                proxy.switch(mode)
                return
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    try:
        rows, _ = train(words, run, STEPS, skip)
    finally:
        stop.set()
    return rows


@pytest.mark.slow
def test_a_store_that_hangs_mid_run_is_given_up_on_and_reported(
    prefect_api, ray_local, proxy, tiny_model, tmp_path, caplog
):
    """Steps 2 and 3 find the store hung: each lookup is reported while it lasts, given up at its deadline,
    and the step is computed without the cache (``skip/rollout/read_failed``)."""
    caplog.set_level("WARNING")
    dump = f"s3://ppoflow-test/{uuid.uuid4().hex}/dump"
    rows = train_with_an_outage(
        proxy, small(tmp_path, tiny_model), tmp_path / "run", s3_skip(proxy, dump, timeout_s="6", retries="0"), "stall"
    )
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row.get("skip/rollout/read_failed", 0) for row in rows] == [0, 1, 1]
    assert "still waiting after 5 s" in caplog.text and "did not finish within 6 s" in caplog.text


@pytest.mark.slow
def test_a_store_gone_during_a_replay_costs_only_the_cache(prefect_api, ray_local, proxy, tiny_model, tmp_path, caplog):
    """A replay whose store disappears after step 1 computes steps 2 and 3 itself - exactly as they were
    recorded, since sampling depends only on the seed, the step and the weights."""
    dump = f"s3://ppoflow-test/{uuid.uuid4().hex}/dump"
    recorded, _ = train(small(tmp_path, tiny_model), tmp_path / "record", STEPS, s3_skip(proxy, dump, retries="0"))
    assert [row["skip/rollout/hit"] for row in recorded] == [0, 0, 0]
    caplog.set_level("WARNING")
    replayed = train_with_an_outage(
        proxy,
        small(tmp_path, tiny_model),
        tmp_path / "replay",
        s3_skip(proxy, dump, timeout_s="20", retries="0"),
        "refuse",
    )
    assert [row["skip/rollout/hit"] for row in replayed] == [1, 0, 0]
    assert [row.get("skip/rollout/read_failed", 0) for row in replayed] == [0, 1, 1]
    assert "cache cannot be read" in caplog.text
    for before, after in zip(recorded, replayed):
        assert before["actor/pg_loss"] == after["actor/pg_loss"], before["step"]
