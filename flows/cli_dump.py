"""``ppoflow dump show DIR --step N [--worst K]``: pretty-print one step's generation dump
(:mod:`ppoflow.flows.dumps`), or its ``K`` lowest-scoring samples. Imports nothing heavy until it runs."""

from __future__ import annotations

import sys
import textwrap


def add_parser(commands) -> None:
    dump = commands.add_parser("dump", help="read the generation dumps of trainer.rollout_data_dir/validation_data_dir")
    show = dump.add_subparsers(dest="dump_command", required=True).add_parser("show", help="print one step's samples")
    show.add_argument("dump_dir", help="the dump directory (any fsspec URL)")
    show.add_argument("--step", type=int, help="the step (default: the last dumped)")
    show.add_argument("--worst", type=int, metavar="K", help="only the K lowest-scoring samples")


def dump(args) -> int:
    """``dump show``; a directory or step with no dump ends in one line naming it and exit 2."""
    from ppoflow.flows.dumps import dump_url, dumped_steps, read_dump

    where = args.dump_dir
    try:
        step = args.step if args.step is not None else (dumped_steps(args.dump_dir) or [None])[-1]
        if step is None:
            raise FileNotFoundError("no <step>.jsonl dump here")
        where = dump_url(args.dump_dir, step)
        rows = read_dump(args.dump_dir, step)
    except (OSError, ValueError) as error:
        if args.debug:
            raise
        print(f"ppoflow: {where}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(render(rows, step, worst=args.worst))
    return 0


def render(rows: list[dict], step: int, *, worst: int | None = None) -> str:
    """The samples of one dump as text: a header per sample (index, score, uid, source, weight version),
    then its prompt, response (or turns) and ground truth, indented."""
    shown = sorted(rows, key=lambda row: row["score"])[:worst] if worst else rows
    what = f"the {len(shown)} lowest-scoring of {len(rows)}" if worst else f"{len(rows)}"
    lines = [f"step {step}: {what} samples"]
    for index, row in enumerate(shown):
        facts = [f"score {row['score']:.3f}"] + [
            f"{name} {row[name]}" for name in ("uid", "data_source", "weight_version", "tool_calls") if name in row
        ]
        lines += ["", f"[{index}] " + ", ".join(facts), *_block("prompt", row["input"])]
        if "turns" in row:
            for turn in row["turns"]:
                lines += _block(turn["role"], turn["text"])
        else:
            lines += _block("response", row["output"])
        lines += _block("ground truth", str(row.get("gts")))
        if row.get("reward_extras"):
            lines += _block("extras", ", ".join(f"{k}={v}" for k, v in row["reward_extras"].items()))
    return "\n".join(lines)


def _block(label: str, text: str) -> list[str]:
    return [f"  {label}:", *textwrap.indent(text or "''", "    ").splitlines()]
