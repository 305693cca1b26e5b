"""The LLM judge (``reward_model.judge``) on the rollout service: as each trajectory finishes, its prompt, response
and ground truth fill ``prompt_template``; the replicas that serve the policy's trajectories, or the judge model's
own (``judge.model.path``), generate the verdict while the others still generate; the parser - a scorer of the
verdict (``parser_path``), in a process of its own like a custom scorer - turns it into a score. A verdict the
parser fails on scores ``error_score``, logged and counted (``reward/judge_scorer_errors``). Details:
docs/reward_models.md#an-llm-judge.
"""

from __future__ import annotations

import asyncio

from ppoflow.algorithms.scoring import score_one, solution_text
from ppoflow.configs.schema_algorithm import JudgeConfig
from ppoflow.workers.rollout.requests import RequestSampling
from ppoflow.workers.service.scorer_process import ScorerProcess

JUDGE_EXTRAS = "judge_"
"""The prefix of what the parser reports besides the score (its failures: ``judge_scorer_errors``)."""


class Judge:
    """The run's judge: ``client`` (a load balancer over the policy's replicas or the judge model's) serves its
    verdicts; ``tokenizer`` is the policy's, which the trajectories' tokens are in, and ``judge_tokenizer`` the
    judge model's (the policy's when the policy judges)."""

    def __init__(self, settings: JudgeConfig, client, tokenizer, judge_tokenizer=None):
        self.settings, self.client, self.tokenizer = settings, client, tokenizer
        self.judge_tokenizer = judge_tokenizer or tokenizer
        self.parser = ScorerProcess(
            settings.parser_path, settings.parser_name, timeout_s=settings.timeout_s, error_score=settings.error_score
        )

    def prompt_ids(self, prompt_ids: list[int], response: str, ground_truth) -> list[int]:
        """The judge's prompt as the judge's tokens: the template filled in (the prompt decoded from the policy's
        tokens), through the judge's chat template as a user turn (when it has one)."""
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        text = self.settings.prompt_template.format(prompt=prompt, response=response, ground_truth=ground_truth)
        judge_tokenizer = self.judge_tokenizer
        if getattr(judge_tokenizer, "chat_template", None):
            turn = [{"role": "user", "content": text}]
            text = judge_tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        return judge_tokenizer(text, add_special_tokens=False)["input_ids"]

    async def score(
        self, prompt_ids: list[int], response: str, data_source: str, ground_truth, *, session, seed, sample, extra_info
    ) -> tuple[float, dict]:
        """The judge's score of one response, and the parser's extras (prefixed :data:`JUDGE_EXTRAS`)."""
        settings = self.settings
        sampling = RequestSampling(
            temperature=settings.temperature,
            top_p=1.0,
            top_k=0,
            greedy=settings.temperature == 0,
            max_new_tokens=settings.max_tokens,
            seed=seed,
        )
        output = await self.client.generate(
            f"{session}/judge", self.prompt_ids(prompt_ids, response, ground_truth), sampling
        )
        verdict = solution_text(output.token_ids, self.judge_tokenizer)
        score, extras = await asyncio.to_thread(
            score_one,
            data_source,
            verdict,
            ground_truth,
            self.parser,
            sample=f"the judge's verdict {verdict!r} on {sample}",
            extra_info=extra_info,
        )
        return score, {f"{JUDGE_EXTRAS}{name}": value for name, value in extras.items()}
