"""``ppoflow cache ls|show|rm``: list, decode and remove the step caches under a ``dump_dir``
(:mod:`ppoflow.storage.step_cache`). Imports nothing heavy until the command runs, as the rest of the CLI."""

from __future__ import annotations

import json
import sys


def cache(args) -> int:
    """``cache ls|show|rm``. Bad options, a dump_dir that is no directory (missing, a file, a symlink loop,
    ...) or an entry ``show`` cannot read end in one line naming the path and exit 2; ``ls`` exits 1 after
    listing every entry when any is invalid (unless ``--list-only``)."""
    from ppoflow.configs import ConfigError
    from ppoflow.storage.fs import StorageError

    try:
        return _cache_command(args, _storage_options(args.storage_options))
    except (ConfigError, StorageError, OSError) as error:
        if args.debug:
            raise
        if isinstance(error, ConfigError):  # --storage-options
            message = "; ".join(f"{key}: {text}" for key, text in error.problems)
        elif isinstance(error, StorageError):  # the dump_dir, or a damaged or oversized entry: "path: reason"
            message = str(error)
        else:  # dump_dir itself: permissions, an unreachable endpoint
            message = f"{args.dump_dir}: {type(error).__name__}: {error}"
        print(f"ppoflow: {message}", file=sys.stderr)
        return 2


def _storage_options(text: str) -> dict:
    """``--storage-options``: a JSON object, or :class:`ConfigError`."""
    from ppoflow.configs import ConfigError

    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError([("--storage-options", f"{text!r} is not JSON ({error})")]) from None
    if not isinstance(options, dict):
        raise ConfigError([("--storage-options", f"{text!r} is not a JSON object of fsspec options")])
    return options


def _cache_command(args, options: dict) -> int:
    from ppoflow.storage import step_cache

    step_cache.check_root(args.dump_dir, options)
    verify = args.cache_command == "ls" and not args.quick
    entries = step_cache.scan(args.dump_dir, options, verify=verify)
    if args.cache_command == "ls":
        print(f"{'project':<28} {'config':<24} {'step':>6} {'stage':<14} {'valid':<6} {'bytes':>10}  reason")
        for entry in entries:
            print(
                f"{entry.project:<28} {entry.config:<24} {entry.step:>6} {entry.stage:<14} "
                f"{'yes' if entry.valid else 'NO':<6} {entry.nbytes:>10}  {entry.reason}"
            )
        print(
            f"{len(entries)} entries, {sum(e.valid for e in entries)} valid, "
            f"{sum(e.nbytes for e in entries)} payload bytes "
            + (
                "(every payload read, checksummed and decoded, as a replay would)"
                if verify
                else "(markers and sizes checked; payloads not read)"
            )
        )
        invalid = sum(not entry.valid for entry in entries)
        if invalid and not args.list_only:
            print(
                f"ppoflow: {args.dump_dir}: {invalid} of {len(entries)} entries are invalid (listed above; "
                "`ppoflow cache rm` removes one, --list-only lists without failing)",
                file=sys.stderr,
            )
            return 1
        return 0
    matches = [
        e
        for e in entries
        if e.step == args.step
        and (args.project in (None, e.project))
        and (args.config_dir in (None, e.config))
        and (args.stage in (None, e.stage))
    ]
    locations = sorted({(e.project, e.config) for e in matches})
    if len(locations) != 1:
        found = ", ".join(f"{p}/{c}" for p, c in locations) or "none"
        print(
            f"ppoflow: {args.dump_dir}: step {args.step} matches {len(locations)} cache directories ({found}); "
            "narrow it with --project/--config",
            file=sys.stderr,
        )
        return 2
    ((project, config_dir),) = locations
    root = f"{args.dump_dir.rstrip('/')}/{project}/{config_dir}"
    if args.cache_command == "rm":
        for entry in matches:  # Prefect's record of an entry is derived from its marker: nothing else to remove
            step_cache.StepCache(root, stage=entry.stage, storage_options=options).remove(args.step)
            print(f"removed {entry.stage} of step {args.step} from {root}")
        return 0
    return _show_step(
        step_cache.StepCache(root, stage=args.stage, storage_options=options), args.step, args.samples, args.max_bytes
    )


def _show_step(step_cache, step: int, samples: int, max_bytes: int) -> int:
    """Print a cached step's manifest and its first trajectories, decoded and scored."""
    from ppoflow.algorithms.scoring import BUILTIN_SCORERS
    from ppoflow.storage.batch import non_tensor_column

    batch, manifest = step_cache.load(step, max_bytes=max_bytes)
    print(json.dumps({key: value for key, value in manifest.items() if key != "metrics"}, indent=2))
    if "responses" not in batch.keys():
        print(batch)
        return 0
    decode = _decoder(manifest.get("tokenizer_path"))
    sources, truths = non_tensor_column(batch, "data_source"), non_tensor_column(batch, "ground_truth")
    for row in range(min(samples, batch.batch_size[0])):
        prompt = decode(batch["prompts"][row][batch["prompt_mask"][row]].tolist())
        response = decode(batch["responses"][row][batch["response_mask"][row]].tolist())
        scorer = BUILTIN_SCORERS.get(sources[row])
        score = scorer(sources[row], response.removesuffix(decode.eos), truths[row]) if scorer and decode.eos else None
        score = score["score"] if isinstance(score, dict) else score
        print(
            f"[{row}] uid={non_tensor_column(batch, 'uid')[row]} prompt={prompt!r} response={response!r} "
            f"truth={truths[row]!r} reward={'n/a' if score is None else f'{score:.3f}'}"
        )
    return 0


def _decoder(tokenizer_path: str | None):
    """Token ids -> text with the cached run's tokenizer, or the ids themselves when it is unavailable."""

    def ids(tokens):
        return " ".join(map(str, tokens))

    ids.eos = None
    if tokenizer_path:
        try:
            from transformers import AutoTokenizer

            from ppoflow.workers.models import local_model_dir

            tokenizer = AutoTokenizer.from_pretrained(local_model_dir(tokenizer_path))
        except (OSError, ValueError) as error:
            print(f"(tokenizer {tokenizer_path} unavailable: {error}; showing token ids)")
        else:

            def text(tokens):
                return tokenizer.decode(tokens, skip_special_tokens=False)

            text.eos = tokenizer.eos_token
            return text
    return ids
