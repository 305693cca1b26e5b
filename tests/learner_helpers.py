"""What the Learner's own tests share: a one-layer model with its Learner, rows of inputs and advantages, and an
update over them in mini- and micro-batches (tests/test_nonfinite.py)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppoflow.configs.schema import OptimConfig
from ppoflow.workers.training.data_parallel import DataParallel
from ppoflow.workers.training.learner import Learner


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
