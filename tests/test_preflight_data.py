"""Bad models, data files and reward scorers end before Prefect or Ray start: exit code 2, one message naming
the key or file, no traceback; a missing model or data file is built or generated only when asked for, and a
custom scorer is called on the first row (bounded by its deadline)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ppoflow.configs import load_config
from ppoflow.flows.preflight import preflight
from ppoflow.workers.models import ensure_model, holds_model
from tests.preflight_helpers import DEMO, assert_user_error, run_cli, run_dir

pytestmark = pytest.mark.reliability


# ------------------------------------------------------------------------------------ models, data


def test_a_hub_id_loads_from_the_hub_cache_and_one_absent_offline_says_so(capsys, monkeypatch, tmp_path, tiny_model):
    """``org/name`` is a Hugging Face hub id, as transformers reads it: never made into ``<cwd>/org/name``; with
    HF_HUB_OFFLINE it loads from the hub cache (a layout built here), and one absent from it is bad input."""
    from huggingface_hub import constants

    from ppoflow.workers.models import load_causal_lm, load_tokenizer

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_model, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # a folder tiny-org/ here would make it a path
    words = ["actor_rollout_ref.model.build=null", run_dir(tmp_path)]
    cfg = load_config("grpo_tiny", ["actor_rollout_ref.model.path=tiny-org/tiny-llama", *words])
    model = cfg.actor_rollout_ref.model
    assert model.path == "tiny-org/tiny-llama"
    preflight(cfg)
    assert load_tokenizer(model).eos_token_id is not None and load_causal_lm(model).config.model_type == "llama"
    code, stderr = run_cli(capsys, *DEMO, "actor_rollout_ref.model.path=tiny-org/absent", *words)
    assert_user_error(
        code,
        stderr,
        "actor_rollout_ref.model.path: 'tiny-org/absent' is a Hugging Face hub id, and HF_HUB_OFFLINE is set but "
        f"the hub cache ({tmp_path}/hub) has no snapshot of it",
    )


def test_a_missing_model_path_is_an_error_unless_building_is_asked_for(capsys, tmp_path, tiny_overrides):
    typo = tmp_path / "modle"
    words = [word for word in tiny_overrides if not word.startswith("actor_rollout_ref.model.path")]
    code, stderr = run_cli(capsys, *DEMO, f"actor_rollout_ref.model.path={typo}", run_dir(tmp_path))  # the demo preset
    assert_user_error(
        code,
        stderr,
        f"actor_rollout_ref.model.path: {str(typo)!r} holds no Hugging Face model",
        "actor_rollout_ref.model.build.seed=0",
    )
    assert not typo.exists()

    cfg = load_config(
        "grpo_tiny", words + [f"actor_rollout_ref.model.path={typo}", "actor_rollout_ref.model.build.seed=1"]
    )
    preflight(cfg)  # the recipe's context length fits; nothing is built yet
    assert not typo.exists()
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    assert capsys.readouterr().out == (
        f"building a random-init tiny Llama into {typo} (actor_rollout_ref.model.build "
        f"is set and {typo} holds no model)\n"
    )
    assert holds_model(str(typo))


def test_a_missing_critic_model(capsys, tmp_path, tiny_overrides):
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        "algorithm.adv_estimator=gae",
        f"critic.model.path={tmp_path}/no_critic",
    )
    assert_user_error(code, stderr, "critic.model.path: ", "critic.model.build.seed=0")


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "config.json is unreadable"),
        ('{"hidden_size": 64}', "is not a Hugging Face model config (a JSON object with a model_type)"),
    ],
)
def test_a_garbage_config_json(capsys, tmp_path, tiny_model, tiny_overrides, content, message):
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "model/config.json").write_text(content)
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"actor_rollout_ref.model.path={tmp_path}/model")
    assert_user_error(code, stderr, "actor_rollout_ref.model.path: ", f"{tmp_path}/model/config.json", message)


def test_a_missing_data_file_is_an_error_unless_generating_is_asked_for(capsys, tmp_path, tiny_model):
    typo = f"{tmp_path}/trian.parquet"
    code, stderr = run_cli(
        capsys,
        *DEMO,
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={typo}",
        f"data.val_files={tmp_path}/val.parquet",
        run_dir(tmp_path),
    )
    assert_user_error(code, stderr, f"data.train_files: no such file {typo!r}", "data.val_files: no such file")


def test_a_zero_byte_parquet(capsys, tmp_path, tiny_overrides):
    (tmp_path / "zero.parquet").write_bytes(b"")
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"data.train_files={tmp_path}/zero.parquet")
    assert_user_error(code, stderr, f"data.train_files: '{tmp_path}/zero.parquet' is not a readable parquet file")


def test_rows_are_tokenized_and_every_source_has_a_scorer(capsys, tmp_path, tiny_overrides):
    rows = [
        {"data_source": "my/task", "prompt": "12>", "reward_model": {"ground_truth": "12"}},
        {"data_source": "synthetic/copy", "prompt": "123456789012>", "reward_model": {"ground_truth": "1"}},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"data.train_files={tmp_path}/rows.jsonl")
    assert_user_error(
        code,
        stderr,
        "data.train_files: row 1 prompt has 13 tokens > data.max_prompt_length=8",
        "data.train_files: no reward scorer for data_source 'my/task'",
    )
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"data.train_files={tmp_path}/rows.jsonl",
        "data.filter_overlong_prompts=true",
        "custom_reward_function.path=ppoflow.algorithms.scoring",
        "custom_reward_function.name=copy_score",
    )
    assert_user_error(code, stderr, "data.train_batch_size: 4 is larger than the 1 train prompts")


def test_a_reward_module_that_raises_on_import(capsys, tmp_path, tiny_overrides):
    (tmp_path / "my_reward.py").write_text("raise RuntimeError('SANDBOX_URL is not set')\n")
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"custom_reward_function.path={tmp_path}/my_reward.py",
    )
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.path: cannot import '{tmp_path}/my_reward.py': RuntimeError: SANDBOX_URL is not set",
    )


BAD_SCORERS = {
    "raises": ("raise KeyError('judge_url')", "raised KeyError: 'judge_url'"),
    "returns_text": ("return '1.0'", "returned a str ('1.0'), not a number or a dict with a number under 'score'"),
    "returns_none": ("return None", "returned None, not a number"),
    "no_score": ("return {'accuracy': 1.0}", "returned a dict without 'score' (keys: 'accuracy')"),
    "exits": ("import os; os._exit(3)", "crashed: its process exited with code 3"),
}


@pytest.mark.parametrize("name", [*BAD_SCORERS, "signature"])
def test_a_custom_scorer_is_called_on_the_first_row(capsys, tmp_path, tiny_overrides, name):
    body, message = BAD_SCORERS.get(
        name, ("return 1.0", "raised TypeError: compute_score() takes 2 positional arguments but 3 were given")
    )
    signature = (  # a scorer may leave out extra_info (verl calls both), not ground_truth
        "data_source, solution_str" if name == "signature" else "data_source, solution_str, ground_truth, extra_info"
    )
    (tmp_path / "my_reward.py").write_text(f"def compute_score({signature}):\n    {body}\n")
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"custom_reward_function.path={tmp_path}/my_reward.py",
    )
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.path: the custom scorer '{tmp_path}/my_reward.py:compute_score' {message}",
        "the first row of data.train_files",
    )
    assert "Connecting to existing Ray cluster" not in stderr


@pytest.mark.parametrize("on_timeout", ["fail", "score"])
def test_a_custom_scorer_that_hangs_on_the_first_row(capsys, tmp_path, tiny_overrides, on_timeout):
    """Bounded by the run's own deadline, whatever on_timeout says; the hung process is gone."""
    (tmp_path / "my_reward.py").write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    open(__file__ + '.pid', 'w').write(str(os.getpid()))\n"
        "    time.sleep(10**9)\n"
    )
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"custom_reward_function.path={tmp_path}/my_reward.py",
        "custom_reward_function.timeout_s=1",
        f"custom_reward_function.on_timeout={on_timeout}",
    )
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.timeout_s: the custom scorer '{tmp_path}/my_reward.py:"
        "compute_score' did not return within custom_reward_function.timeout_s=1 s (its "
        "process was killed) while scoring the first row of data.train_files (data source "
        "'synthetic/copy'), called as the reward stage calls it",
    )
    assert not os.path.exists(f"/proc/{int((tmp_path / 'my_reward.py.pid').read_text())}")


def test_a_custom_scorer_that_exits_while_imported(capsys, tmp_path, tiny_overrides):
    (tmp_path / "my_reward.py").write_text("import os\nos._exit(3)\n")
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"custom_reward_function.path={tmp_path}/my_reward.py",
    )
    assert_user_error(
        code, stderr, "custom_reward_function.path: the custom scorer", "exited with code 3 while importing"
    )


def test_a_working_custom_scorer_passes(tmp_path, tiny_overrides):
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "my_reward.py").write_text(
        "import json\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    open({str(calls)!r}, 'a').write(json.dumps([data_source, solution_str, ground_truth]) + '\\n')\n"
        "    return {'score': 1.0, 'length': len(solution_str)}\n"
    )
    cfg = load_config("grpo_tiny", tiny_overrides + [f"custom_reward_function.path={tmp_path}/my_reward.py"])
    preflight(cfg)  # data.synthetic: the first train row is generated in memory, the file is not written yet
    assert not os.path.exists(cfg.data.train_files)
    ((source, solution, truth),) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert source == "synthetic/copy" and solution == truth and truth.isdigit()
