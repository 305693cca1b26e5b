"""What the Prefect UI shows of a run, read through Prefect's API from a real server: task runs named and
tagged for their stage and step, the start-up as task runs, a cache hit's key and the entry it loaded,
the notes a user follows a run by, per-run artifacts (`ppoflow server` itself: tests/test_server.py).

The runs are the session's golden run (dumps steps 1-4, validates at steps 0 and 4) and one replay of
its cache made here."""

from __future__ import annotations

import json
import time

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import TaskRunSort

from tests.conftest import drain_prefect_logs
from tests.flow_runs import CONFIG, PROJECT, copy_dump, train_run

SLUG = "ppoflow-grpo-tiny"


def task_runs(flow_run_id, expected: int) -> list:
    """The flow run's task runs once the server has recorded ``expected`` of them, all final."""
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
                limit=200,
            )
            if len(runs) >= expected and all(run.state and run.state.is_final() for run in runs):
                return runs
            assert time.monotonic() < deadline, f"{len(runs)} task runs of {expected}"
            time.sleep(0.5)


def logs(flow_run_id) -> list:
    """Every log line of the flow run and its task runs, as the server holds them."""
    drain_prefect_logs()
    found: list = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(found)
        ):
            found += page
    return found


def artifacts(flow_run_id) -> dict:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {artifact.key: artifact for artifact in found if artifact.key}  # keyed: not the validation tables


@pytest.fixture(scope="module")
def replay(golden, prefect_server, tmp_path_factory):
    """The golden cache replayed for steps 1-2, without validation."""
    from tests.conftest import prefect_settings

    tmp_path = tmp_path_factory.mktemp("ui-replay")
    dump = copy_dump(golden, tmp_path)
    skip = {**golden.skip, "rollout.dump_dir": str(dump), "reward.dump_dir": str(dump)}
    with prefect_settings(prefect_server):
        _, states, flow_run_id = train_run(golden.overrides, tmp_path / "run", 2, skip)
        runs = task_runs(flow_run_id, 2 + 2 * 4)
        return dump, flow_run_id, runs, logs(flow_run_id), artifacts(flow_run_id)


def test_a_flow_run_started_without_its_tags_gets_them(prefect_api, golden):
    """The golden run calls the flow directly, as a deployment's run does, so it was created untagged: the
    flow tags itself with the experiment, preset and mode (one request)."""
    with get_client(sync_client=True) as client:
        tags = set(client.read_flow_run(golden.flow_run_id).tags)
    assert {"experiment:grpo_tiny", "preset:grpo_tiny", "mode:sync"} <= tags


def test_task_runs_are_named_and_tagged_for_their_stage_and_step(prefect_api, golden):
    runs = task_runs(golden.flow_run_id, 2 + 4 * 4 + 2 * 2)  # start-up, 4 stages x 4 steps, 2 validations
    names = [run.name for run in runs]
    assert names[:2] == ["load_data", "start_workers"]  # the start-up is on the timeline, first
    for step in (1, 2, 3, 4):
        for stage in ("generate", "reward", "advantage", "update_actor"):
            assert f"{stage}[step={step}]" in names
    for step in (0, 4):
        assert {f"generate[val@{step}]", f"reward[val@{step}]"} <= set(names)
    by_name = {run.name: run for run in runs}
    assert set(by_name["generate[step=3]"].tags) == {
        "stage:generate",
        "kind:train",
        "mode:sync",
        "experiment:grpo_tiny",
    }
    assert "kind:validation" in by_name["reward[val@0]"].tags
    assert all(not run.name.startswith("weight_sync") for run in runs)  # colocated: no weights to move


def test_a_steps_task_runs_record_the_task_run_each_input_came_from(prefect_api, golden):
    """The Task inputs tab and the run graph's edges: each stage's batch from the stage before it; the start-up's
    results link only to the first task run taking them (step 0's validation), later ones name their origin."""
    by_name = {run.name: run for run in task_runs(golden.flow_run_id, 2 + 4 * 4 + 2 * 2)}

    def came_from(name: str, parameter: str) -> list[str]:
        ids = {run.id: other for other, run in by_name.items()}
        return [ids[link.id] for link in by_name[name].task_inputs[parameter] if link.input_type == "task_run"]

    def shown(name: str, parameter: str) -> list[str]:
        return [link.type for link in by_name[name].task_inputs[parameter] if link.input_type == "constant"]

    assert came_from("generate[val@0]", "prompts") == ["load_data"]  # the first use links
    assert came_from("generate[val@0]", "workers") == ["start_workers"]
    assert came_from("reward[step=3]", "batch") == ["generate[step=3]"]
    assert came_from("advantage[step=3]", "batch") == ["reward[step=3]"]
    assert came_from("update_actor[step=3]", "batch_ref") == ["advantage[step=3]"]
    for name, parameter in (
        ("generate[step=3]", "prompts"),
        ("generate[step=3]", "workers"),
        ("reward[step=3]", "tokenizer"),
        ("update_actor[step=3]", "workers"),
        ("generate[val@4]", "prompts"),
        ("reward[val@0]", "tokenizer"),
    ):
        assert came_from(name, parameter) == [], (name, parameter)
    assert shown("generate[step=3]", "prompts") == ["TensorDict of 4 from load_data"]
    assert shown("generate[step=3]", "workers") == ["Workers from start_workers"]
    assert shown("update_actor[step=3]", "workers") == ["Workers from start_workers"]
    (tokenizer,) = shown("reward[step=3]", "tokenizer")
    assert tokenizer.endswith(" from load_data")


