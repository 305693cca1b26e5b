"""The synthetic ``vault`` task: a task a tiny model can solve with a tool and hardly without one.

Every key (``digits`` digits) opens a vault holding a code (as many digits), drawn once from a fixed
seeded shuffle: nothing about a key tells its code, so without help a model can only memorise the
table entry by entry. The prompt is the key followed by ``>`` (``37>``) and the answer is the code
followed by EOS. The ``vault`` tool returns the code of the prompt's key; the dataset fixes the key
for it (``extra_info.tools_kwargs``, verl's per-row tool arguments), so a call is just ``?`` in the
``question_mark`` tool format, and the model then has to copy the answer it was given:

    37>  ?  =58>  58</s>        (prompt, call, the tool's answer (masked), the model's answer)

With ``data.synthetic.copy_share`` some train rows are copy rows: a vault row up to the tool's answer,
with random digits for the answer (``37>?=58>`` -> ``58``), answered without tools. Reading the tool's
answer is copying it, a skill the model has to learn somewhere, and a copy row teaches it in the very
context where a vault row needs it (docs/benchmarks.md compares it with bare ``=58>`` copy rows); the
random digits teach copying, not the vault's codes. ``configs/vault_tool.yaml`` trains it; ``configs/tools/vault.yaml``
declares the tool.
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
