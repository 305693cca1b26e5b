"""Hugging Face hub ids (``Qwen/Qwen3-8B``) as model paths, resolved the way transformers resolves them: the model's
snapshot in the local hub cache, downloaded first unless ``HF_HUB_OFFLINE`` is set. Which paths are hub ids:
:func:`~ppoflow.storage.fs.is_hub_id`; :mod:`ppoflow.workers.models` reads them through here.
"""

from __future__ import annotations


def hub_snapshot(repo_id: str) -> str | None:
    """The local directory of the Hugging Face hub model ``repo_id``, found as transformers finds it: its snapshot in
    the hub cache, downloaded first unless ``HF_HUB_OFFLINE`` is set; None when it is not there offline (or the hub
    has no such model)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=constants.HF_HUB_OFFLINE)
    except (LocalEntryNotFoundError, HfHubHTTPError):
        return None


def hub_cache() -> str:
    """Where the hub cache is (``HF_HUB_CACHE``, ``~/.cache/huggingface/hub`` by default)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_absent(repo_id: str) -> str:
    """Why a hub id's model cannot load: not in the cache offline, or not on the hub."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return (
            f"{repo_id!r} is a Hugging Face hub id, and HF_HUB_OFFLINE is set but the hub cache ({hub_cache()}) has "
            f"no snapshot of it: download it first (hf download {repo_id}), or point the key at a local directory"
        )
    return f"{repo_id!r} is a Hugging Face hub id the hub did not serve (no such model, or no access to it)"
