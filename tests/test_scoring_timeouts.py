"""Reward scorers that hang: a call past custom_reward_function.timeout_s kills the scorer's process (a fresh
one takes its place) and fails naming the sample, or with on_timeout=score scores timeout_score, is counted
and its stall reported; in a training run under both policies."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from ppoflow.algorithms.scoring import ScorerTimedOut, score_responses
from ppoflow.storage import bounded
from ppoflow.workers.service.scorer_process import ScorerProcess

# ---------------------------------------------------------------------------- scorers that hang

HANGING_SCORER = """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(f"{__file__}.{solution_str}.pid", "w") as pid:
        pid.write(str(os.getpid()))
    if solution_str == "hang":
        time.sleep(10**9)
    return {"score": 1.0, "length": len(solution_str)}
"""


@pytest.fixture
def hanging_scorer(tmp_path):
    """A scorer file whose ``compute_score`` sleeps forever on the response ``hang``; each call writes its
    process id to ``<file>.<response>.pid``."""
    path = tmp_path / "slow_reward.py"
    path.write_text(HANGING_SCORER)
    return path


def hung_process_is_gone(scorer_file) -> bool:
    """Whether the process that scored the response ``hang`` is gone (not even a zombie is left)."""
    pid = int(Path(f"{scorer_file}.hang.pid").read_text())
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.reliability
def test_a_scorer_call_past_its_deadline_kills_the_process_and_fails_naming_the_sample(hanging_scorer):
    with ScorerProcess(str(hanging_scorer), "compute_score", timeout_s=1) as scorer:
        with pytest.raises(ScorerTimedOut) as caught:
            score_responses(["my/task"] * 2, ["ok", "hang"], ["t", "t"], scorer, prompt_ids=["4-0", "4-1"])
        assert str(caught.value) == (
            f"the custom scorer '{hanging_scorer}:compute_score' did not return within "
            "custom_reward_function.timeout_s=1 s (its process was killed) while scoring a "
            "response to prompt '4-1' (data source 'my/task')"
        )
        assert hung_process_is_gone(hanging_scorer)
        assert scorer("my/task", "ok", "t") == {"score": 1.0, "length": 2.0}  # a fresh process scores the next one


@pytest.mark.reliability
def test_on_timeout_score_gives_the_timeout_score_counts_it_and_reports_the_stall(hanging_scorer, caplog, monkeypatch):
    monkeypatch.setattr(bounded, "REPORT_EVERY_S", 0.2)  # report the stall within the 1 s deadline
    with (
        ScorerProcess(
            str(hanging_scorer), "compute_score", timeout_s=1, on_timeout="score", timeout_score=-0.5
        ) as scorer,
        caplog.at_level(logging.WARNING),
    ):
        scores, extras = score_responses(
            ["my/task"] * 3, ["ok", "hang", "fine"], ["t"] * 3, scorer, prompt_ids=["3-0", "3-1", "3-2"]
        )
        assert scores == [1.0, -0.5, 1.0]
        assert extras == {"length": [2.0, 4.0], "scorer_timeouts": [0.0, 1.0, 0.0]}
        assert hung_process_is_gone(hanging_scorer)
    sample = "a response to prompt '3-1' (data source 'my/task')"
    stalls = [record.getMessage() for record in caplog.records if "has been scoring" in record.getMessage()]
    assert stalls and all(
        re.fullmatch(
            rf"the custom scorer '{re.escape(str(hanging_scorer))}:compute_score' has been "
            rf"scoring {re.escape(sample)} for \d+ s \(custom_reward_function.timeout_s=1\)",
            message,
        )
        for message in stalls
    )
    assert (
        f"the custom scorer '{hanging_scorer}:compute_score' did not return within custom_reward_function."
        f"timeout_s=1 s (its process was killed) while scoring {sample}: it scores custom_reward_function."
        "timeout_score=-0.5 (on_timeout=score)"
    ) in caplog.messages


@pytest.mark.reliability
@pytest.mark.parametrize("on_timeout", ["fail", "score"])
def test_a_run_whose_scorer_hangs_fails_naming_it_or_scores_on(tmp_path, tiny_overrides, on_timeout):
    """The scorer passes the preflight, then sleeps forever on its next call, the first response of step 1: with
    ``on_timeout=fail`` the run fails naming the key, the prompt and its data source; with ``score`` both steps
    train and ``reward/scorer_timeouts`` counts the one timeout. The hung process is gone either way."""
    from ppoflow.configs import load_config
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import train

    calls = tmp_path / "calls"
    (tmp_path / "my_reward.py").write_text(
        "import os\n"
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as calls:\n"
        "        calls.write('.')\n"
        f"    if os.path.getsize({str(calls)!r}) == 2:  # the preflight's row, then the first response of step 1\n"
        "        open(__file__ + '.hang.pid', 'w').write(str(os.getpid()))\n"
        "        time.sleep(10**9)\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            f"custom_reward_function.path={tmp_path}/my_reward.py",
            "custom_reward_function.timeout_s=1",
            f"custom_reward_function.on_timeout={on_timeout}",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
        ],
    )
    if on_timeout == "fail":
        with pytest.raises(ScorerTimedOut) as caught:
            train(cfg, orchestrated=False)
        assert str(caught.value) == (
            f"the custom scorer '{tmp_path}/my_reward.py:compute_score' did not return "
            "within custom_reward_function.timeout_s=1 s (its process was killed) while "
            "scoring a response to prompt '1-0' (data source 'synthetic/copy')"
        )
    else:
        train(cfg, orchestrated=False)
        rows = read_metrics(cfg.trainer.default_local_dir)
        assert [row["reward/scorer_timeouts"] for row in rows] == [1.0, 0.0]
    assert hung_process_is_gone(tmp_path / "my_reward.py")
