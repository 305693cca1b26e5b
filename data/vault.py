"""The synthetic ``vault`` task: a task a tiny model can solve with a tool and hardly without one.

Every key (``digits`` digits) opens a vault holding a code drawn once from a fixed seeded shuffle, so nothing about
a key tells its code. The prompt is the key and ``>`` (``37>``), the answer the code and EOS; the ``vault`` tool
returns the code of the row's key (fixed by ``extra_info.tools_kwargs``), so a call is just ``?`` in the
``question_mark`` format: ``37>  ?  =58>  58</s>``. With ``data.synthetic.copy_share`` some train rows are copy
rows (``37>?=58>`` -> random digits, no tools), which teach reading the tool's answer in the context a vault row
needs it. ``configs/vault_tool.yaml`` trains it; ``configs/tools/vault.yaml`` declares the tool.
Details: docs/rollout_service.md#a-tool-task-on-the-cpu.
"""

from __future__ import annotations

import random

VAULT_SEED = 20261201
"""Seed of the key -> code table (fixed: the tool and the dataset must agree on it)."""


def vault_code(key: str) -> str:
    """The code the vault of ``key`` holds (a permutation of all codes of the key's length)."""
    size = 10 ** len(key)
    codes = list(range(size))
    random.Random(f"{VAULT_SEED}/{len(key)}").shuffle(codes)
    return f"{codes[int(key)]:0{len(key)}d}"


def vault(key: str) -> str:
    """The tool: open the vault of ``key`` (the row's key, fixed by the dataset)."""
    if not key.isdigit():
        raise ValueError(f"a vault key is digits, got {key!r}")
    return vault_code(key)
