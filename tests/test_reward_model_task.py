"""The built-in prefer task, where only a reward model can teach: its rows have no answer and no scorer, the
preference reward model learns its property, and (slow) GRPO with it raises the property the model rewards."""

import pytest

from ppoflow.configs import load_config
from ppoflow.data.datasets import read_prompt_rows, write_synthetic_dataset
from ppoflow.flows.preflight import preflight
from ppoflow.workers.preference_model import preferred_share, train_preference_model
from ppoflow.workers.remote_reward import RewardSample
from ppoflow.workers.reward_model import RewardModelWorker
from tests.test_reward_model import SPEC


def test_prefer_rows_have_no_answer_and_no_scorer(tmp_path, tiny_overrides):
    cfg = load_config("grpo_tiny", ["data.synthetic.task=prefer"])
    write_synthetic_dataset(cfg.data.synthetic.model_copy(update={"train_rows": 4}), str(tmp_path / "t.parquet"), None)
    rows = read_prompt_rows(str(tmp_path / "t.parquet"), cfg.data, key="data.train_files")
    assert {row["data_source"] for row in rows} == {"synthetic/prefer"}
    assert rows[0]["reward_model"] == {"style": "model", "ground_truth": None}
    words = ["data.synthetic.task=prefer", f"data.train_files={tmp_path}/t.parquet", "data.val_files=null"]
    words += ["trainer.test_freq=-1", "data.train_batch_size=4"]
    with pytest.raises(Exception, match="no reward scorer for data_source 'synthetic/prefer'"):
        preflight(load_config("grpo_tiny", tiny_overrides + words))  # a rule cannot score it


def test_the_preference_model_scores_the_share_of_a(tmp_path):
    path = str(tmp_path / "rm")
    assert train_preference_model(path, SPEC, budget=4, steps=300) < 0.05
    cfg = load_config("grpo_tiny", ["reward_model.enable=true", f"reward_model.model.path={path}"])
    responses = ["aaaa", "aa", "a1b2", "1234", ""]
    scores, _ = RewardModelWorker(cfg).score([RewardSample("", "", "12>", text) for text in responses])
    assert scores == pytest.approx([preferred_share(text, 4) for text in responses], abs=0.1)


@pytest.mark.slow
def test_grpo_with_the_reward_model_raises_the_share_of_a(prefect_api, ray_local, tmp_path):
    from benchmarks.reward_model_learning import BUDGET, share_by_step, task_overrides
    from ppoflow.flows.train import ppo_train

    path = str(tmp_path / "rm")
    train_preference_model(path, SPEC, budget=BUDGET, steps=300)
    state = ppo_train(config="grpo_tiny", overrides=task_overrides(str(tmp_path), path, 0, 30), return_state=True)
    assert state.is_completed(), state
    shares = share_by_step(str(tmp_path / "dumps0"))
    assert sum(shares[step] for step in range(26, 31)) / 5 > sum(shares[step] for step in range(1, 6)) / 5 + 0.3
