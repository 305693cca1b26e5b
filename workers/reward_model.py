"""The reward model worker (``reward_model.enable``): a Hugging Face sequence-classification model with one label,
or a causal LM with a value head (TRL's ``v_head.summary``), scoring each response on its prompt + response
chat-formatted and re-tokenised with the reward model's own tokenizer (verl's re-tokenisation). Which head a model
has is read from its files (:func:`reward_head`: ``config.json`` and the safetensors headers, never the weights),
which the preflight checks before Ray starts. Details: docs/reward_models.md.
"""

from __future__ import annotations

import json
import os
import struct

import fsspec
import torch

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig, TinyModelConfig
from ppoflow.configs.schema_algorithm import RewardModelPathConfig
from ppoflow.storage.batch import tensors_digest
from ppoflow.workers.memory import ReportsMemory
from ppoflow.workers.models import (
    dtype_of,
    load_tokenizer,
    local_model_dir,
    model_config,
    set_up_worker_process,
    tiny_llama_config,
    tiny_tokenizer,
)
from ppoflow.workers.remote_reward import RewardSample
from ppoflow.workers.stage import worker_stage
from ppoflow.workers.training.packing import token_budget_parts

SEQUENCE_CLASSIFICATION, VALUE_HEAD = "sequence classification", "value head"
VALUE_HEAD_PREFIX = "v_head.summary."
"""TRL's ``AutoModelForCausalLMWithValueHead`` saves its head as ``v_head.summary.weight`` / ``.bias``."""
PATH_KEY = "reward_model.model.path"


def safetensors_names(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, in the model directory ``path`` (local or fsspec URL), read
    from the index or the single file's JSON header alone; empty when the model has no safetensors files."""
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(path))
    root = root.rstrip("/")
    if fs.exists(f"{root}/model.safetensors.index.json"):
        return dict(json.loads(fs.cat_file(f"{root}/model.safetensors.index.json"))["weight_map"])
    if not fs.exists(f"{root}/model.safetensors"):
        return {}
    with fs.open(f"{root}/model.safetensors", "rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    return {name: "model.safetensors" for name in header if name != "__metadata__"}


def reward_head(model: RewardModelPathConfig) -> str:
    """The head of the reward model at ``model.path``: :data:`SEQUENCE_CLASSIFICATION` (one label) or
    :data:`VALUE_HEAD`; :class:`ConfigError` naming ``reward_model.model.path`` when it has neither."""
    config = model_config(model, PATH_KEY)
    architectures = config.get("architectures") or [config["model_type"]]
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        labels = config.get("num_labels") or len(config.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})
        if labels != 1:
            raise ConfigError([(PATH_KEY, f"{model.path} scores {labels} labels; a reward model scores one")])
        return SEQUENCE_CLASSIFICATION
    if any(name.endswith("ForCausalLM") for name in architectures) and any(
        name.startswith(VALUE_HEAD_PREFIX) for name in safetensors_names(model.path)
    ):
        return VALUE_HEAD
    raise ConfigError(
        [
            (
                PATH_KEY,
                f"{model.path} holds a {', '.join(architectures)}, neither a sequence-classification model with one "
                f"label nor a causal LM with a value head ({VALUE_HEAD_PREFIX}weight in its safetensors)",
            )
        ]
    )


class ValueHeadModel(torch.nn.Module):
    """A causal LM's last hidden states through a linear value head: one score per position."""

    def __init__(self, base, head: torch.nn.Linear):
        super().__init__()
        self.base, self.v_head = base, head

    def forward(self, input_ids, attention_mask):
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return self.v_head(hidden.hidden_states[-1]).squeeze(-1)


