"""A non-finite reward, advantage, loss or gradient is never silent (``trainer.nonfinite``): ``fail`` stops the run
naming the samples or the mini-batch; ``skip`` drops the update with a warning, counts it in
``training/nonfinite_skipped`` and goes on, without touching the trainer's state; a run whose every update was
dropped does not end as a success.

The runs plant inf rewards with a custom reward function that returns finite scores beyond float32 (a non-finite
score scores custom_reward_function.error_score instead: tests/test_scoring_failures.py), finite on the first
train row, which preflight scores; the Learner tests plant non-finite advantages.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from ppoflow.algorithms.finite import NonFiniteError
from ppoflow.configs import load_config
from ppoflow.configs.schema import OptimConfig
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import train
from ppoflow.storage.checkpoint import read_trainer_state
from ppoflow.workers.training.data_parallel import DataParallel
from ppoflow.workers.training.learner import Learner
from tests.preflight_helpers import DEMO_TRAIN

pytestmark = pytest.mark.reliability

SCORERS = """
BEYOND_FLOAT32 = 1e39  # finite, so a score; inf as a float32 reward

def inf(data_source, solution_str, ground_truth, extra_info=None):  # the right answer only (preflight's) scores 1
    return 1.0 if solution_str == ground_truth else BEYOND_FLOAT32

def some_inf(data_source, solution_str, ground_truth, extra_info=None):  # the prompts whose answer starts 0 or 1
    return BEYOND_FLOAT32 if ground_truth[0] in "01" else 0.5

def some_minus_inf(data_source, solution_str, ground_truth, extra_info=None):
    return -BEYOND_FLOAT32 if ground_truth[0] in "01" else 0.5

def huge(data_source, solution_str, ground_truth, extra_info=None):  # finite, but a group's sum overflows float32
    return 3.0e38
"""

SAMPLE = r"row \d+ \(uid '[^']+', data_source 'synthetic/copy'\) = "


@pytest.fixture
def scorers(tmp_path) -> Path:
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    return path


def run_words(tiny_overrides, scorers: Path, name: str, *more: str) -> list[str]:
    return [
        *tiny_overrides,
        f"custom_reward_function.path={scorers}",
        f"custom_reward_function.name={name}",
        "trainer.test_freq=-1",
        *more,
    ]


def run_dir(words: list[str]) -> str:
    return load_config("grpo_tiny", words).trainer.default_local_dir


def test_a_nonfinite_reward_fails_the_run_naming_its_samples(tiny_overrides, scorers):
    """Step 1 has no prompt whose answer starts with 0 or 1, step 2 has two: the run trains step 1, then
    stops at step 2's reward naming the samples, their data source and the value; no model is exported."""
    words = run_words(tiny_overrides, scorers, "some_minus_inf")
    with pytest.raises(NonFiniteError) as raised:
        train(load_config("grpo_tiny", words), orchestrated=False)
    message = str(raised.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"step 2 reward: non-finite reward in 8 of 16 samples: {SAMPLE}-inf; ({SAMPLE}-inf; ){{2}}"
        r"and 5 more \(trainer.nonfinite=fail; =skip drops such a step's update\)",
        message,
    ), message
    rows = read_metrics(run_dir(words))
    assert [row["step"] for row in rows] == [1] and rows[0]["training/nonfinite_skipped"] == 0.0
    assert not list(Path(run_dir(words)).glob("global_step_*/actor/huggingface"))


def test_skipping_every_update_keeps_the_initial_policy_and_still_fails(tiny_overrides, tiny_model, scorers, caplog):
    """Every reward (but for a right answer) is inf: with skip each step's update is dropped with a warning and
    counted, the checkpoint keeps the initial weights, and the run ends in an error, not 'trained policy written'."""
    words = run_words(tiny_overrides, scorers, "inf", "trainer.nonfinite=skip", "trainer.save_freq=1")
    caplog.set_level(logging.WARNING)
    with pytest.raises(NonFiniteError, match=r"every update of the run was dropped on non-finite values \(2 of 2 "):
        train(load_config("grpo_tiny", words), orchestrated=False)
    for step in (1, 2):
        assert re.search(
            rf"step {step} reward: non-finite reward in 16 of 16 samples: {SAMPLE}inf; .*; step {step}'s "
            r"update is dropped \(trainer.nonfinite=skip\)",
            caplog.text,
        )
    rows = read_metrics(run_dir(words))
    assert [row["training/nonfinite_skipped"] for row in rows] == [1.0, 1.0]
    assert not any(name.startswith("actor/") for row in rows for name in row)  # no update ran
    checkpoint = Path(run_dir(words)) / "global_step_2"
    _, state = read_trainer_state(str(checkpoint))
    assert state["trainer"]["kl_controller"] == {"value": 0.001} and state["trainer"]["weight_version"] == 2
    initial, kept = load_file(f"{tiny_model}/model.safetensors"), load_file(str(checkpoint / "actor/model.safetensors"))
    assert kept and all(torch.equal(tensor, initial[name]) for name, tensor in kept.items())
    assert not (checkpoint / "actor/huggingface").exists()