def run_graph(flow_run_id) -> tuple[dict, list[tuple[str, str]]]:
    """The flow run's graph as the UI reads it (``GET /flow_runs/{id}/graph-v2``): its nodes by id and its
    edges as (parent, child) task run names, as often as the API lists them."""
    with get_client(sync_client=True) as client:
        response = client.request("GET", "/flow_runs/{id}/graph-v2", path_params={"id": flow_run_id})
    response.raise_for_status()
    nodes = {node["id"]: node for _, node in response.json()["nodes"]}
    return nodes, [
        (nodes[parent["id"]]["label"], node["label"]) for node in nodes.values() for parent in node["parents"]
    ]


def test_the_run_graph_holds_the_steps_data_flow_not_a_fan_out_from_the_start_up(prefect_api, golden):
    """O(steps) edges: within a step, stage to stage; from the start-up, only to the first task run."""
    task_runs(golden.flow_run_id, 2 + 4 * 4 + 2 * 2)
    nodes, edges = run_graph(golden.flow_run_id)
    distinct = set(edges)
    assert len(nodes) == 2 + 4 * 4 + 2 * 2
    assert {child for parent, child in distinct if parent in ("load_data", "start_workers")} == {"generate[val@0]"}
    for step in (1, 2, 3, 4):
        assert {
            (f"generate[step={step}]", f"reward[step={step}]"),
            (f"reward[step={step}]", f"advantage[step={step}]"),
            (f"advantage[step={step}]", f"update_actor[step={step}]"),
        } <= distinct
    assert len(distinct) < len(nodes)  # 3 a step, 1 a validation, 2 from the start-up
    assert len(edges) <= 6 * len(nodes)  # Prefect lists an edge once per input of its parent


def test_a_task_runs_other_inputs_say_what_they_were(prefect_api, golden):
    """No input of any task run is an empty list: what links to no task run is a ``constant`` input
    naming its value (a step number, a flag) or its size or type."""
    runs = task_runs(golden.flow_run_id, 2 + 4 * 4 + 2 * 2)
    for run in runs:
        for parameter, inputs in run.task_inputs.items():
            assert inputs, f"{run.name}: {parameter} is empty"
    by_name = {run.name: run for run in runs}

    def shown(name: str, parameter: str) -> list[str]:
        return [getattr(link, "type", "<link>") for link in by_name[name].task_inputs[parameter]]

    assert shown("generate[step=3]", "step") == ["int 3"]
    assert shown("generate[step=3]", "sampling") == ["SamplingParams"]
    assert shown("generate[val@4]", "step") == ["int 4"]
    assert shown("update_actor[step=3]", "step") == ["int 3"]
    assert shown("advantage[step=3]", "algorithm") == ["AlgorithmConfig"]
    assert shown("reward[step=3]", "ray_chunks") == ["int 0"]
    assert shown("reward[step=3]", "dump") == ["StepDump"]  # the step cache's target: reward is dumped
    assert shown("load_data", "cfg") == ["PPOConfig"]


def test_a_cache_hit_shows_its_key_and_the_entry_it_loaded(prefect_api, replay):
    dump, flow_run_id, runs, lines, _ = replay
    hit = next(run for run in runs if run.name == "generate[step=2]")
    assert hit.state.name == "Cached"
    assert hit.tags == []  # trainer.task_run_tags is off by default
    assert hit.cache_key == f"{PROJECT}/{CONFIG}/2/meta.json"
    said = [line.message for line in lines if line.task_run_id == hit.id]
    assert f"checking the cache entry {dump}/{PROJECT}/{CONFIG}/2/meta.json, to replay it" in said
    assert any(
        message.startswith("cached rollout of step 2: 16 trajectories, written ")
        and message.endswith("sampled with weight versions 1-1")
        for message in said
    ), said


def test_a_miss_logs_where_it_wrote(prefect_api, golden):
    runs = task_runs(golden.flow_run_id, 22)
    miss = next(run for run in runs if run.name == "reward[step=3]")
    assert miss.cache_key == f"{PROJECT}/{CONFIG}/3/reward.meta.json"
    said = [line.message for line in logs(golden.flow_run_id) if line.task_run_id == miss.id]
    assert f"wrote the reward of step 3 to {golden.dump}/{PROJECT}/{CONFIG}/3/reward.safetensors" in said


