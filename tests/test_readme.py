"""The README and docs/ stay true: the config reference in docs/configuration.md is the one the schema
generates, every relative link in README.md and docs/*.md points at a file (and heading) that exists, and the
step's diagram and stage table are drawn once (others link to them)."""

import re
from pathlib import Path

import pytest

from ppoflow.configs import reference_table

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCED = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def test_config_reference_matches_the_schema():
    section = re.search(
        r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", CONFIGURATION.read_text(), re.S
    )
    assert section, "docs/configuration.md lost its config reference markers"
    assert section.group(1) == reference_table(), "run: python scripts/sync_config_reference.py"


def relative_links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans that are not URLs (``http:``, ``mailto:``, ...)."""
    prose = INLINE_CODE.sub("", FENCED.sub("", text))
    return [target for target in LINK.findall(prose) if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target)]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in HEADING.findall(FENCED.sub("", text)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        found.add(re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    broken = []
    for target in relative_links(text):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
            broken.append(f"{target} (no heading #{fragment} in {resolved.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def test_the_link_check_catches_what_it_should():
    assert relative_links("[a](docs/x.md#y) [b](https://e.org) `[c](d.md)` ![i](img.png)\n```\n[e](f.md)\n```") == [
        "docs/x.md#y",
        "img.png",
    ]
    assert anchors("# One step off: generating\n## Models, data, rewards\n### `ppoflow serve` — now") == {
        "one-step-off-generating",
        "models-data-rewards",
        "ppoflow-serve--now",
    }


@pytest.mark.parametrize(
    ("what", "first_line", "home"),
    [
        ("the step's diagram", "ppoflow train / Prefect deployment / UI run", "README.md"),
        ("the stage table", "1. generate      sample rollout.n responses per prompt", "docs/architecture.md"),
    ],
)
def test_drawn_once(what, first_line, home):
    pages = [str(page.relative_to(ROOT)) for page in PAGES if first_line in page.read_text()]
    assert pages == [home], f"{what} is drawn in {pages}; keep it in {home} and link to it"
