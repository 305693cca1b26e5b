"""The rollout service's per-sample cache (verl's ``skip.async_rollout``): sample ids, entries on local and
S3 storage, what a lookup refuses, and a run that replays part of its samples and generates the rest."""

from __future__ import annotations

import asyncio
import logging
import pickle
import uuid

import pytest

from ppoflow.flows.tracking import read_metrics
from ppoflow.storage.fs import open_fs
from ppoflow.storage.step_cache.sample_cache import SampleCache, feed_index, sample_id
from ppoflow.workers.service.agent_loop import AgentLoopOutput, outputs_to_batch
from tests.conftest import S3_TEST_BUCKET

SAMPLING = {"n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True, "max_new_tokens": 6, "seed": 3}
MODELS = {"model": "sha256:m", "tokenizer": "sha256:t"}


@pytest.mark.parametrize("text, index", [("sample_0_1", 1), ("sample_3_42", 42), ("uid_sample_1_7", 7)])
def test_sample_ids_name_the_feed_index(text, index):
    assert feed_index(text) == index
    assert feed_index(sample_id(2, index)) == index


@pytest.mark.parametrize(
    "text",
    [
        "bad_id",
        "sample_1",
        "sample_0_1_2",
        "Sample_0_1",
        "uid_uid_sample_0_1",
        "sample_0_007",
        "sample_0_+3",
        "sample_0_-1",
        "sample_0_ 5",
        "sample_x_5",
        "sample_0_0",
        "sample_0_abc",
    ],
)
def test_malformed_sample_ids_are_refused(text):
    """verl accepts some of these (``sample_0_007`` as 7, ``sample_x_5``); a cache key must be unambiguous."""
    with pytest.raises(ValueError, match="invalid sample id"):
        feed_index(text)


def multi_turn_group(prompt_ids: list[int]):
    """Two trajectories of one prompt: one calls a tool (its answer masked), one answers at once."""
    called = AgentLoopOutput(
        list(prompt_ids),
        response_ids=[5, 6, 7, 8, 9],
        response_mask=[1, 0, 0, 1, 1],
        response_log_probs=[-0.5, 0.0, 0.0, -0.25, -0.125],
        turn_ids=[1, -1, -1, 2, 2],
        num_turns=3,
        tool_calls=1,
        weight_versions=(4, 4),
    )
    direct = AgentLoopOutput(
        list(prompt_ids),
        response_ids=[9, 2],
        response_mask=[1, 1],
        response_log_probs=[-1.0, -2.0],
        turn_ids=[1, 1],
        num_turns=1,
        weight_versions=(4, 4),
    )
    return outputs_to_batch(
        [called, direct], prompt_width=len(prompt_ids), response_width=6, pad_token_id=0, weight_version=4
    )


def make_cache(root: str, options: dict, **settings) -> SampleCache:
    return SampleCache(
        root,
        **{
            "indexes": [1, 2, 3, 5],
            "action": "cache",
            "storage_options": options,
            "timeout_s": 30,
            "retries": 1,
            "allow_mismatch": False,
            "models": MODELS,
            "max_entry_bytes": 1 << 20,
            **settings,
        },
    )


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    """``(root, storage options)`` of an empty cache directory on local disk or the moto S3 server."""
    if request.param == "local":
        return str(tmp_path / "samples" / "GBS1_N2_in8_out6"), {}
    _, options = request.getfixturevalue("s3_server")
    return f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}/samples/GBS1_N2_in8_out6", {
        **options,
        "use_listings_cache": False,
    }


