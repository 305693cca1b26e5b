"""A user's own trainer modes, registered from a file: its hooks run in a real run, it is in the deployment
form's choices, and a file that does not import, a mode that needs the rollout service without it and an
unknown mode are config errors."""

from __future__ import annotations

import json

import pytest

from ppoflow.configs import ConfigError, load_config

MODE_FILE = '''
import json
from ppoflow.flows.modes import SyncTrainer, register_trainer

@register_trainer("recording_sync")
class RecordingSync(SyncTrainer):
    """sync, writing down every hook it sees."""

    def note(self, hook, step=None):
        with open({log!r}, "a") as log:
            log.write(json.dumps([hook, step]) + "\\n")

    def on_init_end(self): self.note("on_init_end")
    def on_train_begin(self, steps): self.note("on_train_begin")
    def on_step_begin(self, step): self.note("on_step_begin", step.step)
    def on_sample_begin(self, step):
        self.note("on_sample_begin", step.step)
        super().on_sample_begin(step)
    def on_sample_end(self, step): self.note("on_sample_end", step.step)
    def on_step_end(self, step):
        self.note("on_step_end", step.step)
        super().on_step_end(step)
    def on_validate_begin(self, step): self.note("on_validate_begin", step)
    def on_validate_end(self, step): self.note("on_validate_end", step)
    def on_train_end(self): self.note("on_train_end")
'''


@pytest.mark.slow  # a run (~7 s); the registration and its errors run by default below
def test_a_users_own_mode_is_named_in_the_config(prefect_api, ray_local, tiny_model, tmp_path):
    from ppoflow.configs import load_config
    from ppoflow.flows.train import run_ppo_train

    log = tmp_path / "hooks.jsonl"
    (tmp_path / "my_modes.py").write_text(MODE_FILE.format(log=str(log)))
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "data.synthetic.train_rows=32",
        "data.synthetic.val_rows=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
        f"trainer.v1.trainer_module={tmp_path}/my_modes.py",
        "trainer.v1.trainer_mode=recording_sync",
    ]
    # as `ppoflow train` calls it: the typed fields from the config, where a user's mode is not one
    state = run_ppo_train("grpo_tiny", overrides, load_config("grpo_tiny", overrides), return_state=True)
    assert state.is_completed(), state
    hooks = [tuple(json.loads(line)) for line in log.read_text().splitlines()]

    def per_step(number: int) -> list[tuple]:
        return [(hook, number) for hook in ("on_step_begin", "on_sample_begin", "on_sample_end", "on_step_end")]

    assert hooks == [
        ("on_init_end", None),
        ("on_train_begin", None),
        *per_step(1),
        *per_step(2),
        ("on_validate_begin", 2),
        ("on_validate_end", 2),
        ("on_train_end", None),
    ]


def test_a_mode_or_sampler_file_that_does_not_import_is_a_config_error(tmp_path):
    from ppoflow.flows.train import check_mode

    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    for path, needle in ((tmp_path / "broken.py", "RuntimeError: no"), (tmp_path / "missing.py", "no such file")):
        cfg = load_config("grpo_tiny", [f"trainer.v1.trainer_module={path}"])
        with pytest.raises(ConfigError) as raised:
            check_mode(cfg)
        assert raised.value.problems[0][0] == "trainer.v1.trainer_module" and needle in raised.value.problems[0][1]
    cfg = load_config(
        "grpo_tiny",
        [
            f"trainer.v1.sampler.custom_sampler.path={tmp_path}/missing.py",
            "trainer.v1.sampler.custom_sampler.name=Sampler",
        ],
    )
    with pytest.raises(ConfigError) as raised:
        check_mode(cfg)
    assert raised.value.problems[0][0] == "trainer.v1.sampler.custom_sampler"
    assert "no such file" in raised.value.problems[0][1]


NEEDY_MODE = '''
from ppoflow.configs.modes import ModeNeeds
from ppoflow.flows.modes import SyncTrainer, register_trainer

@register_trainer({name!r})
class Needy(SyncTrainer):
    """sync, generating through the rollout service."""

    needs = ModeNeeds(summary="sync through the rollout service", rollout_service=True)
'''


def a_mode_file(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(NEEDY_MODE.format(name=name))
    return str(path)


def test_a_users_mode_is_in_the_forms_choices_and_fills_its_mode_field(tmp_path):
    """``ppoflow serve --config`` imports the config's trainer_module before building the deployment: the
    form's dropdown (the deployment's parameter schema) lists the user's mode, and the preset's mode fills it."""
    import yaml

    from ppoflow.configs import CONFIG_DIR
    from ppoflow.flows.deploy import deployments

    preset, config = tmp_path / "needy.yaml", yaml.safe_load((CONFIG_DIR / "grpo_tiny.yaml").read_text())
    config["trainer"] = {
        **config["trainer"],
        "mode": "needy_form",
        "v1": {"trainer_module": a_mode_file(tmp_path, "needy_form")},
    }
    config["actor_rollout_ref"]["rollout"] = {**config["actor_rollout_ref"].get("rollout", {}), "mode": "async"}
    preset.write_text(yaml.safe_dump(config))
    ppo_train = deployments(str(tmp_path / "no-golden"), preset=str(preset))[0]
    mode = ppo_train._parameter_openapi_schema.model_dump()["properties"]["mode"]
    assert mode["anyOf"][0]["enum"][:4] == ["sync", "one_step_off", "colocate_async", "separate_async"]
    assert "needy_form" in mode["anyOf"][0]["enum"]
    assert ppo_train.parameters["mode"] == "needy_form"


def test_a_users_mode_that_needs_the_rollout_service_is_refused_without_it(tmp_path, capsys):
    from tests.preflight_helpers import DEMO, assert_user_error, run_cli

    module = a_mode_file(tmp_path, "needy_cli")
    words = [f"trainer.v1.trainer_module={module}", "trainer.mode=needy_cli", f"trainer.default_local_dir={tmp_path}"]
    code, stderr = run_cli(capsys, *DEMO, *words)
    assert_user_error(code, stderr, "trainer.mode: needy_cli generates with the rollout service", "mode=async")
    with pytest.raises(ConfigError) as raised:  # now that the mode is registered, the config itself refuses it
        load_config("grpo_tiny", words)
    assert [key for key, _ in raised.value.problems] == ["trainer.mode"]


def test_an_unknown_mode_is_refused_naming_the_registered_ones_the_users_too(tmp_path):
    from ppoflow.flows.train import check_mode

    module = a_mode_file(tmp_path, "needy_named")
    cfg = load_config("grpo_tiny", [f"trainer.v1.trainer_module={module}", "trainer.mode=no_such_mode"])
    with pytest.raises(ConfigError) as raised:
        check_mode(cfg)
    ((key, message),) = raised.value.problems
    assert key == "trainer.mode" and "sync, one_step_off, colocate_async, separate_async" in message
    assert "needy_named" in message
