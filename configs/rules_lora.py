"""The rules of LoRA (``model.lora_rank`` > 0 or ``model.lora_adapter_path``; :mod:`ppoflow.configs.rules` runs
them with the others): one training rank, an adapter directory that holds a plain LoRA adapter, a critic that
trains in full. Details: docs/lora.md.
"""

from __future__ import annotations

import os

from ppoflow.configs.schema import PPOConfig


def lora_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """What LoRA (``model.lora_rank`` > 0 or ``model.lora_adapter_path``) needs: the actor's adapter on one
    training rank, an adapter directory that holds one, and a critic that trains in full."""
    errors: list[tuple[str, str]] = []
    model, key = cfg.actor_rollout_ref.model, "actor_rollout_ref.model"
    lora_key = f"{key}.lora_rank" if model.lora_rank > 0 else f"{key}.lora_adapter_path"
    if model.lora and cfg.data_parallel_size > 1:
        errors.append(
            (
                lora_key,
                f"LoRA trains on one rank so far, but the training roles have {cfg.data_parallel_size} "
                "(trainer.nnodes x trainer.n_gpus_per_node, or x trainer.n_cpu_ranks_per_node on CPUs); "
                "set those to 1, or lora_rank=0 and lora_adapter_path=null",
            )
        )
    if model.lora_adapter_path is not None:
        errors += _adapter_path_errors(model.lora_adapter_path, f"{key}.lora_adapter_path")
    critic = cfg.critic.model
    if cfg.use_critic and critic.lora:
        errors.append(
            (
                f"critic.model.{'lora_rank' if critic.lora_rank > 0 else 'lora_adapter_path'}",
                "a LoRA critic is not supported yet (its new value head would have to train beside the "
                "adapter): the critic trains in full; set critic.model.lora_rank=0 and lora_adapter_path=null",
            )
        )
    return errors


def _adapter_path_errors(path: str, key: str) -> list[tuple[str, str]]:
    """``path`` must hold a plain LoRA adapter of peft's (``adapter_config.json``): no other kind of adapter,
    no DoRA, no fully trained modules beside it (``modules_to_save``), which the merged weights would miss."""
    import json

    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(os.path.expanduser(path))
        config = json.loads(fs.cat_file(f"{root.rstrip('/')}/adapter_config.json"))
    except FileNotFoundError:
        return [(key, f"{path} holds no peft adapter (no adapter_config.json)")]
    except Exception as error:  # noqa: BLE001 - fsspec backends raise their own errors (credentials, ...)
        return [(key, f"{path}/adapter_config.json cannot be read: {type(error).__name__}: {error}")]
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return [(key, f"{path} holds no LoRA adapter (adapter_config.json: peft_type must be LORA)")]
    if config.get("use_dora") or config.get("modules_to_save"):
        return [(key, f"{path} is a DoRA adapter or trains whole modules too (modules_to_save): not supported")]
    return []
