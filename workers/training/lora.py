"""LoRA with peft (``actor_rollout_ref.model.lora_rank`` > 0, or ``lora_adapter_path``): the actor trains low-rank
adapters on a frozen base model.

:func:`with_lora` wraps a loaded causal LM (new adapters, or those of ``lora_adapter_path``); :class:`Adapter` is
what the actor does with them: their tensors (what a checkpoint holds and the transformers rollout takes at each
sync), the base model with the adapter disabled (the reference policy), the merged full weights (the export, and
engines that load full weights: vLLM, the rollout service's replicas) and the weights' digests. Details:
docs/lora.md.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec
import torch

from ppoflow.configs.schema import ModelConfig, PPOConfig
from ppoflow.storage.batch import tensors_digest

ADAPTER_DIR = "adapter"
"""The subfolder of a Hugging Face export that holds the adapter alone (peft's format)."""


def with_lora(model: torch.nn.Module, cfg: ModelConfig, *, seed: int):
    """``model`` (a loaded causal LM) as a peft model whose LoRA adapters alone are trainable: those of
    ``cfg.lora_adapter_path`` (their own rank, alpha and target modules), else new ones of ``lora_rank`` on
    ``target_modules``, A drawn from ``seed`` and B zero (so the policy starts as the base model)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings(), torch.random.fork_rng():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        if cfg.lora_adapter_path is not None:
            with _local_directory(cfg.lora_adapter_path) as directory:
                return PeftModel.from_pretrained(model, directory, is_trainable=True)
        config = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=cfg.target_modules,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)


@contextmanager
def _local_directory(path: str):
    """A local directory holding the files of ``path`` (a local path or any fsspec URL, copied for the while)."""
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(path))
    if "file" in fs.protocol:
        yield root
        return
    with tempfile.TemporaryDirectory() as staging:
        fs.get(f"{root.rstrip('/')}/", staging, recursive=True)
        yield staging


def rollout_holds_adapter(cfg: PPOConfig) -> bool:
    """Whether the rollout serves base + adapter and takes the adapter's tensors at each sync: the transformers
    rollout worker does; vLLM and the rollout service's replicas load merged full weights instead."""
    rollout = cfg.actor_rollout_ref.rollout
    return cfg.actor_rollout_ref.model.lora and rollout.name == "hf" and rollout.mode == "sync"


def _is_adapter_tensor(name: str) -> bool:
    return ".lora_" in name


def _merged(layer) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' updates, summed in float32, in the weight's dtype."""
    weight = layer.base_layer.weight.detach()
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            merged = merged + layer.get_delta_weight(adapter).detach().float()
    return merged.to(weight.dtype)


class Adapter:
    """The LoRA adapter of a peft ``model`` (:func:`with_lora`) and the base model it adapts."""

    def __init__(self, model):
        self.model = model
        self._base_digest: str | None = None

    @property
    def base(self) -> torch.nn.Module:
        """The transformers model with the LoRA layers in it (its forward pass: base + adapter)."""
        return self.model.get_base_model()

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors, named as in :attr:`base` (the names a rollout model wrapped alike has)."""
        return {name: tensor.detach() for name, tensor in self.base.named_parameters() if tensor.requires_grad}

    @contextmanager
    def disabled(self):
        """Within: the model computes as its base model, the adapter switched off (the reference policy)."""
        with self.model.disable_adapter():
            yield

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`merged_items` as a dict."""
        return dict(self.merged_items())

    def merged_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights of base + adapter under the base model's own names, one at a time: each adapted layer's
        weight plus its adapter's update (computed in float32, cast back) as it comes, so a caller that uses each
        before taking the next (a cast copy) holds one merged layer at a time; the model is left as it is (no merge
        in place, so no rounding drifts into the base weights)."""
        from peft.tuners.lora import LoraLayer

        adapted = {f"{name}.weight": layer for name, layer in self.base.named_modules() if isinstance(layer, LoraLayer)}
        for name, tensor in self.base_weights().items():
            layer = adapted.get(name)
            yield name, tensor if layer is None else _merged(layer)

    def base_digest(self) -> str:
        """Digest of the base model's weights, computed once (they never change): the digest a plain copy of the
        base model has (:func:`~ppoflow.workers.training.learner.weights_digest`), so a reference pass cached by
        a run without LoRA stays valid."""
        if self._base_digest is None:
            self._base_digest = tensors_digest(self.base_weights())
        return self._base_digest

    def digest(self) -> str:
        """Digest of base + adapter: the adapter's tensors hashed with the base's digest (cheap: the base is not
        hashed again)."""
        return tensors_digest(self.weights(), self.base_digest())

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The base model's state under its own names (no ``base_layer``), adapter tensors left out."""
        return {
            name.replace(".base_layer.", "."): tensor.detach()
            for name, tensor in self.base.state_dict().items()
            if not _is_adapter_tensor(name)
        }
