"""Rewrite the config reference in docs/configuration.md from the schema and defaults (tests/test_readme.py
checks it): the table between the config-reference markers is ``ppoflow config --reference``."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ppoflow.configs import reference_table  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

text = PAGE.read_text()
if START not in text or END not in text:
    sys.exit(f"{PAGE} lost its config reference markers {START} ... {END}")
updated = re.sub(
    f"{re.escape(START)}.*?{re.escape(END)}", lambda _: f"{START}\n{reference_table()}\n{END}", text, flags=re.S
)
PAGE.write_text(updated)
print("docs/configuration.md config reference", "updated" if updated != text else "already up to date")
