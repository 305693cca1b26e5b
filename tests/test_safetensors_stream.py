"""The export's safetensors writer: a file written tensor by tensor reads back as safetensors wrote it, refuses a
stream unlike its layout; a full fine-tuning export goes through it and loads back exactly, and a LoRA export
through it holds the merged weights (tests/test_lora.py loads them)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ppoflow.storage.safetensors_stream import write_safetensors
from ppoflow.workers.models import load_causal_lm, unconverted_layout
from tests.conftest import model_config

TENSORS = {
    "a": torch.arange(6, dtype=torch.float32).view(2, 3),
    "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "c": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 4),
    "d": torch.arange(10, dtype=torch.int64)[::2],  # not contiguous
}


def test_a_streamed_file_reads_back_as_written(tmp_path):
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, TENSORS, iter(TENSORS.items()), {"format": "pt"})
    loaded = load_file(path)
    assert set(loaded) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as file:
        assert file.metadata() == {"format": "pt"}


@pytest.mark.parametrize(
    "stream, problem",
    [
        ([("a", TENSORS["a"]), ("c", TENSORS["c"])], "'c' torch.bool \\[3\\] is not the layout's next entry \\('b'"),
        ([("a", TENSORS["a"].double())], "'a' torch.float64 \\[2, 3\\] is not the layout's next entry \\('a'"),
        (list(TENSORS.items()) + [("z", TENSORS["a"])], "'z' .* \\(none left\\)"),
        ([("a", TENSORS["a"])], "no tensor came for \\['b', 'c', 'empty'\\] ..."),
    ],
)
def test_a_stream_unlike_its_layout_is_refused(tmp_path, stream, problem):
    with pytest.raises(ValueError, match=problem):
        write_safetensors(str(tmp_path / "model.safetensors"), TENSORS, iter(stream))


def test_a_plain_model_streams_without_its_tied_alias(tiny_model):
    """The tiny Llama has no weight conversion in transformers, so its export streams; its tied output head is
    the embedding under a second name, left out as transformers leaves it out."""
    model = load_causal_lm(model_config(tiny_model))
    weights = model.state_dict()
    layout = unconverted_layout(model, weights)
    assert layout is not None and set(layout) < set(weights)
    assert set(weights) - set(layout) == {"lm_head.weight"} and model.config.tie_word_embeddings


def test_a_full_fine_tuning_export_streams_and_loads_as_the_trained_model(tiny_overrides, tmp_path, monkeypatch):
    """The actor writes its trained weights tensor by tensor (the writer sees every weight but the tied alias,
    one at a time), and transformers loads them back exactly."""
    import ppoflow.workers.models as models
    from ppoflow.configs import load_config
    from ppoflow.workers.training.policy import ActorWorker

    written = []

    def watched(path, layout, tensors, metadata):
        def each():
            for name, tensor in tensors:
                written.append(name)
                yield name, tensor

        return write_safetensors(path, layout, each(), metadata)

    monkeypatch.setattr(models, "write_safetensors", watched)
    actor = ActorWorker(load_config("grpo_tiny", tiny_overrides))
    with torch.no_grad():
        for parameter in actor.model.parameters():
            parameter.add_(0.25)  # weights no load could give back by chance
    actor.save_pretrained(str(tmp_path / "hf"))
    state = actor.model.state_dict()
    assert written == [name for name in state if name != "lm_head.weight"]
    loaded = load_causal_lm(model_config(str(tmp_path / "hf"))).state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[name], state[name]) for name in state)
