"""The profiler (verl's ``global_profiler`` / ``<role>.profiler``) in the Ray workers of a real flow run, and the
validation samples' table on the page of the task run that scored them."""

from __future__ import annotations

import gzip
import json
import time
from types import SimpleNamespace

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.dumps import read_dump
from ppoflow.flows.train import ppo_train
from tests.conftest import prefect_settings, small_run
from tests.flow_runs import task_runs_by_name

ACTOR = "actor_rollout_ref.actor.profiler"
ROLLOUT = "actor_rollout_ref.rollout.profiler"


@pytest.fixture(scope="module")
def profiled(prefect_server, ray_local, tiny_model, tmp_path_factory):
    """A 2-step flow run on Ray with a rollout worker of its own, whose actor and rollout are profiled at step 1
    (torch profiler, CPU), validating before training and at step 2, dumping its generations, logging to
    TensorBoard and verl's file logger."""
    root = tmp_path_factory.mktemp("profiled")
    words = small_run(tiny_model, root) + [
        "actor_rollout_ref.hybrid_engine=false",
        "global_profiler.tool=torch",
        "global_profiler.steps=[1]",
        f"{ACTOR}.enable=true",
        f"{ROLLOUT}.enable=true",
        f"{ROLLOUT}.tool_config.torch.contents=[cpu]",
        f"trainer.validation_data_dir={root}/val",
        f"trainer.rollout_data_dir={root}/rollouts",
        "trainer.logger=[tensorboard,file]",
    ]
    with prefect_settings(prefect_server), pytest.MonkeyPatch.context() as environment:
        environment.setenv("VERL_FILE_LOGGER_ROOT", str(root / "files"))
        state = ppo_train(config="grpo_tiny", overrides=words, return_state=True)
        assert state.is_completed(), state
        flow_run_id = state.state_details.flow_run_id
        artifacts = read_artifacts(flow_run_id, lambda found: sum(a.type == "table" for a in found) >= 3)
        task_runs = task_runs_by_name(flow_run_id, ["reward[val@0]", "reward[val@2]"])
    return SimpleNamespace(root=root, run=root / "run", artifacts=artifacts, task_runs=task_runs)


def read_artifacts(flow_run_id, enough) -> list:
    """The flow run's artifacts, once ``enough(artifacts)`` (they reach the API asynchronously)."""
    with get_client(sync_client=True) as client:
        for _ in range(100):
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
            if enough(found):
                return found
            time.sleep(0.2)
    raise AssertionError(f"artifacts of flow run {flow_run_id}: {[(a.key, a.type) for a in found]}")


def trace_events(path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def test_one_step_of_each_profiled_role_is_traced_and_linked_from_the_summary(profiled):
    profile = profiled.run / "profile"
    assert sorted(str(p.relative_to(profile)) for p in profile.rglob("*") if p.is_file()) == [
        "step1/actor_rank0.json.gz",
        "step1/rollout_rank0.json.gz",
    ]  # step 2 is not profiled; every role process writes its own file
    actor = trace_events(profile / "step1" / "actor_rank0.json.gz")
    (update,) = [event for event in actor if event.get("name") == "actor_update" and event.get("ph") == "X"]
    inside = [
        event["name"]
        for event in actor
        if event.get("ph") == "X" and update["ts"] <= event["ts"] <= update["ts"] + update["dur"]
    ]
    assert any(name.startswith("autograd::engine::evaluate_function") for name in inside)  # the backward
    assert "aten::mm" in inside and "Optimizer.step#AdamW.step" in inside
    rollout = trace_events(profile / "step1" / "rollout_rank0.json.gz")
    names = {event.get("name") for event in rollout}
    assert "rollout_generate" in names and "actor_update" not in names
    assert not any("Input Dims" in event.get("args", {}) for event in rollout)  # contents=[cpu]: no shapes

    assert f"| profiler traces (2 files) | `{profile}` |" in summary(profiled)


def summary(profiled) -> str:
    (found,) = [artifact for artifact in profiled.artifacts if (artifact.key or "").endswith("-summary")]
    return found.data


def test_the_summary_links_the_trackers_and_the_dumps(profiled):
    rows = summary(profiled)
    assert f"| file run | `{profiled.root}/files/ppoflow/grpo_tiny.jsonl` |" in rows
    assert f"| tensorboard | `{profiled.run}/tensorboard` |" in rows
    assert f"| rollout dumps | `{profiled.root}/rollouts` |" in rows
    assert f"| validation dumps | `{profiled.root}/val` |" in rows


def test_each_validation_shows_its_samples_on_the_task_run_that_scored_them(profiled):
    tables = [artifact for artifact in profiled.artifacts if artifact.type == "table"]
    for step in (0, 2):
        scorer = profiled.task_runs[f"reward[val@{step}]"]
        (table,) = [artifact for artifact in tables if artifact.task_run_id == scorer.id]
        assert table.description.endswith(f"validation samples at step {step}")
        rows = json.loads(table.data)
        dumped = read_dump(str(profiled.root / "val"), step)[:3]  # the same samples, as the dump holds them
        assert [row["prompt"] for row in rows] == [line["input"] for line in dumped]
        assert [row["response"] for row in rows] == [repr(line["output"]) for line in dumped]
        assert [row["score"] for row in rows] == pytest.approx([line["score"] for line in dumped], abs=1e-4)


STEP_1 = "global_profiler.steps=[1]"


@pytest.mark.parametrize(
    "words, key",
    [
        ([STEP_1, "global_profiler.tool=torch"], "global_profiler.steps"),  # no role enabled
        ([STEP_1, f"{ACTOR}.enable=true"], "global_profiler.tool"),  # no tool
        ([STEP_1, "global_profiler.tool=torch_memory", f"{ACTOR}.enable=true"], "global_profiler.tool"),  # on CPU
        ([STEP_1, "global_profiler.tool=torch", f"{ROLLOUT}.enable=true"], f"{ROLLOUT}.enable"),  # the actor's
        (["global_profiler.tool=nsys"], "global_profiler.tool"),
        (["trainer.profile_steps=[1]"], "trainer.profile_steps"),  # verl's older key: renamed
    ],
)
def test_a_profile_that_cannot_be_made_is_a_config_error(words, key):
    with pytest.raises(ConfigError) as error:
        load_config("grpo_tiny", words)
    assert [problem[0] for problem in error.value.problems] == [key]