def test_skipped_steps_are_counted_and_the_run_trains_on_and_resumes(tiny_overrides, scorers):
    """inf rewards at steps 2 and 3 (of 4): those updates are dropped, steps 1 and 4 train, the run succeeds;
    resumed from its step-4 checkpoint it goes on to step 7 (5 and 6 dropped too, 7 trained)."""
    words = run_words(
        tiny_overrides,
        scorers,
        "some_inf",
        "trainer.nonfinite=skip",
        "trainer.save_freq=2",
        "trainer.total_training_steps=4",
    )
    train(load_config("grpo_tiny", words), orchestrated=False)
    rows = read_metrics(run_dir(words))
    assert [row["training/nonfinite_skipped"] for row in rows] == [0.0, 1.0, 1.0, 0.0]
    assert all("actor/pg_loss" in row for row in (rows[0], rows[3]))
    assert (Path(run_dir(words)) / "global_step_4/actor/huggingface").exists()
    _, state = read_trainer_state(f"{run_dir(words)}/global_step_4")
    assert state["trainer"]["weight_version"] == 4  # versions count the trainer's steps, dropped ones too
    train(load_config("grpo_tiny", words[:-1] + ["trainer.total_training_steps=7"]), orchestrated=False)
    rows = read_metrics(run_dir(words))
    assert [(row["step"], row["training/nonfinite_skipped"]) for row in rows[4:]] == [(5, 1.0), (6, 1.0), (7, 0.0)]
    assert read_trainer_state(f"{run_dir(words)}/global_step_7")[1]["trainer"]["weight_version"] == 7


def test_a_nonfinite_advantage_is_dropped_and_leaves_the_kl_controller_alone(tiny_overrides, scorers, caplog):
    """Rewards of 3e38 are finite, but each group's sum overflows: the advantage stage is where it is caught,
    and the adaptive KL controller it had already moved is put back."""
    words = run_words(
        tiny_overrides,
        scorers,
        "huge",
        "trainer.nonfinite=skip",
        "trainer.save_freq=1",
        "trainer.total_training_steps=1",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
    )
    caplog.set_level(logging.WARNING)
    with pytest.raises(NonFiniteError, match="every update of the run was dropped"):
        train(load_config("grpo_tiny", words), orchestrated=False)
    assert re.search(rf"step 1 advantage: non-finite advantages in 16 of 16 samples: {SAMPLE}", caplog.text)
    _, state = read_trainer_state(f"{run_dir(words)}/global_step_1")
    assert state["trainer"]["kl_controller"] == {"value": 0.001}


