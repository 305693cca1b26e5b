"""The ``ppoflow`` command line: ``train``, ``config``, ``cache ls|show|rm``, ``dump show``,
``server``, ``build-tiny-model``.

``ppoflow train [--config NAME_OR_PATH] [key=value ...]`` runs the training flow (no arguments: the tiny GRPO demo);
``ppoflow server`` starts a Prefect server set up for training runs (:data:`SERVER_ENV`). A user error ends with exit
code 2 and a message naming the key or file, before Prefect or Ray start (``train`` runs
:func:`~ppoflow.flows.preflight.preflight` first); ``--debug`` (or ``PPOFLOW_DEBUG=1``) adds the traceback. Ctrl-C or
SIGTERM stops ``train`` cleanly (:func:`_train`: exit 130 / 143). Nothing but argparse is imported before a command
runs, so ``ppoflow --help`` answers at once. Details: docs/reliability.md, docs/configuration.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from ppoflow.flows.cli_cache import cache
from ppoflow.flows.cli_dump import add_parser as add_dump_parser
from ppoflow.flows.cli_dump import dump

QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "RAY_DEDUP_LOGS": "1",
    # Without PREFECT_API_URL, Prefect starts a temporary server whose fresh database is slow to
    # migrate on a small machine, often past its default start-up timeout (docs/benchmarks.md).
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}

SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}
"""Settings for a Prefect server that records training runs. A step makes a few task runs, each three state
events, and Prefect's task-run recorder by default writes every event to the database in a transaction
of its own: on a small machine the server then spends more CPU per step than a small step itself takes,
competing with the training for the same cores (docs/benchmarks.md). Written in batches of up to 50,
flushed at least every second, the states reach the UI at most about a second late. ``ppoflow`` sets
these for the temporary server Prefect starts without ``PREFECT_API_URL``; give them to a ``prefect server
start`` of your own the same way (docs/ui.md)."""


DEBUG_ENV = "PPOFLOW_DEBUG"
"""Set to 1 to see the traceback of a user error (as ``--debug`` does); by default it is one message."""


TEMPORARY_SERVER_QUIET = {"PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL"}
"""Prefect's temporary server logs tracebacks for events still in flight when it is stopped at exit;
nothing is lost that matters to a throwaway server, so a run without ``PREFECT_API_URL`` keeps the
console clean (but ``ppoflow server``, a server meant to stay, keeps its logs)."""


def main(argv: list[str] | None = None) -> int:
    defaults = {**QUIET_ENV, **SERVER_ENV, **(TEMPORARY_SERVER_QUIET if "PREFECT_API_URL" not in os.environ else {})}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    parser = argparse.ArgumentParser(prog="ppoflow", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get(DEBUG_ENV) == "1",
        help=f"show the traceback of a user error too (or set {DEBUG_ENV}=1)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the training flow")
    train.add_argument(
        "--config",
        default=None,
        help="preset name in configs/ or a YAML path (default: grpo_tiny, the demo; verl's defaults when the command "
        "line sets actor_rollout_ref.model.path)",
    )
    _add_verl_flags(train)
    train.add_argument("overrides", nargs="*", help="key=value overrides, lists as key=[1,2,3]")

    config = commands.add_parser("config", help="print the merged config, or the key reference")
    config.add_argument("--config", default=None, help="preset name or YAML path (default: as for train)")
    _add_verl_flags(config)
    config.add_argument("--reference", action="store_true", help="print every key with its type, default and meaning")
    config.add_argument("overrides", nargs="*")

    cache = commands.add_parser("cache", help="inspect or remove step caches under a dump_dir")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    for name, text in (
        ("ls", "list projects, configs, steps, validity and sizes"),
        ("show", "decode a cached step's prompts and responses, with their rewards"),
        ("rm", "remove a step's entries"),
    ):
        sub = cache_commands.add_parser(name, help=text)
        sub.add_argument("dump_dir")
        sub.add_argument(
            "--storage-options", default="{}", help="fsspec options as JSON (endpoint, region; no secrets)"
        )
        if name == "ls":
            sub.add_argument(
                "--quick",
                action="store_true",
                help="check markers and payload sizes only, without reading the payloads",
            )
            sub.add_argument(
                "--list-only",
                action="store_true",
                help="exit 0 even when entries are invalid (by default: exit 1 after listing them)",
            )
        else:
            sub.add_argument("--step", type=int, required=True)
            sub.add_argument("--project", help="{experiment}_{project} directory (needed when there are several)")
            sub.add_argument("--config", dest="config_dir", help="GBS.._N.._in.._out.. directory (when several)")
            sub.add_argument(
                "--stage",
                default="rollout" if name == "show" else None,
                help="stage entry (show: default rollout; rm: default every stage)",
            )
        if name == "show":
            sub.add_argument("--samples", type=int, default=8, help="how many trajectories to print")
            sub.add_argument(
                "--max-bytes",
                type=int,
                default=1 << 30,
                help="refuse a payload larger than this many bytes before reading it (default 1 GiB)",
            )

    add_dump_parser(commands)

    serve = commands.add_parser("serve", help="register the ppo-train and regression-replay deployments and run them")
    serve.add_argument("--replay-dir", default="regression/golden", help="golden directory of `ppoflow replay record`")
    serve.add_argument("--cron", default="0 3 * * *", help="schedule of regression-replay (default: nightly at 03:00)")
    serve.add_argument("--limit", type=int, default=1, help="flow runs executed at once")
    serve.add_argument(
        "--config", default="grpo_tiny", help="preset or YAML whose values fill ppo-train's form (default: grpo_tiny)"
    )

    server = commands.add_parser(
        "server",
        help="start a Prefect server set up for training runs (prefect server "
        "start with ppoflow's task-run recorder settings)",
    )
    server.add_argument("--host", help="address to serve on (default: PREFECT_SERVER_API_HOST)")
    server.add_argument("--port", type=int, help="port to serve on (default: PREFECT_SERVER_API_PORT)")
    server.epilog = "Other arguments (--log-level, ...) are passed on to `prefect server start`."

    build = commands.add_parser("build-tiny-model", help="write the demo's random-init Llama + char tokenizer")
    build.add_argument("path")
    build.add_argument("overrides", nargs="*", help="TinyModelConfig fields, e.g. hidden_size=64")

    from ppoflow.flows.replay import add_commands as add_replay_commands

    COMMANDS["replay"] = add_replay_commands(commands)
    args, passed_on = parser.parse_known_args(argv)
    if args.command == "server":
        args.server_args = passed_on
    elif passed_on:
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    from ppoflow.configs import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        if args.debug:
            raise
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        if "ephemeral Prefect API server" not in str(error):
            raise
        # The temporary server's own logs are silenced above, so say where to look.
        print(
            f"ppoflow: {error}\nThe temporary Prefect server did not start. Run `prefect server start` to see "
            "why (often: the database under PREFECT_HOME was migrated by a newer Prefect than this one), "
            "then point PREFECT_API_URL at a server that works.",
            file=sys.stderr,
        )
        return 1


INTERRUPT_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The shell's codes for a process ended by the signal (128 + its number)."""