def test_a_group_round_trips_with_its_turns_and_masks(storage):
    root, options = storage
    cache = make_cache(root, options)
    group = multi_turn_group([3, 4])
    assert cache.lookup("sample_0_1", [3, 4], SAMPLING).outcome == "miss"
    assert cache.dump("sample_0_1", [3, 4], SAMPLING, group, meta={"train_step": 1})
    found = cache.lookup("sample_0_1", [3, 4], SAMPLING)
    assert found.outcome == "hit"
    for name in group.keys():
        assert found.group[name].tolist() == group[name].tolist(), name
    assert found.group["turn_ids"][0].tolist() == [1, -1, -1, 2, 2, 0]
    # the seed is not part of how a sample was drawn: another seed replays it
    assert cache.lookup("sample_0_1", [3, 4], {**SAMPLING, "seed": 9}).outcome == "hit"
    manifest = cache.entries.manifest(1)
    assert manifest["sample_id"] == "sample_0_1" and manifest["train_step"] == 1 and manifest["model"] == "sha256:m"


def test_a_lookup_refuses_what_this_run_would_not_sample(storage, caplog):
    root, options = storage
    cache = make_cache(root, options)
    cache.dump("sample_0_2", [3, 4], SAMPLING, multi_turn_group([3, 4]), meta={})
    with caplog.at_level(logging.WARNING):
        assert cache.lookup("sample_0_2", [3, 5], SAMPLING).outcome == "miss"  # another prompt at this index
        assert cache.lookup("sample_0_2", [3, 4], {**SAMPLING, "temperature": 0.5}).outcome == "miss"
    assert "prompt:" in caplog.text and "sampling.temperature: 1.0 recorded, 0.5 here" in caplog.text
    assert (
        make_cache(root, options, allow_mismatch=True)
        .lookup("sample_0_2", [3, 4], {**SAMPLING, "temperature": 0.5})
        .outcome
        == "hit"
    )
    assert not cache.covers("sample_0_4") and cache.covers("sample_7_5")
    # repeat: the nearest index below (then above), whatever its prompt (verl's implicit remap)
    repeat = make_cache(root, options, action="repeat")
    assert repeat.lookup("sample_0_3", [1, 1], SAMPLING).outcome == "hit"
    assert repeat.lookup("sample_0_1", [1, 1], SAMPLING).group["prompts"].tolist() == [[3, 4], [3, 4]]


def test_damaged_or_planted_entries_are_never_decoded(storage, tmp_path):
    """A payload changed after its marker, and a pickle a forged marker vouches for: both are generated
    again, and nothing in them runs."""
    root, options = storage
    cache = make_cache(root, options)
    group = multi_turn_group([3, 4])
    cache.dump("sample_0_1", [3, 4], SAMPLING, group, meta={})
    fs, path = open_fs(cache.entries.payload_url(1), options)
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 1
    fs.pipe_file(path, bytes(data))
    assert cache.lookup("sample_0_1", [3, 4], SAMPLING).outcome == "miss"

    ran = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    planted = pickle.dumps(Exploit())
    manifest = cache.entries.write_payload(2, group, meta=cache._requires([3, 4], SAMPLING))
    manifest["files"] = {
        name: {"bytes": len(planted), "sha256": __import__("hashlib").sha256(planted).hexdigest()}
        for name in manifest["files"]
    }
    fs.pipe_file(open_fs(cache.entries.payload_url(2), options)[1], planted)
    cache.entries.write_marker(2, manifest)
    assert cache.lookup("sample_0_2", [3, 4], SAMPLING).outcome == "miss"
    assert not ran.exists()


def test_unreachable_storage_costs_a_warning_not_the_run(caplog):
    options = {
        "key": "x",
        "secret": "y",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
    }
    cache = make_cache("s3://nowhere/samples", options, timeout_s=5, retries=0)
    with caplog.at_level(logging.WARNING):
        assert cache.lookup("sample_0_1", [3, 4], SAMPLING).outcome == "read_failed"
        assert not cache.dump("sample_0_1", [3, 4], SAMPLING, multi_turn_group([3, 4]), meta={})
    assert "cannot be read" in caplog.text and "could not cache sample_0_1" in caplog.text


