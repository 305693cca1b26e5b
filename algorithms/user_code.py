"""Importing user code a config names - a reward scorer, a replay-buffer sampler, a module of trainer
modes - in one way, so that every such key accepts the same spellings and fails with the same kind of
message: a ``ValueError`` saying what is wrong with the path, to which the caller adds the config key."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any


def import_module(path: str) -> ModuleType:
    """The module at ``path``: a ``.py`` file (imported under a fresh name) or an importable module name."""
    try:
        if not path.endswith(".py"):
            return importlib.import_module(path)
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"no such file {path!r}")
        spec = importlib.util.spec_from_file_location(f"ppoflow_user_{file.stem}_{uuid.uuid4().hex[:8]}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as an import does: dataclasses and pickling look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        return module
    except ValueError as error:
        if str(error).startswith("no such file"):
            raise
        raise ValueError(f"cannot import {path!r}: {type(error).__name__}: {error}") from None
    except Exception as error:  # noqa: BLE001 - user code may raise anything while it is imported
        raise ValueError(f"cannot import {path!r}: {type(error).__name__}: {error}") from None


def load_object(path: str, name: str | None, *, kind: str = "") -> Any:
    """The object ``name`` of the module at ``path`` (a ``.py`` file or a module name), or of
    ``module:object`` when ``path`` has that form (``name`` is then ignored); ``kind`` describes it in
    the message when it is missing (``callable``, ``class``)."""
    source, _, attribute = (path, "", "") if path.endswith(".py") else path.partition(":")
    name = attribute or name
    if not name:
        raise ValueError(f"{path!r} names a module but no object in it")
    module = import_module(source)
    if not hasattr(module, name):
        raise ValueError(f"{path!r} has no {kind + ' ' if kind else ''}{name!r}")
    return getattr(module, name)