RAY_SIGNAL_ENV = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}
"""Ray's C++ failure-signal handler takes SIGTERM for a crash: it prints a stack dump and the process aborts
at exit (134) however cleanly it stopped. ``ppoflow train`` turns it off (set it to 0 to keep it)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during ``ppoflow train``; a BaseException, like KeyboardInterrupt, so that
    no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def _add_verl_flags(parser) -> None:
    """verl's command-line flags, so that its scripts run as they are (configs/verl_entries.py)."""
    parser.add_argument("--config-path", help="verl's (Hydra's) folder of --config-name")
    parser.add_argument(
        "--config-name", help="verl's config (ppo_trainer, dapo_trainer, ...: a trainer mode) or a Hydra YAML there"
    )
    parser.add_argument(
        "--entry",
        help="the verl entry module the script ran (python3 -m ...), e.g. recipe.one_step_off_policy.main_ppo",
    )


def _verl_command(args) -> list[str]:
    """Read verl's flags into ``args.config`` and ``args.overrides``; what they stand for (printed by ``train``)."""
    from ppoflow.configs.verl_entries import verl_command

    args.config, args.overrides, implied = verl_command(
        args.config, args.config_path, args.config_name, args.entry, args.overrides
    )
    return implied


def _train(args) -> int:
    """Check, then run the flow. SIGINT and SIGTERM raise :class:`Interrupted` in the flow, which stops
    like any crash: the workers are shut down on the way out (the run's ``finally``), Prefect records the
    run as crashed, the last complete checkpoint stays as it is; then Ray is shut down, and the temporary
    Prefect server stops as the process exits. One line says where a rerun of the same command resumes.
    However the process ends, a SIGKILL included, the processes it started (the temporary server, a Ray it
    started) are stopped after it (:func:`~ppoflow.flows.reaper.reap_on_exit`)."""
    from ppoflow.configs import load_config, preset_for, preset_line
    from ppoflow.flows.reaper import reap_on_exit

    implied = _verl_command(args)
    cfg = load_config(args.config, args.overrides)  # fail before Prefect and Ray start
    print(preset_line(args.config, args.overrides), flush=True)
    if implied:
        print(f"verl's --entry / --config-name stand for: {' '.join(implied)}", flush=True)
    for name, value in RAY_SIGNAL_ENV.items():  # before Ray is imported: it reads the setting then
        os.environ.setdefault(name, value)
    reap_on_exit()  # before the first process this run starts
    from ppoflow.flows import cancellation
    from ppoflow.flows.logs import hide_user_error_tracebacks, run_failures
    from ppoflow.flows.preflight import preflight
    from ppoflow.flows.train import check_mode, run_ppo_train

    check_mode(cfg)
    preflight(cfg)
    cancellation.stop_process_on_cancel()  # Prefect itself stops only runs that a runner or worker started
    hide_user_error_tracebacks()  # bad input found once Ray runs (resources) is reported like the rest
    previous = {signum: signal.signal(signum, _interrupt) for signum in INTERRUPT_EXIT_CODES}
    try:
        run_ppo_train(preset_for(args.config, args.overrides), args.overrides, cfg)
        return 0
    except run_failures() as failure:
        if args.debug:
            raise
        print(f"ppoflow: the run failed: {failure}", file=sys.stderr)
        return 1
    except Interrupted as interrupted:
        signum = interrupted.signum
    except SystemExit as exit_:
        if exit_.code != signal.SIGTERM:
            raise
        signum = signal.SIGTERM  # once Ray runs, its driver's SIGTERM handler (sys.exit(SIGTERM)) replaces ours
    finally:
        for other, handler in previous.items():  # a second signal during the shutdown acts as it did before
            signal.signal(other, handler)
    from ppoflow.workers.launcher import shutdown_ray

    shutdown_ray()  # the workers are gone before the line saying that the run stopped
    if cancellation.was_cancelled():
        cancellation.record_cancelled()
    print(
        f"ppoflow: {_interrupted_line(cfg.trainer.default_local_dir, signum, cancellation.was_cancelled())}",
        file=sys.stderr,
    )
    return INTERRUPT_EXIT_CODES[signum]