def test_the_flow_run_logs_hold_what_a_user_follows_the_run_by(prefect_api, golden):
    said = [line.message for line in logs(golden.flow_run_id) if line.task_run_id is None]
    for start in (
        "loaded the tokenizer and data in ",
        "started the workers (actor+rollout) in ",
        "step 0 validation: val-core/",
        "step 4 validation: val-core/",
        "trained policy written to ",
        "reward curve written to ",
    ):
        assert any(message.startswith(start) for message in said), start
    assert any("samples: '" in message for message in said)


def test_artifacts_are_per_run_and_compact(prefect_api, golden, replay):
    _, replay_run, _, _, replayed = replay
    golden_artifacts = artifacts(golden.flow_run_id)
    (summary_key,) = [key for key in golden_artifacts if key.endswith("-summary")]
    prefix = summary_key.removesuffix("-summary")
    assert prefix.startswith(f"{SLUG}-") and prefix != SLUG  # the run's name is in the key
    assert {f"{prefix}-progress", f"{prefix}-metrics", f"{prefix}-config", f"{SLUG}-latest"} <= set(golden_artifacts)
    assert not set(golden_artifacts) & {key for key in replayed if key != f"{SLUG}-latest"}  # no overwrites

    summary = golden_artifacts[summary_key].data
    assert "data:image/png;base64," in summary and "<details>" not in summary and "```yaml" not in summary
    assert f"`{golden.root}/run/global_step_4/actor/huggingface`" in summary  # the final model, which exists
    assert len(summary.encode()) < 200_000
    assert "```yaml" in golden_artifacts[f"{prefix}-config"].data
    table = json.loads(golden_artifacts[f"{prefix}-metrics"].data)
    assert [row["step"] for row in table] == [1, 2, 3, 4]

    with get_client(sync_client=True) as client:  # the latest version of "<slug>-latest" names the newest run
        (latest,) = client.read_latest_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{SLUG}-latest"]))
        )
        replay_name = client.read_flow_run(replay_run).name
    assert f"latest run `{replay_name}`" in latest.data


def test_constant_inputs_are_described_by_value_size_or_type():
    import torch
    from tensordict import TensorDict

    from ppoflow.tasks.task_inputs import describe
    from ppoflow.workers.rollout.sampling import SamplingParams

    assert [describe(value) for value in (12, False, 0.5, None, "val", "x" * 41)] == [
        "int 12",
        "bool False",
        "float 0.5",
        "None",
        "str 'val'",
        "str of 41 characters",
    ]
    assert describe(TensorDict({"a": torch.zeros(128, 2)}, batch_size=[128])) == "TensorDict of 128"
    assert describe([1, 2, 3]) == "list of 3"
    assert describe(SamplingParams(8, 1.0, 1.0, 0, True, 16, 0)) == "SamplingParams"


def test_a_submitted_task_run_records_its_plain_inputs_too(prefect_api):
    """One-step-off submits generation as a future; its run records the same inputs as a called one."""
    from prefect import flow

    from ppoflow.tasks.task_inputs import recorded_task

    @recorded_task(name="probe")
    def probe(step: int, texts: list[str]) -> int:
        return step

    @flow
    def probing() -> int:
        first = probe.submit(7, ["a", "b"])
        return probe.with_options(task_run_name="probe[again]")(first, ["c"]) + first.result()

    state = probing(return_state=True)
    assert state.result() == 14
    runs = {run.name: run for run in task_runs(state.state_details.flow_run_id, 2)}
    submitted = next(run for name, run in runs.items() if name != "probe[again]")
    assert [link.type for link in submitted.task_inputs["step"]] == ["int 7"]
    assert [link.type for link in submitted.task_inputs["texts"]] == ["list of 2"]
    again = runs["probe[again]"]
    assert [link.id for link in again.task_inputs["step"]] == [submitted.id]  # a link stays a link only
    assert [link.type for link in again.task_inputs["texts"]] == ["list of 1"]


def test_a_start_up_result_links_to_its_first_taker_only(prefect_api):
    """Later takers of a start-up task's result (by its name, ``load_data``) record where it came from."""
    from prefect import flow

    from ppoflow.tasks.task_inputs import recorded_task

    @recorded_task(name="load_data")
    def load() -> list[str]:
        return ["a", "b"]

    @recorded_task(name="use")
    def use(step: int, texts: list[str]) -> int:
        return step

    @flow
    def probing() -> int:
        texts = load()
        return use.named("use[1]")(1, texts) + use.named("use[2]").submit(2, texts).result()

    state = probing(return_state=True)
    assert state.result() == 3
    runs = {run.name: run for run in task_runs(state.state_details.flow_run_id, 3)}
    loaded = next(run for name, run in runs.items() if name.startswith("load_data"))
    assert [link.id for link in runs["use[1]"].task_inputs["texts"]] == [loaded.id]
    assert [(link.input_type, getattr(link, "type", None)) for link in runs["use[2]"].task_inputs["texts"]] == [
        ("constant", "list of 2 from load_data")
    ]
    assert [link.type for link in runs["use[2]"].task_inputs["step"]] == ["int 2"]
