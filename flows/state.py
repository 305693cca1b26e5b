"""The trainer's state: what changes from step to step and is checkpointed, apart from the workers'
weights and optimizers (which the workers checkpoint themselves).

:meth:`TrainerState.state_dict` and :meth:`TrainerState.load_state_dict` are all that checkpointing
knows of it; a trainer mode keeps its own state the same way (see :mod:`ppoflow.flows.modes`).
"""

from __future__ import annotations

from collections.abc import Iterator

from ppoflow.algorithms.kl import make_kl_controller
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import PromptLoader


class TrainerState:
    """The dataloader's position, the adaptive KL controller, the actor's weight version, and the prompts
    (epoch and rows) of every step that drew them but has not been trained yet (one_step_off draws a
    step ahead); the async modes take prompts one at a time instead (:meth:`feed`)."""

    def __init__(self, cfg: PPOConfig, num_prompts: int):
        data, ctrl = cfg.data, cfg.algorithm.kl_ctrl
        self.loader = PromptLoader(num_prompts, cfg.gen_batch_size, shuffle=data.shuffle, seed=data.seed)
        self.kl_controller = make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
        self.weight_version = 0
        """How many times the actor has been updated: the version its weights carry when pushed."""
        self._drawn: dict[int, tuple[int, list[int]]] = {}
        self._batches: Iterator[tuple[int, list[int]]] | None = None
        self.fed = 0
        """Prompts fed one at a time so far (:meth:`feed`): the feed index of the last one."""
        self._unfed: list[tuple[int, int]] = []
        """``(epoch, row)`` of a drawn batch's prompts not fed yet."""

    def drawn_prompts(self, step: int) -> tuple[int, list[int]]:
        """The epoch and the train-set rows of ``step``'s prompts: drawn once from the loader (crossing
        epochs without a pause), the same rows however often it is asked."""
        if step not in self._drawn:
            if self._batches is None:
                self._batches = iter(self.loader)
            self._drawn[step] = next(self._batches)
        return self._drawn[step]

    def feed(self, count: int) -> list[tuple[int, int, int]]:
        """The next ``count`` prompts in feed order, one at a time (the async modes' stream, crossing batches
        and epochs): ``(feed index, epoch, row)`` each, feed indexes counting from 1 over the run."""
        fed = []
        for _ in range(count):
            if not self._unfed:
                if self._batches is None:
                    self._batches = iter(self.loader)
                epoch, rows = next(self._batches)
                self._unfed = [(epoch, row) for row in rows]
            self.fed += 1
            fed.append((self.fed, *self._unfed.pop(0)))
        return fed

    def finish_step(self, step: int) -> int:
        """Forget ``step``'s drawn prompts; returns the epoch they came from (with prompts fed one at a
        time, the loader's epoch)."""
        epoch, _ = self._drawn.pop(step, (self.loader.epoch, None))
        return epoch

    def state_dict(self) -> dict:
        return {
            "dataloader": self.loader.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "weight_version": self.weight_version,
            "drawn": {str(step): [epoch, rows] for step, (epoch, rows) in self._drawn.items()},
            "fed": self.fed,
            "unfed": [list(prompt) for prompt in self._unfed],
        }

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["dataloader"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.weight_version = int(state["weight_version"])
        self._drawn = {int(step): (int(epoch), list(rows)) for step, (epoch, rows) in state["drawn"].items()}
        self.fed = int(state.get("fed", 0))
        self._unfed = [(int(epoch), int(row)) for epoch, row in state.get("unfed", [])]
        self._batches = None
