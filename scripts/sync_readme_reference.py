"""Rewrite the config reference in README.md from the schema and defaults (tests/test_readme.py checks it)."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ppoflow.configs import reference_table  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

text = README.read_text()
updated = re.sub(f"{re.escape(START)}.*?{re.escape(END)}", lambda _: f"{START}\n{reference_table()}\n{END}", text,
                 flags=re.S)
README.write_text(updated)
print("README config reference", "updated" if updated != text else "already up to date")
