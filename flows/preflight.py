"""The checks of a run that need I/O but neither Ray nor a model: run before either starts.

:func:`~ppoflow.configs.load_config` checks the values; :func:`preflight` checks what they point at (run directory
and step caches writable within a deadline, the checkpoint to resume from, the Ray cluster, model directories and
tokenizers, the memory the models need, data files, scorers - a custom one called once in a child process - tool
functions, the reward model and service: :mod:`~ppoflow.flows.preflight_rewards`) and collects every problem into
one :class:`~ppoflow.configs.ConfigError`. ``ppoflow train`` calls it before Prefect starts; ``start_run`` calls it
first, so a UI or deployment run fails with the same messages. What a run will build or generate is checked by its
recipe only. Details: docs/reliability.md (Bad input fails first).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from functools import partial
from urllib.parse import urlsplit

from prefect.settings import get_current_settings

from ppoflow.algorithms.scoring import ScorerFailed, ScorerTimedOut, score_one, scorer_for
from ppoflow.configs import ConfigError, config_as_dict, tool_config_file
from ppoflow.configs.cache_settings import storage_settings
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import (
    SYNTHETIC_SOURCES,
    check_batch_fits,
    files_to_generate,
    read_prompt_rows,
    tokenize_rows,
    write_synthetic_dataset,
)
from ppoflow.flows.preflight_rewards import model_reward_problems
from ppoflow.storage.bounded import StorageStalled, bounded, client_timeouts
from ppoflow.storage.checkpoint import checked_manifest
from ppoflow.storage.fs import atomic_write, join, open_fs, path_problem, remove_if_present
from ppoflow.workers.launcher import ray_handshake
from ppoflow.workers.memory_estimate import memory_problems
from ppoflow.workers.models import builds_model, check_context_length, load_tokenizer
from ppoflow.workers.service.scorer_process import ScorerProcess

STORAGE_TIMEOUT_S = 10.0
"""How long a storage probe may take before its location counts as unreachable (s3fs retries a refused
connection for much longer)."""
RAY_CONNECT_TIMEOUT_S = 5.0
"""How long a TCP connection to ``ray.address``, and then Ray's handshake, may take (``ray.init`` itself
retries for minutes)."""
SCORER_START_TIMEOUT_S = 30.0
"""How long the custom scorer may take to start (import); scoring the preflight's one row may then take
``custom_reward_function.timeout_s``, as a call in the run may."""

Problems = list[tuple[str, str]]


_PASSED: set[str] = set()
"""Configs this process has checked already: ``ppoflow train`` checks before Prefect starts, and the flow
run it starts checks again (for runs started from the UI); the second check of the same config is skipped."""


def preflight(cfg: PPOConfig) -> None:
    """Run every check of ``cfg`` that needs I/O but not Ray or a model; :class:`ConfigError` listing every
    problem, each naming its key (and the file or URL)."""
    checked = json.dumps(config_as_dict(cfg), sort_keys=True)
    if checked in _PASSED:
        return
    problems = _storage_problems(cfg) + _ray_problems(cfg) + _reward_manager_problems(cfg) + _agent_problems(cfg)
    problems += model_reward_problems(cfg)
    tokenizer, found = _model_problems(cfg)
    problems += found + _memory_problems(cfg)
    sources, first_row, found = _data_problems(cfg, tokenizer)
    problems += found + _scorer_problems(cfg, sources, first_row)
    if problems:
        raise ConfigError(problems)
    _PASSED.add(checked)


# ------------------------------------------------------------------------------------ storage


def _storage_problems(cfg: PPOConfig) -> Problems:
    """The run directory and every enabled cache take a probe file; a checkpoint to resume from is complete.
    A probe that has not finished after :data:`STORAGE_TIMEOUT_S` counts as unreachable."""
    run_dir, resume_dir = cfg.trainer.default_local_dir, cfg.trainer.resume_from_path
    probes = {"trainer.default_local_dir": (run_dir, partial(_write_probe, run_dir, {}))}
    for stage, skip in cfg.skip.items():
        if skip.enable:  # one attempt, within the deadline: a refused connection is reported as such, at once
            options = client_timeouts(skip.dump_dir, storage_settings(skip), timeout_s=STORAGE_TIMEOUT_S, retries=0)
            probes[f"skip.{stage}.dump_dir"] = (skip.dump_dir, partial(_write_probe, skip.dump_dir, options))
    if cfg.trainer.resume_mode == "resume_path" and resume_dir:
        probes["trainer.resume_from_path"] = (resume_dir, partial(_check_checkpoint, resume_dir))
    problems: Problems = []
    for key, (url, probe) in probes.items():
        problem = path_problem(url, want="directory")  # a symlink loop, a dangling link, a FIFO: say so plainly
        if problem is not None:
            problems.append((key, f"{url} {problem}"))
            continue
        try:
            bounded(probe, timeout_s=STORAGE_TIMEOUT_S, what=f"preflight of {key} ({url})")
        except ConfigError as error:
            problems += error.problems
        except StorageStalled:
            problems.append(
                (
                    key,
                    f"{url} did not answer within {STORAGE_TIMEOUT_S:g} s; check the endpoint "
                    "(storage_options), the network and the credentials",
                )
            )
        except Exception as error:  # noqa: BLE001 - fsspec backends raise their own types (botocore's are not OSError)
            problems.append((key, f"cannot use {url}: {type(error).__name__}: {error}"))
    return problems


def _write_probe(url: str, storage_options: dict) -> None:
    """Write a small file under ``url`` and remove it again (a local directory is created on the way)."""
    fs, path = open_fs(url, storage_options)
    name = join(path, f".ppoflow-preflight-{uuid.uuid4().hex}")
    atomic_write(fs, name, b"preflight")
    remove_if_present(fs, name)


def _check_checkpoint(url: str) -> None:
    fs, path = open_fs(url)
    if not fs.isdir(path):
        raise ConfigError([("trainer.resume_from_path", f"no such checkpoint directory {url}")])
    marker, why = checked_manifest(url)
    if marker is None:
        raise ConfigError(
            [
                (
                    "trainer.resume_from_path",
                    f"{url} is not a complete checkpoint ({why}); resume from another global_step_N directory",
                )
            ]
        )


# ---------------------------------------------------------------------------------------- ray


def _ray_problems(cfg: PPOConfig) -> Problems:
    """The Ray cluster to join (``ray.address``, else env ``RAY_ADDRESS``) answers Ray's own handshake within
    :data:`RAY_CONNECT_TIMEOUT_S`: the GCS's ``GetClusterId`` call, the first one ``ray.init`` makes (or, for
    ``ray://``, the Ray client server's ping), over gRPC with a deadline and without starting Ray here."""
    key, address = (
        ("ray.address", cfg.ray.address) if cfg.ray.address else ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))
    )
    if not address or address in ("auto", "local") or ("://" in address and not address.startswith("ray://")):
        return []  # a local Ray, or a scheme that a Ray plug-in resolves
    parts = urlsplit(f"//{address.removeprefix('ray://')}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or port is None:
        return [(key, f"{address!r} is not host:port or ray://host:port")]
    try:
        socket.create_connection((host, port), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        return [
            (
                key,
                f"no Ray cluster answers at {address} ({type(error).__name__}: {error}); start it "
                "(ray start --head) or leave ray.address and RAY_ADDRESS unset to start a local Ray",
            )
        ]
    client = address.startswith("ray://")
    refusal = ray_handshake(f"{host}:{port}", client=client, timeout_s=RAY_CONNECT_TIMEOUT_S)
    if refusal:
        server = (
            "a Ray client server (ray://, the head's port 10001)" if client else "a Ray cluster (the head's GCS port)"
        )
        return [(key, f"{address} accepts connections but is not {server}: {refusal}")]
    return []


def _reward_manager_problems(cfg: PPOConfig) -> Problems:
    if cfg.reward_model.reward_manager == "ray" and not get_current_settings().api.url:
        return [
            (
                "reward_model.reward_manager",
                "reward_model.reward_manager=ray scores in Prefect tasks on Ray "
                "workers, which must report to a Prefect server: set PREFECT_API_URL",
            )
        ]
    return []


def _agent_problems(cfg: PPOConfig) -> Problems:
    """``rollout.mode=async``: the agent-loop file registers its loops, the default loop is one of them, the
    agent function loads, the tool config reads, and every tool's function imports - in a sandbox process,
    never in this one."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode != "async":
        return []
    from ppoflow.workers.service.agent_loop import AGENT_LOOPS, load_agent_loop_config
    from ppoflow.workers.service.openai_agent import agent_function
    from ppoflow.workers.service.tool_config import TOOL_CONFIG_KEY, load_tool_config
    from ppoflow.workers.service.tools import ToolRunner

    problems: Problems = []
    if rollout.agent.agent_loop_config_path:
        try:
            load_agent_loop_config(rollout.agent.agent_loop_config_path)
        except ConfigError as error:
            problems += error.problems
    if rollout.agent.default_agent_loop not in AGENT_LOOPS:
        problems.append(
            (
                "actor_rollout_ref.rollout.agent.default_agent_loop",
                f"unknown agent loop {rollout.agent.default_agent_loop!r}; registered: "
                f"{', '.join(sorted(AGENT_LOOPS))}",
            )
        )
    try:
        function = agent_function(cfg)
        if function is not None:
            function.load()
    except ValueError as error:
        problems.append(("actor_rollout_ref.rollout.agent.agent_function", str(error)))
    key = TOOL_CONFIG_KEY
    if rollout.multi_turn.tool_config_path:
        try:
            specs = load_tool_config(tool_config_file(rollout.multi_turn.tool_config_path), key)
        except ConfigError as error:
            return problems + error.problems
        with ToolRunner(specs) as runner:
            problems += [(key, message) for message in runner.check()]
    return problems


# ------------------------------------------------------------------------------ models and data


def _model_problems(cfg: PPOConfig):
    """Every model's config and context length (its build recipe's when it is to be built); the actor's
    tokenizer, returned for the data checks (None when it cannot be loaded yet)."""
    needed = cfg.data.max_prompt_length + cfg.data.max_response_length
    models = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model}
    if cfg.use_critic:
        models["critic.model.path"] = cfg.critic.model
    problems: Problems = []
    for key, model in models.items():
        try:
            check_context_length(model, needed, key)
        except ConfigError as error:
            problems += error.problems
    actor = cfg.actor_rollout_ref.model
    if builds_model(actor) or any(key.startswith("actor_rollout_ref.") for key, _ in problems):
        return None, problems
    key = "actor_rollout_ref.model.tokenizer_path" if actor.tokenizer_path else "actor_rollout_ref.model.path"
    try:
        return load_tokenizer(actor), problems
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, tokenizers' own errors, ...
        return None, problems + [
            (
                key,
                f"the tokenizer of {actor.tokenizer_path or actor.path} does not load: {type(error).__name__}: {error}",
            )
        ]


def _memory_problems(cfg: PPOConfig) -> Problems:
    """The bytes the roles' copies of the models need, counted from their configs, against the RAM and GPUs of a
    local run (:func:`~ppoflow.workers.memory_estimate.memory_problems`; a model still to be built is not counted)."""
    return memory_problems(cfg)


def _data_problems(cfg: PPOConfig, tokenizer) -> tuple[dict[str, set[str]], dict | None, Problems]:
    """Every data file that exists (or is not generated) reads, has verl's columns and, when the tokenizer
    is there, tokenizes; returns the data sources by key and the first training row (None when the
    training data does not read)."""
    data = cfg.data
    try:
        generated = files_to_generate(data)
    except ConfigError as error:
        return {}, None, list(error.problems)
    sources: dict[str, set[str]] = {}
    first_row = None
    problems: Problems = []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if files is None:
            continue
        if key in generated:
            sources[key] = {SYNTHETIC_SOURCES[data.synthetic.task]}
            if key == "data.train_files":
                first_row = _first_generated_row(data)
            continue
        try:
            rows = read_prompt_rows(files, data, key=key)
        except ConfigError as error:
            problems += error.problems
            continue
        sources[key] = {row["data_source"] for row in rows}
        if key == "data.train_files" and rows:
            first_row = rows[0]
        if tokenizer is None:
            continue
        try:
            dataset = tokenize_rows(rows, data, tokenizer, key=key)
            if key == "data.train_files":
                check_batch_fits(len(dataset), data.train_batch_size)
        except ConfigError as error:
            problems += error.problems
    return sources, first_row, problems


def _first_generated_row(data) -> dict:
    """The first training row ``data.synthetic`` will generate: generated (from the same seeded stream) into
    memory and read back as the run will read its file."""
    url = f"memory://ppoflow-preflight/{uuid.uuid4().hex}.parquet"
    write_synthetic_dataset(data.synthetic.model_copy(update={"train_rows": 1}), url, None)
    try:
        return read_prompt_rows(url, data, key="data.train_files")[0]
    finally:
        fs, path = open_fs(url)
        remove_if_present(fs, path)


def _scorer_problems(cfg: PPOConfig, sources: dict[str, set[str]], first_row: dict | None) -> Problems:
    """A custom scorer imports and scores the first training row (its ground truth, as text, for the
    response), as the reward stage calls it, with a finite number or a dict with one under ``score``: in a
    process of its own (:class:`ScorerProcess`), so that it can neither end nor hang this one. Without a
    custom scorer, every data source has a built-in scorer - or a reward model or service scores it."""
    custom = cfg.custom_reward_function
    if custom.path:
        problems, extras = _custom_scorer_problems(custom, first_row)
        return problems + _filter_metric_problems(cfg, extras)
    if cfg.reward_model.model_based:
        return []
    problems: Problems = []
    for key, found in sources.items():
        for source in sorted(found):
            try:
                scorer_for(source, None)
            except ValueError as error:
                problems.append((key, str(error)))
    if problems or first_row is None:
        return problems
    truth = first_row["reward_model"].get("ground_truth")
    _, extras = score_one(
        first_row["data_source"], "" if truth is None else str(truth), truth, sample="the first row", extra_info=None
    )
    return _filter_metric_problems(cfg, extras)


def _filter_metric_problems(cfg: PPOConfig, extras: dict | None) -> Problems:
    """``algorithm.filter_groups.metric=acc`` needs a scorer that reports ``acc``: checked on the first row's."""
    filtering = cfg.algorithm.filter_groups
    if not filtering.enable or filtering.metric != "acc" or extras is None or "acc" in extras:
        return []
    reported = ", ".join(sorted(extras)) or "nothing beside its score"
    return [
        (
            "algorithm.filter_groups.metric",
            f"acc, but the scorer reports no `acc` for the first row of data.train_files (it reports {reported}); "
            "use score, seq_reward or seq_final_reward",
        )
    ]


_AS_THE_REWARD_STAGE = (
    ", called as the reward stage calls it (data_source, its ground truth as the response, ground_truth, extra_info)"
)


def _custom_scorer_problems(custom, row: dict | None) -> tuple[Problems, dict | None]:
    """What keeps the custom scorer from scoring ``row``: a call past ``custom_reward_function.timeout_s`` is that
    key's problem, whatever ``on_timeout`` says (a run whose scorer hangs on a real row would learn nothing), any
    other failure ``custom_reward_function.path``'s; and the extra values it reported for the row (None: not
    scored)."""
    key = "custom_reward_function.path"
    with ScorerProcess(
        custom.path, custom.name, timeout_s=custom.timeout_s, start_timeout_s=SCORER_START_TIMEOUT_S
    ) as scorer:
        try:
            problem = scorer.import_error()
            if problem or row is None:
                return ([(key, problem)] if problem else []), None
            truth = row["reward_model"].get("ground_truth")
            _, extras = score_one(
                row["data_source"],
                "" if truth is None else str(truth),
                truth,
                scorer,
                sample=f"the first row of data.train_files (data source {row['data_source']!r})",
                extra_info=row.get("extra_info"),
            )
        except ScorerTimedOut as error:
            return [
                (
                    "custom_reward_function.timeout_s",
                    f"{error}{_AS_THE_REWARD_STAGE}; raise it if the scorer is only slow",
                )
            ], None
        except ScorerFailed as error:  # a non-finite score too
            return [(key, f"{error}{_AS_THE_REWARD_STAGE}")], None
    return [], extras