def _interrupted_line(run_dir: str, signum: int, cancelled: bool = False) -> str:
    """``interrupted (SIGTERM) after step 3; the last checkpoint is .../global_step_3; rerun ...``; a run
    stopped because its flow run was cancelled says ``cancelled in Prefect`` instead of the signal."""
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.storage.checkpoint import latest

    try:
        steps = [row["step"] for row in read_metrics(run_dir)]
    except (OSError, ValueError):  # no step logged yet
        steps = []
    checkpoint = latest(run_dir)
    what = "cancelled in Prefect" if cancelled else f"interrupted ({signal.Signals(signum).name})"
    return (
        what
        + (f" after step {max(steps)}" if steps else "")
        + (
            f"; the last checkpoint is {checkpoint}; rerun the same command to resume from it"
            if checkpoint
            else "; no checkpoint was written yet: a rerun starts over"
        )
    )


def _config(args) -> int:
    from ppoflow.configs import config_as_dict, load_config, reference_table

    if args.reference:
        print(reference_table())
    else:
        _verl_command(args)
        print(json.dumps(config_as_dict(load_config(args.config, args.overrides)), indent=2))
    return 0


def _build_tiny_model(args) -> int:
    from omegaconf import OmegaConf
    from pydantic import ValidationError

    from ppoflow.configs import ConfigError, validation_problems
    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import build_tiny_model

    try:
        spec = TinyModelConfig.model_validate(OmegaConf.to_container(OmegaConf.from_dotlist(args.overrides)))
    except ValidationError as error:
        raise ConfigError(validation_problems(error)) from None
    build_tiny_model(args.path, spec)
    print(f"wrote {args.path}")
    return 0


def _serve(args) -> int:
    from ppoflow.flows.deploy import serve_deployments

    serve_deployments(args.replay_dir, args.cron, args.limit, preset=args.config)
    return 0


def _server(args) -> int:
    """``prefect server start`` in this process's place, with :data:`SERVER_ENV` (unless already set), serving on
    ``--host``/``--port`` (default: Prefect's settings). The server's own settings and the UI's API URL are set
    to that address too: Prefect's UI otherwise reaches for PREFECT_API_URL as this process saw it, or the
    default port, whatever port it serves on. A PREFECT_UI_API_URL the user set (a proxy) is kept."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    host, port = args.host or settings.server.api.host, args.port or settings.server.api.port
    own = {"PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}
    if "api_url" not in settings.server.ui.model_fields_set:  # Prefect's default, not the user's
        own["PREFECT_UI_API_URL"] = f"http://{_url_host(host)}:{port}/api"
    env = {
        name: value
        for name, value in os.environ.items()
        if not (name in TEMPORARY_SERVER_QUIET and value == TEMPORARY_SERVER_QUIET[name])
    }
    command = ["server", "start", "--host", host, "--port", str(port), *args.server_args]
    os.execve(sys.executable, [sys.executable, "-m", "prefect", *command], {**env, **own})


def _url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    import ipaddress

    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a name
        return host


COMMANDS = {
    "train": _train,
    "config": _config,
    "cache": cache,
    "dump": dump,
    "serve": _serve,
    "server": _server,
    "build-tiny-model": _build_tiny_model,
}

if __name__ == "__main__":
    sys.exit(main())
