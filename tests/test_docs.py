"""The docs stay true to the code: docs/configuration.md is what scripts/config_reference.py writes from the typed
configs (and every config field has its one-line doc), the README stays a five-minute read, and every link between
the README and the pages of docs/ resolves, anchors included."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (web addresses left out)."""
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_configuration_reference_is_current():
    ref = _config_reference()
    committed = (DOCS / "configuration.md").read_text()
    assert committed == ref.render(), (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/config_reference.py` and commit the result")


def test_every_config_field_has_a_doc_line():
    assert _config_reference().missing_docs() == [], "give each of these config fields its doc(...) line"


def test_configuration_reference_lists_every_key():
    from angel_jax.config import describe

    page = (DOCS / "configuration.md").read_text()
    keys = [line.split(" ", 1)[0] for line in describe()]
    assert keys and [k for k in keys if f"`{k}`" not in page] == []


def test_readme_is_a_five_minute_read():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail to a page under docs/")


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert unlinked == [], "README.md's 'Where to go next' should link every page of docs/"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert broken == [], f"broken links in {page.relative_to(ROOT)}"


def test_slug_matches_github():
    assert slug("Weights & Biases") == "weights--biases"
    assert slug("Sharded state (mesh.fsdp)") == "sharded-state-meshfsdp"
    assert slug("`angel-jax sample` options") == "angel-jax-sample-options"
    assert slug("Timelines and I/O calibration") == "timelines-and-io-calibration"