@pytest.mark.slow  # ~30 s of training: the slow suite (scripts/test_slow.sh)
def test_a_step_partly_cached_generates_only_the_rest(prefect_api, ray_local, tiny_model, tmp_path):
    """Two steps of the vault task (multi-turn, tool calls) with every sample cached; then two samples'
    entries are removed and the run repeated: each step replays 3 of its 4 prompts, generates the fourth
    again, records it again, and trains exactly as the first run did."""
    from ppoflow.flows.train import ppo_train

    dump_dir = tmp_path / "dump"
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=64",
        "data.synthetic.copy_share=0",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        "skip.async_rollout.enable=true",
        f"skip.async_rollout.dump_dir={dump_dir}",
        "skip.async_rollout.steps=[1,2,3,4,5,6,7,8]",
    ]
    first = ppo_train(
        config="vault_tool", overrides=[*overrides, f"trainer.default_local_dir={tmp_path}/run1"], return_state=True
    )
    assert first.is_completed(), first
    markers = sorted(dump_dir.rglob("async_rollout.meta.json"))
    assert [int(marker.parent.name) for marker in markers] == sorted(range(1, 9), key=str)
    for index in (2, 7):  # one sample of each step
        next(marker for marker in markers if marker.parent.name == str(index)).unlink()

    second = ppo_train(
        config="vault_tool", overrides=[*overrides, f"trainer.default_local_dir={tmp_path}/run2"], return_state=True
    )
    assert second.is_completed(), second
    rows1, rows2 = read_metrics(str(tmp_path / "run1")), read_metrics(str(tmp_path / "run2"))
    assert [row["skip/async_rollout/hit"] for row in rows1] == [0.0, 0.0]
    assert [row["skip/async_rollout/hit"] for row in rows2] == [0.75, 0.75]
    assert len(list(dump_dir.rglob("async_rollout.meta.json"))) == 8  # the regenerated samples recorded again
    for name in (
        "critic/score/mean",
        "response_length/mean",
        "agent/tool_calls/mean",
        "actor/pg_loss",
        "actor/grad_norm",
    ):
        assert [row[name] for row in rows2] == pytest.approx([row[name] for row in rows1], rel=1e-5), name


def test_the_sample_cache_needs_the_rollout_service():
    from ppoflow.configs import ConfigError, load_config

    with pytest.raises(ConfigError) as raised:
        load_config("grpo_tiny", ["skip.async_rollout.enable=true", "skip.async_rollout.steps=[1]"])
    assert (
        "skip.async_rollout.enable",
        "caches the rollout service's samples: it needs actor_rollout_ref.rollout.mode=async",
    ) in raised.value.problems
    load_config(
        "grpo_tiny",
        ["skip.async_rollout.enable=true", "skip.async_rollout.steps=[1]", "actor_rollout_ref.rollout.mode=async"],
    )


def test_a_replayed_group_stands_in_for_a_fresh_one(tiny_model, tmp_path):
    """A group recorded under weight version 4 and replayed while the replicas serve version 9 carries 9 as
    both its oldest and its newest version (its marker keeps 4), so spans and staleness count it as fresh."""
    from ppoflow.configs import load_config
    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.service.agent_worker import AgentLoopWorker

    cfg = load_config(
        "grpo_tiny",
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=6",
            "skip.async_rollout.enable=true",
            f"skip.async_rollout.dump_dir={tmp_path}",
            "skip.async_rollout.steps=[1]",
        ],
    )
    worker = AgentLoopWorker(cfg, replicas=[])  # a hit never reaches a replica
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, max_new_tokens=6, seed=3)
    worker.sample_cache.dump("sample_0_1", [3, 4], sampling.as_dict(), multi_turn_group([3, 4]), meta={})
    group, outcome = asyncio.run(
        worker.group(
            [3, 4],
            "single_turn_agent",
            sampling,
            step=1,
            position=0,
            session="s",
            weight_version=9,
            tools_kwargs=None,
            sample="sample_0_1",
            source=None,
            truth=None,
        )
    )
    assert outcome == "hit"
    assert group["weight_version"].tolist() == group["max_weight_version"].tolist() == [9, 9]
    assert multi_turn_group([3, 4])["max_weight_version"].tolist() == [4, 4]  # what was recorded
