"""Stage 2, reward: decode each response and score it with its data source's rule (or a custom scorer).

The score is placed on the response's last valid token (verl's ``token_level_scores``); everything
else is zero.
"""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from storage.batch import non_tensor_column
from tasks.caching import StageRecord, StepDump, dump_stage
from tasks.algorithms.scoring import Scorer, score_responses


def decode_responses(batch: TensorDict, tokenizer) -> list[str]:
    """Each response up to (not including) its first EOS; other special tokens stay visible."""
    lengths = batch["response_mask"].sum(dim=1).tolist()
    texts = []
    for tokens, length in zip(batch["responses"].tolist(), lengths):
        tokens = tokens[:length]
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            tokens = tokens[:-1]
        texts.append(tokens)
    return tokenizer.batch_decode(texts, skip_special_tokens=False)


@task(name="reward", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def reward(batch: TensorDict, tokenizer, custom_scorer: Scorer | None, dump: StepDump | None = None) -> StageRecord:
    """``token_level_scores`` [N, R] for the batch, plus the mean of any extra value a scorer reported."""
    scores, extras = score_responses(non_tensor_column(batch, "data_source"), decode_responses(batch, tokenizer),
                                     non_tensor_column(batch, "ground_truth"), custom_scorer)
    mask = batch["response_mask"]
    last_token = (mask.sum(dim=1) - 1).clamp(min=0)
    token_level_scores = torch.zeros(mask.shape, dtype=torch.float32)
    token_level_scores[torch.arange(mask.shape[0]), last_token] = torch.tensor(scores, dtype=torch.float32)
    metrics = {f"reward/{name}/mean": sum(values) / len(values) for name, values in extras.items()}
    return dump_stage(dump, TensorDict({"token_level_scores": token_level_scores * mask}, batch_size=batch.batch_size),
                      metrics)
