"""The README stays true: its config reference is the one the schema generates."""

import re
from pathlib import Path

from ppoflow.configs import reference_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_matches_the_schema():
    section = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", README.read_text(), re.S)
    assert section, "README lost its config reference markers"
    assert section.group(1) == reference_table(), "run: python scripts/sync_readme_reference.py"
