"""Fitting a cached step onto this step's prompts (storage/step_cache/remap.py): verl's V1 uid remap."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict

from ppoflow.storage.batch import non_tensor_column
from ppoflow.storage.step_cache import remap_to_prompts
from tests.step_cache_helpers import CACHE_LOGGER, make_batch, warnings_text


def test_remap_reproduces_verls_worked_example(caplog: pytest.LogCaptureFixture):
    cached = make_batch(["A", "B", "A", "B", "C"])
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        remapped = remap_to_prompts(cached, ["x", "y", "z", "w"], n=2)
    # x<-A, y<-B, z<-C (short group cycles), w<-A: cached rows 0,2 | 1,3 | 4,4 | 0,2
    assert remapped["prompts"][:, 0].tolist() == [0, 2, 1, 3, 4, 4, 0, 2]
    assert non_tensor_column(remapped, "uid") == ["x", "x", "y", "y", "z", "z", "w", "w"]
    assert remapped["group_index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert remapped["group_index"].dtype == torch.int64
    assert non_tensor_column(remapped, "ground_truth") == [
        non_tensor_column(cached, "ground_truth")[row] for row in [0, 2, 1, 3, 4, 4, 0, 2]
    ]
    text = warnings_text(caplog)
    assert "3 prompt groups" in text and "4 prompts" in text and "[1]" in text and "n=2" in text


def test_remap_identity_when_shapes_match(caplog: pytest.LogCaptureFixture):
    cached = make_batch(["A", "A", "B", "B"])
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        remapped = remap_to_prompts(cached, ["p", "q"], n=2)
    assert remapped["prompts"][:, 0].tolist() == [0, 1, 2, 3]
    assert torch.equal(remapped["responses"], cached["responses"])
    assert non_tensor_column(remapped, "uid") == ["p", "p", "q", "q"]
    assert warnings_text(caplog) == ""


def test_remap_uses_first_groups_and_truncates_long_groups(caplog: pytest.LogCaptureFixture):
    cached = make_batch(["A", "A", "A", "B", "B", "B", "C", "C", "C"])
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        remapped = remap_to_prompts(cached, ["p", "q"], n=2)
    assert remapped["prompts"][:, 0].tolist() == [0, 1, 3, 4]
    assert "3 prompt groups" in warnings_text(caplog) and "2 prompts" in warnings_text(caplog)


def test_remap_cycles_sessions_of_a_short_group():
    remapped = remap_to_prompts(make_batch(["A", "A", "B"]), ["p", "q"], n=4)
    assert remapped["prompts"][:, 0].tolist() == [0, 1, 0, 1, 2, 2, 2, 2]
    assert remapped.batch_size == torch.Size([8])


def test_remap_needs_cached_groups():
    with pytest.raises(ValueError, match="no trajectory groups"):
        remap_to_prompts(make_batch([]), ["p"], n=2)
    with pytest.raises(ValueError, match="uid"):
        remap_to_prompts(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), ["p"], n=2)
