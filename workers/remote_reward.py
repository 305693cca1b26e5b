"""Scoring responses on an HTTP reward service (``reward_model.remote``).

Responses go out ``batch_size`` to a request, ``max_concurrency`` requests at a time, in one of three schemas
(ppoflow's, OpenRLHF's remote RM, verl's ``compute_score`` arguments: docs/reward_models.md). A request is bounded
by ``timeout_s`` as a whole and retried ``max_retries`` times with doubling backoff; one that still fails raises
:class:`RemoteRewardFailed` naming the URL (``on_error=fail``) or scores ``error_score`` (``score``). An answer is
read as JSON only; redirects are not followed, so the key never goes to another host.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ppoflow.algorithms.scoring import as_score
from ppoflow.configs.schema_algorithm import RemoteRewardConfig

logger = logging.getLogger(__name__)

REMOTE_ERRORS = "remote_errors"
"""Per response: 1 when it scored ``reward_model.remote.error_score`` because its request failed, else 0."""

RETRIED_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try; any other error status (401, 404, 422 ...) will not change and fails at once."""


@dataclass(frozen=True)
class RewardSample:
    """What a model-based reward sees of one response: its prompt and response as text, and the row's fields."""

    uid: str
    data_source: str
    prompt: str
    response: str
    ground_truth: Any = None
    extra_info: Any = None


class RemoteRewardFailed(RuntimeError):
    """A request to the reward service failed after its retries (``reward_model.remote.on_error=fail``)."""


class _Permanent(Exception):
    """A failure another try will not fix (an HTTP status outside :data:`RETRIED_STATUSES`)."""


def request_body(schema: str, samples: list[RewardSample]) -> Any:
    """The JSON body of one request in ``schema`` (docs/reward_models.md)."""
    if schema == "openrlhf":
        return {
            "query": [sample.prompt + sample.response for sample in samples],
            "prompts": [sample.prompt for sample in samples],
            "labels": [sample.ground_truth for sample in samples],
        }
    if schema == "verl":
        return [
            {
                "data_source": sample.data_source,
                "solution_str": sample.response,
                "ground_truth": sample.ground_truth,
                "extra_info": sample.extra_info,
            }
            for sample in samples
        ]
    return {"samples": [asdict(sample) for sample in samples]}


def answer_scores(schema: str, answer: Any, count: int) -> list[tuple[float, dict]]:
    """Each response's ``(score, extras)`` from a decoded answer in ``schema``; ``ValueError`` saying what is wrong
    (not the schema's shape, not ``count`` scores, a score that is not a finite number)."""
    key = {"ppoflow": "scores", "openrlhf": "rewards"}.get(schema)
    if key is not None:
        if not isinstance(answer, dict) or key not in answer:
            found = f"keys {', '.join(map(repr, answer))}" if isinstance(answer, dict) else type(answer).__name__
            raise ValueError(f"answered without {key!r} ({found})")
        answer = answer[key]
    if not isinstance(answer, list) or len(answer) != count:
        size = f"{len(answer)} scores" if isinstance(answer, list) else f"a {type(answer).__name__}"
        raise ValueError(f"answered {size} for {count} responses")
    scored = []
    for index, value in enumerate(answer):
        try:
            score, extras = as_score(value)
        except ValueError as error:
            raise ValueError(f"answered {value!r} as the score of response {index}: {error}") from None
        if isinstance(value, bool) or not math.isfinite(score):
            raise ValueError(f"answered {value!r} as the score of response {index}, not a finite number")
        scored.append((score, {name: found for name, found in extras.items() if isinstance(found, float)}))
    return scored


def _json_default(value):
    """JSON for the values a dataset row may hold beyond plain JSON (numpy arrays and scalars)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx is then an HTTPError, not a second request carrying the key


class RemoteReward:
    """A run's reward service client; :meth:`score` scores a batch of :class:`RewardSample`."""

    def __init__(self, settings: RemoteRewardConfig, environ=os.environ):
        self.settings = settings
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if settings.api_key_env:
            key = environ.get(settings.api_key_env)
            if not key:
                raise ValueError(f"reward_model.remote.api_key_env: ${settings.api_key_env} is not set")
            self.headers[settings.auth_header] = f"{settings.auth_scheme} {key}".strip()
        self._opener = urllib.request.build_opener(_NoRedirects)

    def score(self, samples: list[RewardSample]) -> tuple[list[float], dict[str, list[float]]]:
        """Each sample's score, and per-response extras: those the service reported plus :data:`REMOTE_ERRORS`."""
        size = self.settings.batch_size
        chunks = [samples[start : start + size] for start in range(0, len(samples), size)]
        with ThreadPoolExecutor(max_workers=min(self.settings.max_concurrency, len(chunks) or 1)) as pool:
            answers = [row for part in pool.map(self._score_chunk, chunks) for row in part]
        names = list(dict.fromkeys(name for _, extras in answers for name in extras))
        extras = {name: [found.get(name, 0.0) for _, found in answers] for name in names}
        return [score for score, _ in answers], extras

    def _score_chunk(self, chunk: list[RewardSample]) -> list[tuple[float, dict]]:
        settings, attempts = self.settings, self.settings.max_retries + 1
        body = json.dumps(request_body(settings.format, chunk), default=_json_default).encode()
        for attempt in range(attempts):
            try:
                answer = self._post(body)
                scored = answer_scores(settings.format, answer, len(chunk))
                return [(score, {**extras, REMOTE_ERRORS: 0.0}) for score, extras in scored]
            except _Permanent as error:
                problem = str(error)
                break
            except (OSError, ValueError) as error:  # timeouts, refused connections, 5xx, bad JSON or schema
                problem = str(error) or type(error).__name__
            if attempt + 1 < attempts:
                time.sleep(settings.backoff_s * 2**attempt)
        tries = f"after {attempt + 1} attempt{'s' if attempt else ''}"
        message = f"reward service {settings.url} {problem} {tries} (reward_model.remote.url)"
        if settings.on_error == "fail":
            raise RemoteRewardFailed(message + "; reward_model.remote.on_error=score scores such responses instead")
        logger.warning(
            "%s: %d responses scored reward_model.remote.error_score=%g", message, len(chunk), settings.error_score
        )
        return [(settings.error_score, {REMOTE_ERRORS: 1.0}) for _ in chunk]

    def _post(self, body: bytes):
        """One POST, as a whole within ``timeout_s``; the decoded JSON answer."""
        deadline = time.monotonic() + self.settings.timeout_s
        request = urllib.request.Request(self.settings.url, data=body, headers=self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.settings.timeout_s) as response:
                payload = bytearray()
                while chunk := response.read(1 << 16):
                    payload += chunk
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"took over timeout_s={self.settings.timeout_s:g}")
        except urllib.error.HTTPError as error:
            status = f"answered HTTP {error.code} {error.reason}"
            if error.code in RETRIED_STATUSES:
                raise OSError(status) from None
            raise _Permanent(status) from None
        except TimeoutError:
            raise TimeoutError(f"took over timeout_s={self.settings.timeout_s:g}") from None
        except urllib.error.URLError as error:
            raise OSError(f"could not be reached ({error.reason})") from None
        try:
            return json.loads(payload)
        except ValueError:
            raise ValueError(f"answered {bytes(payload[:60])!r}, not JSON") from None
