"""Shared by the async-mode runs (tests/test_async_modes*.py, tests/test_round_names.py, tests/test_kill_sweep.py):
the overrides of a small async run, and a mode that writes down what each step trains."""

from __future__ import annotations


def run_overrides(tiny_model, tmp_path, *words) -> list[str]:
    """A small async run under ``tmp_path`` (three steps, two replicas, no validation), then ``words``."""
    return [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=64",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.num_replicas=2",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
        *words,
    ]


LEDGER_MODE = '''
import json
from ppoflow.flows.async_modes import ColocateAsyncTrainer
from ppoflow.flows.modes import register_trainer
from ppoflow.storage.batch import non_tensor_column

@register_trainer({name!r})
class LedgerAsync(ColocateAsyncTrainer):
    """colocate_async, writing down the prompts each step trains on and what the buffer holds at the end."""

    def note(self, entry):
        with open({log!r}, "a") as log:
            log.write(json.dumps(entry) + "\\n")

    def sample(self, step):
        super().sample(step)
        self.note({{"step": step.step, "trained": sorted(set(non_tensor_column(step.batch, "uid")))}})

    def on_train_end(self):
        self.note({{"left": sorted(self.prompts), "fed": self.state.fed}})
'''
"""A trainer mode file, to format with ``log`` and ``name``: colocate_async, appending to ``log`` the uids each step
trains and, at the end, the prompts left in the buffer and how many were fed."""
