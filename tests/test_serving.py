"""The continuous-batching engine (workers/rollout/serving.py) against transformers' own generation and a
teacher-forced forward, on the tiny random Llama: greedy outputs, log-probs, per-request seeds, stop
conditions, aborts, the stepping thread, pauses and weight versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ppoflow.workers.rollout import serving
from ppoflow.workers.rollout.requests import RequestSampling, sample_next_tokens
from tests.conftest import model_config

CPU = torch.device("cpu")
PROMPTS = ["1+2=", "abc", "7", "12345678+9=", "a:b|c?", "99-3=>", "0,1,2,3,4,5,6,7,8,9,", "j"]
MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model(tiny_model):
    """The tiny Llama with its matrices redrawn at a larger scale: at the default initialisation its logits
    are nearly flat and greedy decoding repeats the last prompt token, which a wrong cache, mask or
    position would reproduce too; these weights make every continuation depend on the whole context."""
    from ppoflow.workers.models import load_causal_lm

    model = load_causal_lm(model_config(tiny_model)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from ppoflow.workers.models import load_tokenizer

    return load_tokenizer(model_config(tiny_model))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def greedy_references(model, tokenizer, prompts) -> list[list[int]]:
    """``model.generate`` greedy, one prompt at a time, up to and including EOS."""
    references = []
    for prompt in prompts:
        with torch.no_grad():
            sequences = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        references.append(sequences[0, len(prompt) :].tolist())
    return references


def engine_for(model, tokenizer, **options) -> serving.ContinuousBatchingEngine:
    return serving.ContinuousBatchingEngine(model, eos_token_id=tokenizer.eos_token_id, device=CPU, **options)


def greedy(max_new_tokens: int = MAX_NEW_TOKENS, **options) -> RequestSampling:
    return RequestSampling(
        temperature=1.0, top_p=1.0, top_k=0, greedy=True, max_new_tokens=max_new_tokens, seed=0, **options
    )


def sampled(seed: int, max_new_tokens: int = MAX_NEW_TOKENS, **options) -> RequestSampling:
    return RequestSampling(
        **{
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 8,
            "greedy": False,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            **options,
        }
    )


def drain(engine: serving.ContinuousBatchingEngine) -> None:
    """Step until nothing is running or waiting."""
    while engine.step() or engine.stats()["waiting"]:
        pass


def test_greedy_references_are_not_degenerate(greedy_references):
    """The references the engine is held to vary along each continuation and between prompts."""
    assert all(len(set(reference)) > 3 for reference in greedy_references)
    assert len({tuple(reference) for reference in greedy_references}) == len(greedy_references)


@pytest.mark.parametrize("arrival", ["all_at_once", "one_by_one", "two_slots", "joining_mid_flight"])
def test_greedy_outputs_equal_generate(model, tokenizer, prompts, greedy_references, arrival):
    slots = {"two_slots": 2, "joining_mid_flight": 3}.get(arrival, 64)
    engine = engine_for(model, tokenizer, max_num_seqs=slots)
    futures = []
    for index, prompt in enumerate(prompts):
        futures.append(engine.submit(f"r{index}", prompt, greedy()))
        if arrival == "one_by_one":
            drain(engine)
        elif arrival == "joining_mid_flight":
            engine.step()
            engine.step()
    drain(engine)
    outputs = [future.result(timeout=0) for future in futures]
    assert [output.token_ids for output in outputs] == greedy_references
    assert [output.finish_reason for output in outputs] == [
        "stop" if reference[-1] == tokenizer.eos_token_id else "length" for reference in greedy_references
    ]
    if arrival == "two_slots":
        assert engine.stats()["mean_running"] <= 2 and engine.stats()["requests_admitted"] == len(prompts)


def test_log_probs_equal_a_teacher_forced_forward(model, tokenizer, prompts):
    """Sampled (temperature 0.7, top-k, top-p) and greedy requests in one batch: each token's log-prob is
    log_softmax(logits / T) of a full forward over prompt + output (T = 1 for greedy), and every sampled
    token lies inside its top-k and top-p set."""
    engine = engine_for(model, tokenizer, max_num_seqs=3)
    requests = [(prompt, sampled(seed=index)) for index, prompt in enumerate(prompts)]
    requests.append(
        (
            prompts[0],
            RequestSampling(temperature=0.7, top_p=0.9, top_k=8, greedy=True, max_new_tokens=MAX_NEW_TOKENS, seed=0),
        )
    )
    futures = [engine.submit(f"r{index}", prompt, sampling) for index, (prompt, sampling) in enumerate(requests)]
    drain(engine)
    for (prompt, sampling), future in zip(requests, futures):
        output = future.result(timeout=0)
        tokens = torch.tensor(output.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output.token_ids])).logits[0, len(prompt) - 1 : -1]
        temperature = 1.0 if sampling.greedy else sampling.temperature
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-4)
        if sampling.greedy:
            assert output.token_ids == logits.argmax(dim=-1).tolist()
            continue
        ranks = (logits > logits.gather(-1, tokens.unsqueeze(1))).sum(dim=-1)
        assert bool((ranks < sampling.top_k).all()), ranks
        top = torch.softmax(logits.topk(sampling.top_k).values / temperature, dim=-1)
        mass_before = (top.cumsum(dim=-1) - top).gather(-1, ranks.unsqueeze(1)).squeeze(1)
        assert bool((mass_before < sampling.top_p).all()), mass_before


def test_sampling_depends_only_on_prompt_seed_and_weights(model, tokenizer, prompts):
    length = 40
    alone = engine_for(model, tokenizer)
    future = alone.submit("x", prompts[1], sampled(seed=11, max_new_tokens=length, ignore_eos=True))
    drain(alone)
    expected = future.result(timeout=0).token_ids

    batched = engine_for(model, tokenizer, max_num_seqs=4)
    others = [
        batched.submit(f"o{index}", prompt, sampled(seed=100 + index, max_new_tokens=7 + 5 * index))
        for index, prompt in enumerate(prompts[2:5])
    ]
    batched.step()
    batched.step()
    same = batched.submit("x", prompts[1], sampled(seed=11, max_new_tokens=length, ignore_eos=True))
    other_seed = batched.submit("y", prompts[1], sampled(seed=12, max_new_tokens=length, ignore_eos=True))
    drain(batched)
    assert all(other.done() for other in others)
    assert same.result(timeout=0).token_ids == expected
    assert len(expected) == length
    assert other_seed.result(timeout=0).token_ids != expected


def test_eos_and_stop_tokens_end_a_request_and_max_new_tokens_gives_length(
    model, tokenizer, prompts, greedy_references
):
    index = max(range(len(prompts)), key=lambda i: len(greedy_references[i]))
    reference = greedy_references[index]
    stop_token = reference[4]
    ends_at = reference.index(stop_token) + 1

    engine = engine_for(model, tokenizer)
    by_stop_token = engine.submit("stop", prompts[index], greedy(stop_token_ids=(stop_token,)))
    by_length = engine.submit("length", prompts[index], greedy(max_new_tokens=3))
    drain(engine)
    assert (by_stop_token.result().token_ids, by_stop_token.result().finish_reason) == (reference[:ends_at], "stop")
    assert (by_length.result().token_ids, by_length.result().finish_reason) == (reference[:3], "length")

    eos_engine = serving.ContinuousBatchingEngine(model, eos_token_id=stop_token, device=CPU)
    by_eos = eos_engine.submit("eos", prompts[index], greedy())
    past_eos = eos_engine.submit("ignore", prompts[index], greedy(ignore_eos=True))
    drain(eos_engine)
    assert (by_eos.result().token_ids, by_eos.result().finish_reason) == (reference[:ends_at], "stop")
    assert len(past_eos.result().token_ids) == MAX_NEW_TOKENS and past_eos.result().finish_reason == "length"


def test_abort_returns_the_tokens_so_far(model, tokenizer, prompts, greedy_references):
    engine = engine_for(model, tokenizer, max_num_seqs=2)
    running = engine.submit("running", prompts[3], greedy())
    companion = engine.submit("companion", prompts[0], greedy())
    waiting = engine.submit("waiting", prompts[1], greedy())
    cancelled = engine.submit("cancelled", prompts[2], greedy())
    for _ in range(3):  # 4 tokens: the first step's prefill samples one and its decode another
        engine.step()
    engine.abort("running")
    engine.abort("waiting")
    engine.abort("no-such-request")
    assert running.done() and waiting.done()
    assert (running.result().token_ids, running.result().finish_reason) == (greedy_references[3][:4], "abort")
    assert running.result().log_probs and len(running.result().log_probs) == 4
    assert (waiting.result().token_ids, waiting.result().finish_reason) == ([], "abort")
    assert cancelled.cancel()
    assert engine.step() == 1  # the aborted row left; the cancelled request is never admitted
    drain(engine)
    assert companion.result().token_ids == greedy_references[0]

    in_flight = [engine.submit("running", prompts[3], greedy())]  # an aborted id can be used again
    in_flight += [engine.submit(name, prompt, greedy()) for name, prompt in zip("abc", prompts[4:])]
    engine.step()
    engine.abort_all()
    assert [future.result(timeout=0).finish_reason for future in in_flight] == ["abort"] * 4
    assert [len(future.result().token_ids) for future in in_flight] == [2, 2, 0, 0]  # prefill's and decode's
    assert engine.step() == 0 and engine.stats()["waiting"] == 0


def test_the_background_thread_serves_requests_from_other_threads(model, tokenizer, prompts, greedy_references):
    engine = engine_for(model, tokenizer, max_num_seqs=3)
    engine.start()
    try:
        futures = [None] * len(prompts)

        def client(index: int) -> None:
            futures[index] = engine.submit(f"r{index}", prompts[index], greedy())

        clients = [threading.Thread(target=client, args=(index,)) for index in range(len(prompts))]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        assert [future.result(timeout=30).token_ids for future in futures] == greedy_references
    finally:
        engine.stop()
    assert not any(thread.name == "continuous-batching" for thread in threading.enumerate())


def test_the_stepping_thread_gives_memory_back_when_its_batch_drains(model, tokenizer, prompts, monkeypatch):
    """Once per drained batch, finished or aborted (a sleeping replica's), with its KV cache already dropped."""
    engine, releases = engine_for(model, tokenizer, max_num_seqs=2), []
    monkeypatch.setattr(serving, "release_freed_memory", lambda: releases.append(engine._cache))

    def released(count: int) -> bool:  # within 30 s, and an idle engine releases nothing more
        deadline = time.monotonic() + 30
        while len(releases) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return releases == [None] * count

    engine.start()
    try:
        with engine.paused():  # all three queued before the first step: one batch, one drain
            finished = [engine.submit(f"r{index}", prompts[index], greedy()) for index in range(3)]
        assert all(future.result(timeout=30).finish_reason for future in finished) and released(1)
        decoding, resume, decode = threading.Event(), threading.Event(), engine._decode

        def held_decode(weight_version: int) -> None:  # the abort lands while the request is running
            decoding.set()
            resume.wait(timeout=30)
            decode(weight_version)

        monkeypatch.setattr(engine, "_decode", held_decode)
        aborted = engine.submit("aborted", prompts[0], greedy(ignore_eos=True))
        assert decoding.wait(timeout=30) and engine.abort_all() == 1
        resume.set()
        assert aborted.result(timeout=30).finish_reason == "abort" and released(2)
    finally:
        engine.stop()


def test_paused_blocks_steps_while_held(model, tokenizer, prompts, greedy_references):
    engine = engine_for(model, tokenizer)
    engine.start()
    try:
        with engine.paused():
            future = engine.submit("r", prompts[0], greedy())
            time.sleep(0.3)
            assert not future.done() and engine.stats()["steps"] == 0
            assert engine.step() == 0 and engine.stats()["steps"] == 0  # a step asked for in the pause does nothing
        assert future.result(timeout=30).token_ids == greedy_references[0]
    finally:
        engine.stop()


def test_weight_versions_span_a_version_change(model, tokenizer, prompts):
    engine = engine_for(model, tokenizer)
    spanning = engine.submit("spanning", prompts[0], greedy(max_new_tokens=10, ignore_eos=True))
    engine.step()
    engine.step()
    with engine.paused():
        engine.weight_version = 1
    later = engine.submit("later", prompts[1], greedy(max_new_tokens=3))
    engine.step()
    with engine.paused():
        engine.weight_version = 2
    drain(engine)
    assert spanning.result().weight_versions == (0, 2)
    assert later.result().weight_versions == (1, 2)


def test_requests_that_cannot_be_served_fail_their_futures_only(model, tokenizer, prompts, greedy_references):
    engine = engine_for(model, tokenizer)
    too_long = engine.submit("long", [5] * 50, greedy(max_new_tokens=20))
    empty = engine.submit("empty", [], greedy())
    unknown_token = engine.submit("unknown token", [5, 32], greedy())
    served = engine.submit("served", prompts[0], greedy())
    duplicate = engine.submit("served", prompts[0], greedy())
    drain(engine)
    with pytest.raises(
        ValueError, match=r"prompt length 50 \+ max_new_tokens 20 = 70 exceeds .*max_position_embeddings=64"
    ):
        too_long.result(timeout=0)
    with pytest.raises(ValueError, match="empty"):
        empty.result(timeout=0)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 32\)"):
        unknown_token.result(timeout=0)
    with pytest.raises(ValueError, match="already in flight"):
        duplicate.result(timeout=0)
    assert served.result(timeout=0).token_ids == greedy_references[0]
    with pytest.raises(ValueError, match="top_p"):
        RequestSampling(temperature=1.0, top_p=0.0, top_k=0, greedy=False, max_new_tokens=4, seed=0)


