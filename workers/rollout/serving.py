"""A continuous-batching generation engine for a transformers causal LM: a step's whole batch for the sync rollout
(:func:`ppoflow.workers.rollout.sampling.sample_responses`), and request-level generation for agent loops (verl's V1 /
AgentLoop design), which call a rollout replica per sample and per turn.

A request is ``(request_id, prompt_ids, RequestSampling)`` and resolves a future with its tokens and log-probs. Each
:meth:`step <ContinuousBatchingEngine.step>` admits waiting requests into free slots (their prefill samples their
first tokens), runs one decode forward for all running sequences and drops the finished ones, so a finished sequence
frees its slot at once. Sampling per request: :mod:`ppoflow.workers.rollout.requests`. No Ray here: a Ray actor
wraps the engine. The KV-cache layout and sampling details: docs/rollout_service.md#the-engine.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from ppoflow.workers.memory import release_freed_memory
from ppoflow.workers.rollout.kv_rows import cache_layers, join_rows, left_padding_mask, select_rows, set_cache_layers
from ppoflow.workers.rollout.requests import Request, RequestSampling, sample_next_tokens, settle

logger = logging.getLogger(__name__)


class ContinuousBatchingEngine:
    """Serves generation requests with continuous batching over ``model`` (a transformers causal LM
    whose KV cache is full attention in every layer: Llama, Qwen2, ...). See the module docstring.

    Thread safety: :meth:`submit`, :meth:`abort`, :meth:`abort_all`, :meth:`paused` and :meth:`stats`
    may be called from any thread; :meth:`step` runs on one thread at a time (the one :meth:`start`
    starts, or the caller's). ``weight_version`` is set by the owner after loading new weights
    (inside :meth:`paused`); every sampled token is stamped with the version current at its step.
    """

    def __init__(self, model, *, eos_token_id: int | None, device: torch.device, max_num_seqs: int = 64):
        from transformers.cache_utils import DynamicLayer

        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.model = model.eval()
        self._model_config = model.config  # the cache's layout; fixed, though the weights may change
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.weight_version = 0
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        layer_types = {type(layer).__name__ for layer in self._new_cache().layers if type(layer) is not DynamicLayer}
        if layer_types:
            raise NotImplementedError(
                f"the continuous-batching engine needs full-attention KV cache layers; "
                f"{type(model).__name__} has {sorted(layer_types)}"
            )
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument ``cache``; remote-code models may still take ``past_key_values``
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._prefill_options = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

        self._condition = threading.Condition()
        # guarded by _condition
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._stepping = False
        self._pause_depth = 0
        self._stop_requested = False
        self._counters = {
            "steps": 0,
            "prefills": 0,
            "requests_admitted": 0,
            "tokens_generated": 0,
            "running_rows_summed": 0,
            "failed_steps": 0,
        }
        # owned by the stepping thread (swapped under _condition where other threads read them)
        self._running: list[Request] = []
        self._cache = None
        self._thread: threading.Thread | None = None

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self._model_config)

    # --- the request API (any thread) ------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], sampling: RequestSampling) -> Future:
        """Queue a request; the future resolves with its :class:`TokenOutput`, or fails with a
        ``ValueError`` when the request cannot be served (empty prompt, token ids outside the vocabulary,
        prompt + ``max_new_tokens`` beyond the model's ``max_position_embeddings``, an id already in
        flight)."""
        future: Future = Future()
        prompt_ids = [int(token) for token in prompt_ids]
        problem = self._problem(prompt_ids, sampling)
        if problem is None:
            with self._condition:
                if request_id in self._requests:
                    problem = f"request {request_id!r} is already in flight"
                else:
                    request = Request(
                        request_id, prompt_ids, sampling, future, torch.Generator().manual_seed(sampling.seed)
                    )
                    self._requests[request_id] = request
                    self._waiting.append(request)
                    self._condition.notify_all()
        if problem is not None:
            future.set_exception(ValueError(problem))
        return future

    def _problem(self, prompt_ids: list[int], sampling: RequestSampling) -> str | None:
        """Why a request cannot be served, or None."""
        if not prompt_ids:
            return "the prompt is empty"
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < self.vocab_size:
            return f"the prompt has token ids outside the model's vocabulary [0, {self.vocab_size})"
        if self.max_positions is not None and len(prompt_ids) + sampling.max_new_tokens > self.max_positions:
            return (
                f"prompt length {len(prompt_ids)} + max_new_tokens {sampling.max_new_tokens} = "
                f"{len(prompt_ids) + sampling.max_new_tokens} exceeds the model's max_position_embeddings="
                f"{self.max_positions}"
            )
        return None

    def abort(self, request_id: str) -> None:
        """End a request now: its future resolves with its tokens so far, ``finish_reason="abort"``
        (a finished or unknown id is ignored). A running row leaves the batch at the next step."""
        with self._condition:
            request = self._requests.pop(request_id, None)
            if request is None:
                return
            if request in self._waiting:
                self._waiting.remove(request)
            output = request.output("abort", self.weight_version)
        settle(request.future, output)

    def abort_all(self) -> int:
        """:meth:`abort` every request in flight; returns how many there were."""
        with self._condition:
            requests = list(self._requests.values())
            self._requests.clear()
            self._waiting.clear()
            outputs = [request.output("abort", self.weight_version) for request in requests]
        for request, output in zip(requests, outputs):
            settle(request.future, output)
        return len(requests)

    @contextmanager
    def paused(self):
        """No step runs while this is held (it waits for the step in progress to end): the owner loads
        new weights in place inside it. Requests may still be submitted and aborted. Not from a future's
        callback: those run on the stepping thread, whose step this would wait for."""
        with self._condition:
            self._pause_depth += 1
            while self._stepping:
                self._condition.wait()
        try:
            yield
        finally:
            with self._condition:
                self._pause_depth -= 1
                self._condition.notify_all()

    def stats(self) -> dict:
        """Counters for metrics: decode ``steps``, ``prefills`` (forwards), ``requests_admitted``,
        ``tokens_generated``, ``mean_running`` (rows per decode step), ``failed_steps``, and the
        ``running`` / ``waiting`` requests now."""
        with self._condition:
            counters = dict(self._counters)
            running, waiting = len(self._running), len(self._waiting)
        summed = counters.pop("running_rows_summed")
        return {
            **counters,
            "mean_running": summed / counters["steps"] if counters["steps"] else 0.0,
            "running": running,
            "waiting": waiting,
        }

    # --- the background thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Step on a daemon thread while there is work; it sleeps on a condition variable otherwise."""
        with self._condition:
            if self._thread is not None:
                return
            self._stop_requested = False
            self._thread = threading.Thread(target=self._serve, name="continuous-batching", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step. Requests in flight stay (abort them first to end them)."""
        with self._condition:
            thread, self._stop_requested = self._thread, True
            self._condition.notify_all()
        if thread is not None:
            thread.join()
        with self._condition:
            self._thread = None

    def _serve(self) -> None:
        """Step while there is work. When a step leaves none (the batch finished, or every request was aborted,
        as a sleeping replica's are), give what it freed, the batch's KV cache above all, back to the system:
        a long-lived replica's allocator would otherwise keep its largest batch's pages for good
        (:func:`~ppoflow.workers.memory.release_freed_memory`)."""
        while True:
            with self._condition:
                while not self._stop_requested and (self._pause_depth or not (self._waiting or self._running)):
                    self._condition.wait()
                if self._stop_requested:
                    return
            self.step()
            with self._condition:
                drained = not (self._waiting or self._running)
            if drained:
                release_freed_memory()

    # --- one scheduling iteration (the stepping thread) ---------------------------------------

    def step(self) -> int:
        """Admit waiting requests into free slots (prefilling their prompts and sampling their first tokens), run
        one decode forward for every running sequence, sample a token for each and finish those that end. An
        exception fails the futures of the requests it hit (the engine stays usable). Returns how many requests
        are running afterwards; does nothing while :meth:`paused` is held."""
        with self._condition:
            while self._stepping:
                self._condition.wait()
            if self._pause_depth:
                return len(self._running)
            self._stepping = True
            joining = self._admit()
            weight_version = self.weight_version
        try:
            with torch.no_grad():
                if joining:
                    self._prefill(joining, weight_version)
                if self._running:
                    self._decode(weight_version)
        finally:
            with self._condition:
                self._stepping = False
                self._condition.notify_all()
        return len(self._running)

    def _admit(self) -> list[Request]:
        """Waiting requests for the free slots, in arrival order (called under the lock)."""
        joining = []
        while self._waiting and len(self._running) + len(joining) < self.max_num_seqs:
            request = self._waiting.popleft()
            if request.future.cancelled():
                del self._requests[request.request_id]
            else:
                joining.append(request)
        return joining

    def _prefill(self, joining: list[Request], weight_version: int) -> None:
        """Run the joining prompts through the model in one left-padded forward, sample each one's first token from
        its last logits, and add the rows that go on to the batch cache (their newest token is fed next step)."""
        try:
            width = max(len(request.prompt_ids) for request in joining)
            lengths = torch.tensor([len(request.prompt_ids) for request in joining], device=self.device)
            input_ids = torch.tensor(
                [[0] * (width - len(request.prompt_ids)) + request.prompt_ids for request in joining]
            )
            attention_mask = left_padding_mask(lengths, width)
            position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            cache = self._new_cache()
            logits = self._last_logits(
                input_ids.to(self.device), attention_mask, position_ids, cache, **self._prefill_options
            )
            tokens, log_probs = self._sample(joining, logits)
        except Exception as error:
            logger.exception("prefill of %d requests failed", len(joining))
            self._fail(joining, error)
            return
        with self._condition:
            self._counters["prefills"] += 1
            self._counters["requests_admitted"] += len(joining)
        survivors, kept_rows = self._record(joining, tokens, log_probs, weight_version)
        if not survivors:
            return
        layers = cache_layers(cache)
        if len(survivors) < len(joining):  # some ended on their first token
            width = max(request.cached_length for request in survivors)
            layers = select_rows(layers, torch.tensor(kept_rows, device=self.device), width)
        if self._running:
            layers = join_rows(cache_layers(self._cache), layers)
        set_cache_layers(cache, layers)
        with self._condition:
            self._running, self._cache = self._running + survivors, cache

    def _decode(self, weight_version: int) -> None:
        """One forward for every running row (its newest token), one sampled token each, and the rows
        that end (or were aborted or cancelled) leave the batch."""
        running = self._running
        try:
            lengths = torch.tensor([request.cached_length for request in running], device=self.device)
            width = self._cache.get_seq_length()
            input_ids = torch.tensor([[request.next_input] for request in running], device=self.device)
            logits = self._last_logits(
                input_ids, left_padding_mask(lengths + 1, width + 1), lengths.unsqueeze(1), self._cache
            )
            tokens, log_probs = self._sample(running, logits)
        except Exception as error:
            logger.exception("decode step over %d requests failed", len(running))
            self._fail(running, error)
            with self._condition:
                self._running, self._cache = [], None
            return
        with self._condition:
            self._counters["steps"] += 1
            self._counters["running_rows_summed"] += len(running)
        survivors, kept_rows = self._record(running, tokens, log_probs, weight_version)
        if len(survivors) < len(running):
            if survivors:
                width = max(request.cached_length for request in survivors)
                rows = torch.tensor(kept_rows, device=self.device)
                set_cache_layers(self._cache, select_rows(cache_layers(self._cache), rows, width))
            with self._condition:
                self._running, self._cache = survivors, self._cache if survivors else None

    def _last_logits(self, input_ids, attention_mask, position_ids, cache, **options) -> torch.Tensor:
        """The model's logits at each row's last position, [rows, vocab], adding the rows' keys and values to
        ``cache``."""
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_argument: cache},
            **options,
        ).logits[:, -1]

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per request from its row of ``logits`` [rows, vocab] and its own draw, with its log-prob."""
        samplings = [request.sampling for request in requests]
        tokens, log_probs = sample_next_tokens(
            logits.float(),
            temperatures=torch.tensor([s.log_prob_temperature for s in samplings], device=self.device),
            top_ks=torch.tensor([s.top_k for s in samplings], device=self.device),
            top_ps=torch.tensor([s.top_p for s in samplings], device=self.device),
            greedy=torch.tensor([s.is_greedy for s in samplings], device=self.device),
            uniforms=torch.tensor(
                [request.next_uniform() for request in requests], dtype=torch.float32, device=self.device
            ),
        )
        return tokens.tolist(), log_probs.tolist()

    def _record(
        self, requests: list[Request], tokens: list[int], log_probs: list[float], weight_version: int
    ) -> tuple[list[Request], list[int]]:
        """Give each request its sampled token; settle those that end (and forget aborted or cancelled ones).
        Returns the requests that go on and their rows."""
        finished, survivors, kept_rows = [], [], []
        with self._condition:
            for row, (request, token, log_prob) in enumerate(zip(requests, tokens, log_probs)):
                registered = self._requests.get(request.request_id) is request
                if not registered or request.future.cancelled():  # aborted, or cancelled by its caller
                    if registered:
                        del self._requests[request.request_id]
                    continue
                request.record(token, log_prob, weight_version)
                reason = request.finish_reason(self.eos_token_id)
                if reason is None:
                    survivors.append(request)
                    kept_rows.append(row)
                else:
                    del self._requests[request.request_id]
                    finished.append((request, request.output(reason, weight_version)))
            self._counters["tokens_generated"] += len(tokens)
        for request, output in finished:
            settle(request.future, output)
        return survivors, kept_rows

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """Fail the futures of ``requests`` with ``error`` and forget them."""
        with self._condition:
            self._counters["failed_steps"] += 1
            for request in requests:
                if self._requests.get(request.request_id) is request:
                    del self._requests[request.request_id]
        for request in requests:
            settle(request.future, error=error)
