"""The ``ppoflow`` command line.

``ppoflow train [--config NAME_OR_PATH] [key=value ...]`` runs the training flow (with no arguments:
the tiny GRPO demo). ``ppoflow config`` prints the merged, validated config or the key reference.
``ppoflow build-tiny-model DIR`` writes the demo's random-init model and tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

QUIET_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_DEDUP_LOGS": "1"}


def main(argv: list[str] | None = None) -> int:
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    parser = argparse.ArgumentParser(prog="ppoflow", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the training flow")
    train.add_argument("--config", default=None, help="preset name in configs/ or a YAML path (default: grpo_tiny)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, lists as key=[1,2,3]")

    config = commands.add_parser("config", help="print the merged config, or the key reference")
    config.add_argument("--config", default=None, help="preset name or YAML path (default: grpo_tiny)")
    config.add_argument("--reference", action="store_true", help="print every key with its type, default and meaning")
    config.add_argument("overrides", nargs="*")

    build = commands.add_parser("build-tiny-model", help="write the demo's random-init Llama + char tokenizer")
    build.add_argument("path")
    build.add_argument("overrides", nargs="*", help="TinyModelConfig fields, e.g. hidden_size=64")

    args = parser.parse_args(argv)
    from configs import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from configs import load_config

    load_config(args.config, args.overrides)  # fail before Prefect and Ray start
    from flows.train import ppo_train

    ppo_train(config=args.config or "grpo_tiny", overrides=list(args.overrides))
    return 0


def _config(args) -> int:
    from configs import config_as_dict, load_config, reference_table

    if args.reference:
        print(reference_table())
    else:
        print(json.dumps(config_as_dict(load_config(args.config, args.overrides)), indent=2))
    return 0


def _build_tiny_model(args) -> int:
    from configs.schema import TinyModelConfig
    from omegaconf import OmegaConf

    from workers.models import build_tiny_model

    spec = TinyModelConfig.model_validate(OmegaConf.to_container(OmegaConf.from_dotlist(args.overrides)))
    build_tiny_model(args.path, spec)
    print(f"wrote {args.path}")
    return 0


COMMANDS = {"train": _train, "config": _config, "build-tiny-model": _build_tiny_model}

if __name__ == "__main__":
    sys.exit(main())
