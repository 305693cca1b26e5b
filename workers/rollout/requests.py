"""A request to the continuous-batching engine (:mod:`ppoflow.workers.rollout.serving`): how it samples
(:class:`RequestSampling`), what it gets back (:class:`TokenOutput`), its state in flight, and the draw of each
row's next token (:func:`sample_next_tokens`). Sampling is per request and reproducible (a seeded
``torch.Generator`` per request); log-probs follow :func:`ppoflow.workers.rollout.sampling.sample_responses`.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RequestSampling:
    """How to sample one request: greedy (argmax) when ``greedy`` or ``temperature == 0``, else
    temperature, then top-k (``top_k <= 0``: off), then top-p (``top_p == 1``: off), as transformers'
    warpers do. At most ``max_new_tokens`` tokens; EOS (unless ``ignore_eos``) and ``stop_token_ids``
    end the request and are included in its output."""

    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    max_new_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def log_prob_temperature(self) -> float:
        """The temperature of the distribution whose log-probs are returned (1 for greedy requests)."""
        return 1.0 if self.is_greedy else self.temperature


@dataclass
class TokenOutput:
    """A finished request: its generated tokens (including the EOS/stop token that ended it), each
    token's log-prob (see the module docstring), why it ended (``"stop"``, ``"length"`` or ``"abort"``)
    and the lowest and highest ``weight_version`` its tokens were sampled under."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    weight_versions: tuple[int, int]


UNIFORM_BLOCK = 64
"""Draws taken from a request's generator at a time (:meth:`Request.next_uniform`)."""


@dataclass(eq=False)
class Request:
    """A request in flight: what was asked, its own random stream, and what it has generated so far."""

    request_id: str
    prompt_ids: list[int]
    sampling: RequestSampling
    future: Future
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: tuple[int, int] | None = None
    _uniforms: list[float] = field(default_factory=list)

    def next_uniform(self) -> float:
        """The next draw in ``[0, 1)`` of the request's own stream (drawn from its generator in blocks: one call
        per block, not per token)."""
        if not self._uniforms:
            self._uniforms = torch.rand(UNIFORM_BLOCK, generator=self.generator).tolist()[::-1]
        return self._uniforms.pop()

    @property
    def cached_length(self) -> int:
        """Tokens of this request in the KV cache: the prompt (prefilled with its first token's sampling), then every
        sampled token but the newest, which the next decode forward feeds."""
        return len(self.prompt_ids) - 1 + len(self.token_ids)

    @property
    def next_input(self) -> int:
        """The token the next decode forward feeds for this request (a running request has sampled one)."""
        return self.token_ids[-1]

    def record(self, token: int, log_prob: float, weight_version: int) -> None:
        self.token_ids.append(token)
        self.log_probs.append(log_prob)
        low, high = self.weight_versions or (weight_version, weight_version)
        self.weight_versions = (min(low, weight_version), max(high, weight_version))

    def finish_reason(self, eos_token_id: int | None) -> str | None:
        """``"stop"`` or ``"length"`` when the newest token ends the request, else None."""
        last = self.token_ids[-1]
        if (last == eos_token_id and not self.sampling.ignore_eos) or last in self.sampling.stop_token_ids:
            return "stop"
        return "length" if len(self.token_ids) >= self.sampling.max_new_tokens else None

    def output(self, finish_reason: str, weight_version: int) -> TokenOutput:
        """What the request has so far (``weight_version`` stands in when no token was sampled yet)."""
        return TokenOutput(
            list(self.token_ids),
            list(self.log_probs),
            finish_reason,
            self.weight_versions or (weight_version, weight_version),
        )


def settle(future: Future, result: TokenOutput | None = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (a caller may have cancelled it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[rows, vocab]`` and its log-prob under ``softmax(logits / T)``.

    Per row: greedy rows take the argmax (their ``temperatures`` entry must be 1, the log-prob
    convention); the others scale by their temperature, keep their ``top_ks`` most likely tokens
    (``<= 0``: all), then the smallest head of those whose mass reaches their ``top_ps`` (``1``: all),
    and pick the token where that distribution's CDF crosses their ``uniforms`` draw (in ``[0, 1)``), so
    a row's token depends on nothing but its own logits and draw. A row that truncates nothing takes the CDF in
    vocabulary order, without sorting the vocabulary.
    """
    scaled = logits / temperatures.unsqueeze(1)
    tokens = logits.argmax(dim=-1)
    truncated = (top_ks > 0) | (top_ps < 1)
    if bool((~greedy & ~truncated).any()):
        tokens = torch.where(greedy | truncated, tokens, _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms))
    if bool((~greedy & truncated).any()):
        vocab = logits.shape[-1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        keep = ranks < torch.where(top_ks > 0, top_ks, vocab).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_ps.unsqueeze(1)) | (top_ps >= 1).unsqueeze(1)
        picked = _inverse_cdf(probs.masked_fill(~keep, 0.0), uniforms).unsqueeze(1)
        tokens = torch.where(~greedy & truncated, order.gather(-1, picked).squeeze(1), tokens)
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, log_probs


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` [rows, vocab] (non-negative, unnormalised), the column where the CDF crosses
    ``uniforms`` [rows] times the row's total."""
    cdf = weights.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True)
    return picked.squeeze(1).clamp(max=weights.shape[-1] - 1)