def broken_model(**inputs):
    raise RuntimeError("device lost")


def test_a_failing_forward_fails_the_requests_it_hit_and_the_engine_goes_on(
    model, tokenizer, prompts, greedy_references
):
    """A prefill that raises fails the joining requests, a decode that raises fails the running ones;
    the engine (and its thread) then serves the next requests."""
    engine = engine_for(model, tokenizer)
    running = engine.submit("running", prompts[0], greedy())
    engine.step()
    engine.model = broken_model
    joining = engine.submit("joining", prompts[1], greedy())
    assert engine.step() == 0
    for future in (running, joining):
        with pytest.raises(RuntimeError, match="device lost"):
            future.result(timeout=0)
    assert engine.stats()["failed_steps"] == 2  # the prefill and the decode

    engine.start()
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            engine.submit("on the thread", prompts[2], greedy()).result(timeout=30)
        with engine.paused():
            engine.model = model
        assert engine.submit("served", prompts[0], greedy()).result(timeout=30).token_ids == greedy_references[0]
    finally:
        engine.stop()


def test_sample_next_tokens_keeps_each_rows_own_filters():
    """Row by row: greedy takes the argmax, top_k=1 the argmax whatever the draw, a tiny top_p only the
    most likely token, with no filter the draw's position in the CDF in vocabulary order (0.1, 0.7, 1.0) picks
    the token, and top_k=2 the position in the CDF of the two most likely, most likely first (0.6/0.9, 1.0)."""
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]] * 6))
    tokens, log_probs = sample_next_tokens(
        logits,
        temperatures=torch.ones(6),
        top_ks=torch.tensor([0, 1, 0, 0, 0, 2]),
        top_ps=torch.tensor([1.0, 1.0, 0.01, 1.0, 1.0, 1.0]),
        greedy=torch.tensor([True, False, False, False, False, False]),
        uniforms=torch.tensor([0.99, 0.99, 0.99, 0.95, 0.5, 0.7]),
    )
    assert tokens.tolist() == [1, 1, 1, 2, 1, 2]
    torch.testing.assert_close(log_probs, torch.log(torch.tensor([0.6, 0.6, 0.6, 0.3, 0.6, 0.3])))


def test_models_without_full_attention_caches_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with pytest.raises(NotImplementedError, match="full-attention"):
        serving.ContinuousBatchingEngine(MistralForCausalLM(config), eos_token_id=2, device=CPU)