def load_reward_model(model: RewardModelPathConfig, head: str) -> torch.nn.Module:
    """``model.path`` in ``model.dtype`` with its ``head``: a sequence classifier, or a :class:`ValueHeadModel`."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    directory, dtype = local_model_dir(model.path), dtype_of(model)
    options = {"dtype": dtype, "trust_remote_code": model.trust_remote_code}
    if head == SEQUENCE_CLASSIFICATION:
        return AutoModelForSequenceClassification.from_pretrained(directory, **options)
    base = AutoModelForCausalLM.from_pretrained(directory, **options)
    weights = {}
    for name, file in safetensors_names(directory).items():
        if name.startswith(VALUE_HEAD_PREFIX):
            with safe_open(os.path.join(directory, file), framework="pt") as tensors:
                weights[name.removeprefix(VALUE_HEAD_PREFIX)] = tensors.get_tensor(name)
    linear = torch.nn.Linear(weights["weight"].shape[1], 1, bias="bias" in weights, dtype=dtype)
    linear.load_state_dict(weights)
    return ValueHeadModel(base, linear)


def chat_text(tokenizer, sample: RewardSample) -> str:
    """The prompt and response as the reward model reads them: through its chat template as a user and an
    assistant turn, or joined when its tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return sample.prompt + sample.response
    turns = [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": sample.response}]
    return tokenizer.apply_chat_template(turns, tokenize=False)


class RewardModelWorker(ReportsMemory):
    """The reward model in a Ray actor of its own (``reward_model.resources``), loaded once; stateless, so Ray may
    restart it after a crash."""

    def __init__(self, cfg: PPOConfig):
        self.settings = cfg.reward_model
        self.device = set_up_worker_process(self.settings.resources)
        self.tokenizer = load_tokenizer(self.settings.model)
        self.head = reward_head(self.settings.model)
        self.model = load_reward_model(self.settings.model, self.head).to(self.device).eval()

    @worker_stage("compute_rm_score")
    def score(self, samples: list[RewardSample]) -> tuple[list[float], dict[str, list[float]]]:
        """Each sample's score (the head's output at its last token), in forward passes of at most
        ``micro_batch_size_per_gpu`` responses or, with ``use_dynamic_bsz``, ``forward_max_token_len_per_gpu``
        tokens; a sequence past ``max_length`` keeps its last tokens (the response's end)."""
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        ids = [
            self.tokenizer(chat_text(self.tokenizer, sample), add_special_tokens=not templated)["input_ids"]
            for sample in samples
        ]
        if self.settings.max_length:
            ids = [row[-self.settings.max_length :] for row in ids]
        scores = [0.0] * len(ids)
        for rows in self._passes([len(row) for row in ids]):
            for row, value in zip(rows, self._forward([ids[row] for row in rows]).tolist()):
                scores[row] = float(value)
        return scores, {}

    def _passes(self, lengths: list[int]) -> list[list[int]]:
        settings = self.settings
        if settings.use_dynamic_bsz:
            return token_budget_parts([lengths], settings.forward_max_token_len_per_gpu)[0]
        size = settings.micro_batch_size_per_gpu or len(lengths)
        return [list(range(start, min(start + size, len(lengths)))) for start in range(0, len(lengths), size)]

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """The scores of ``rows`` (token ids), left-padded into one batch: the output at each row's last token."""
        width, pad = max(len(row) for row in rows), self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=self.device)
        if self.head == VALUE_HEAD:
            return self.model(input_ids, mask)[:, -1].float().cpu()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = pad
        return self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().cpu()

    def weights_digest(self) -> str:
        """sha256 over the reward model's tensors: a cached reward_model stage names the weights it scored with."""
        return tensors_digest(self.model.state_dict())


def build_tiny_reward_model(path: str, spec: TinyModelConfig, *, head: str = SEQUENCE_CLASSIFICATION):
    """A random-init tiny Llama reward model (one label, or a causal LM with a value head) and the tiny character
    tokenizer, as a model directory at ``path``; returns the model (tests train it before saving it again)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = tiny_tokenizer()
    config = tiny_llama_config(spec, tokenizer, num_labels=1)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = (LlamaForSequenceClassification if head == SEQUENCE_CLASSIFICATION else LlamaForCausalLM)(config)
        if head == VALUE_HEAD:
            model = ValueHeadModel(model, torch.nn.Linear(spec.hidden_size, 1))
    save_reward_model(model, tokenizer, path)
    return model, tokenizer


def save_reward_model(model: torch.nn.Module, tokenizer, path: str) -> None:
    """Write a reward model as a Hugging Face directory; a value-head model as TRL does (the causal LM's files,
    its head under ``v_head.summary.*`` in the same safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(os.path.expanduser(path), exist_ok=True)
    tokenizer.save_pretrained(path)
    if not isinstance(model, ValueHeadModel):
        model.save_pretrained(path)
        return
    model.base.save_pretrained(path)
    file = os.path.join(os.path.expanduser(path), "model.safetensors")
    from safetensors.torch import load_file

    weights = load_file(file)
    weights.update({f"{VALUE_HEAD_PREFIX}{name}": value for name, value in model.v_head.state_dict().items()})
    save_file({name: value.contiguous() for name, value in weights.items()}, file, metadata={"format": "pt"})