@pytest.mark.slow
def test_the_cli_exits_non_zero_with_the_one_line_reason(prefect_server, ray_local, tiny_overrides, scorers):
    """``ppoflow train`` on real Prefect and Ray: the run fails with exit 1 and the one-line reason, no
    traceback, and no 'trained policy written' line."""
    words = run_words(tiny_overrides, scorers, "inf")
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    result = subprocess.run(
        [*DEMO_TRAIN, *words],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    reason = re.compile(
        rf"^ppoflow: the run failed: step 1 reward: non-finite reward in 16 of 16 samples: {SAMPLE}inf; .* "
        r"\(trainer.nonfinite=fail; =skip drops such a step's update\)$",
        re.MULTILINE,
    )
    assert reason.search(result.stderr), result.stderr[-3000:]
    assert "trained policy written" not in result.stdout + result.stderr


# ------------------------------------------------------------------------------ the Learner


def linear_learner(nonfinite: str) -> Learner:
    torch.manual_seed(0)
    optim = OptimConfig(lr=0.1, betas=[0.9, 0.99], weight_decay=0.0, lr_warmup_steps=0)
    return Learner(
        torch.nn.Linear(3, 1),
        optim,
        grad_clip=1.0,
        device=torch.device("cpu"),
        parallel=DataParallel.join(None, torch.device("cpu")),
        nonfinite=nonfinite,
    )


def advantage_loss(learner: Learner):
    """A policy-gradient-like loss: each row's prediction times its advantage."""

    def micro_loss(micro: TensorDict, num_tokens: float, num_seqs: float):
        loss = (learner.model(micro["x"]).squeeze(-1) * micro["advantages"]).sum() / num_seqs
        return loss, {"actor/pg_loss": loss}, {}

    return micro_loss


def rows(advantages: list[float]) -> TensorDict:
    count = len(advantages)
    return TensorDict(
        {
            "x": torch.arange(count * 3, dtype=torch.float32).reshape(count, 3) / 10,
            "advantages": torch.tensor(advantages),
            "response_mask": torch.ones(count, 2, dtype=torch.bool),
        },
        batch_size=[count],
    )


def train_on(learner: Learner, batch: TensorDict, epochs: int = 1) -> dict[str, float]:
    return learner.train(
        batch,
        advantage_loss(learner),
        epochs=epochs,
        mini_batch_size=4,
        micro_batch_size=2,
        shuffle=False,
        generator=torch.Generator().manual_seed(0),
        prefix="actor",
        step=7,
    )


FINITE = [1.0, -1.0, 0.5, 2.0]


def test_learner_fail_names_the_step_stage_epoch_and_mini_batch():
    learner = linear_learner("fail")
    with pytest.raises(NonFiniteError) as raised:
        train_on(learner, rows(FINITE + [1.0, float("nan"), 0.0, 1.0]))
    assert str(raised.value) == (
        "step 7 update_actor, epoch 1 of 1, mini-batch 2 of 2: non-finite actor/pg_loss = nan, actor/grad_norm = nan"
    )
    assert all(parameter.grad is None for parameter in learner.model.parameters())  # nothing left to step on


def test_learner_skip_drops_only_the_non_finite_mini_batch(caplog):
    """The finite mini-batches step as if the bad one were not there: the same weights, optimizer and
    schedule as training on the finite rows alone; the skip is warned about and counted."""
    caplog.set_level(logging.WARNING)
    learner, alone = linear_learner("skip"), linear_learner("skip")
    metrics = train_on(learner, rows(FINITE + [float("inf"), 1.0, 0.0, 1.0]), epochs=2)
    expected = train_on(alone, rows(FINITE), epochs=2)
    assert metrics["actor/nonfinite_skipped"] == 2.0 and expected["actor/nonfinite_skipped"] == 0.0
    assert metrics["actor/optimizer_steps"] == expected["actor/optimizer_steps"] == 2.0
    assert metrics["actor/pg_loss"] == expected["actor/pg_loss"]
    for mine, theirs in zip(learner.model.parameters(), alone.model.parameters()):
        assert torch.equal(mine, theirs)
    assert learner.scheduler.last_epoch == alone.scheduler.last_epoch == 2
    assert "step 7 update_actor, epoch 2 of 2, mini-batch 2 of 2: non-finite actor/pg_loss = -inf" in caplog.text


def test_learner_skipping_every_mini_batch_changes_nothing(caplog):
    """Every advantage is NaN: no optimizer or schedule step, the weights as they were, zero steps reported
    (the trainer then drops the step)."""
    caplog.set_level(logging.WARNING)
    learner = linear_learner("skip")
    before = [parameter.detach().clone() for parameter in learner.model.parameters()]
    metrics = train_on(learner, rows([float("nan")] * 8))
    assert metrics == {"actor/optimizer_steps": 0.0, "actor/nonfinite_skipped": 2.0}
    assert all(torch.equal(old, new) for old, new in zip(before, learner.model.parameters()))
    assert learner.optimizer.state == {} and learner.scheduler.last_epoch == 0
    assert caplog.text.count("its optimizer step is skipped (trainer.nonfinite=skip)") == 2
