"""Names that become paths (trainer.project_name, trainer.experiment_name): one directory name or refused, on
the command line and in the deployment's form; a NUL byte in a path is a problem, not a crash."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.schema import PATH_NAME_RULE
from tests.config_helpers import only_problem, problems_of

# ------------------------------------------------------------------ names that become paths


SAFE_NAMES = ["grpo_tiny", "Art Test_1", "qwen2.5-7b+lr=1e-6@a100,b", "_x", "7", "a" * 100]
UNSAFE_NAMES = [
    "../../../somewhere",
    "a/b",
    "a\\b",
    "..",
    ".",
    ".hidden",
    "-rf",
    "",
    " lead",
    "trail ",
    "a" * 101,
    "tab\there",
    "nul\x00byte",
    "new\nline",
    "é",
]


@pytest.mark.parametrize("name", SAFE_NAMES)
def test_safe_names_become_one_directory(name):
    cfg = load_config(
        "grpo_tiny", [f"trainer.project_name={json.dumps(name)}", f"trainer.experiment_name={json.dumps(name)}"]
    )
    assert cfg.trainer.experiment_name == name
    assert cfg.trainer.default_local_dir == str(Path(f"checkpoints/{name}/{name}").absolute())


@pytest.mark.reliability
@pytest.mark.parametrize("key", ["trainer.experiment_name", "trainer.project_name"])
@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_names_that_would_leave_their_directory_are_refused(key, name):
    problems = problems_of("grpo_tiny", [f"{key}={json.dumps(name)}"])  # YAML reads JSON's escapes (\t, \u0000)
    assert (key, f"must be one directory name: {PATH_NAME_RULE} (got {name!r})") in problems
    # the run directory is built from the name: a NUL byte makes it no path either
    assert [other for other, _ in problems if other != key] == (["trainer.default_local_dir"] if "\0" in name else [])


@pytest.mark.reliability
def test_a_nul_byte_in_a_path_is_a_problem_not_a_crash():
    assert only_problem(['data.train_files="/data/a\\u0000b.parquet"']) == (
        "data.train_files",
        "is not a path: embedded null byte (got '/data/a\\x00b.parquet')",
    )


@pytest.mark.reliability
def test_the_command_line_refuses_a_name_outside_the_checkpoint_root(capsys, tmp_path):
    from tests.preflight_helpers import assert_user_error, run_cli

    code, stderr = run_cli(capsys, "config", "trainer.experiment_name=../../../somewhere")
    assert_user_error(code, stderr, "trainer.experiment_name: must be one directory name", "'../../../somewhere'")


@pytest.mark.reliability
def test_the_ui_forms_experiment_name_is_checked_before_the_run_starts():
    from ppoflow.flows.train import ppo_train

    with pytest.raises(ConfigError) as caught:  # the flow's body: what a run from the deployment's form calls
        ppo_train.fn(config="grpo_tiny", experiment_name="../../../somewhere")
    assert caught.value.problems == [
        ("trainer.experiment_name", f"must be one directory name: {PATH_NAME_RULE} (got '../../../somewhere')")
    ]


def test_the_ui_form_refuses_a_name_that_is_not_one_directory():
    """The deployment's form carries the rule itself (Prefect validates a run's parameters against it)."""
    from prefect.utilities.callables import parameter_schema

    from ppoflow.configs.schema import PATH_NAME_PATTERN
    from ppoflow.flows.train import ppo_train

    field = parameter_schema(ppo_train.fn).model_dump()["properties"]["experiment_name"]
    assert PATH_NAME_PATTERN in json.dumps(field)
    assert re.fullmatch(PATH_NAME_PATTERN, "run 7") and not re.fullmatch(PATH_NAME_PATTERN, "../x")
