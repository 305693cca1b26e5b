"""Write tests/data/verl_keys.txt and tests/data/verl_example_overrides.txt from a local verl checkout.

``python scripts/verl_fixtures.py /path/to/verl``: the leaf keys of verl's generated ``ppo_trainer.yaml``
(``key=default``, interpolations resolved, ``_target_`` entries left out) and the ``key=value`` overrides of a
few of its example scripts, each file headed by the checkout's commit. The scripts run in bash with ``python3``
replaced by a function that prints its arguments, so their shell variables come out expanded (HOME=/home/user).
"""

import subprocess
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

OUT = Path(__file__).resolve().parents[1] / "tests" / "data"
GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"
EXAMPLES = (
    "examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh",
    "examples/grpo_trainer/run_qwen2-7b_math.sh",
    "examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh",
    "tests/special_e2e/run_dapo.sh",
    "examples/gmpo_trainer/test_dapo_7b_math.sh",
)
PRINT_ARGS = 'python3() { shift 2; printf "%s\\n" "$@"; }; HOME=/home/user; source "$0"'


def leaves(node, prefix: str = ""):
    """``(dotted key, value)`` for each leaf of a YAML mapping (an empty mapping is a leaf)."""
    for name, value in node.items():
        if name == "_target_":
            continue
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{key}.")
        else:
            yield key, value


def flow(value) -> str:
    """A value as an override writes it: YAML flow style on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def main(checkout: Path) -> None:
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    source = f"volcengine/verl@{commit.strip() or 'unknown'}"
    generated = OmegaConf.to_container(OmegaConf.load(checkout / GENERATED), resolve=True, throw_on_missing=False)
    keys = [f"{key}={flow(value)}" for key, value in leaves(generated)]
    header = f"# Leaf keys of {GENERATED}, {source}, as key=default; written by scripts/verl_fixtures.py\n"
    (OUT / "verl_keys.txt").write_text(header + "\n".join(keys) + "\n")
    blocks = [f"# key=value overrides of verl's example scripts, {source}; written by scripts/verl_fixtures.py"]
    for script in EXAMPLES:
        words = subprocess.run(
            ["bash", "-c", PRINT_ARGS, checkout / script], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        blocks.append(f"\n[{script}]\n" + "\n".join(word for word in words if "=" in word))
    (OUT / "verl_example_overrides.txt").write_text("\n".join(blocks) + "\n")
    print(f"{len(keys)} keys, {len(EXAMPLES)} scripts from {source}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
