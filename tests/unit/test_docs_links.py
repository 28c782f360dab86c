"""Links between the docs land: the file exists and, with ``#anchor``, so does the heading
(GitHub's anchors: lower case, punctuation dropped, spaces to hyphens, ``-1`` for a repeat;
or an explicit ``<a id="..."></a>``)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\]\(([^)\s]+?\.md)(#[^)\s]*)?\)")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        out.update(re.findall(r'<a id="([^"]+)"></a>', line))    # an explicit anchor
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_links_between_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in _LINK.findall(doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            if not path.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and anchor[1:] not in _anchors(path):
                broken.append(f"{doc.name}: {target}{anchor}")
    assert not broken, broken


def test_benchmarks_open_with_the_current_table_and_keep_the_history():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    first_section = text.split("\n## ")[1]
    assert first_section.startswith("Current figures") and "| machine | date |" in first_section
    assert len(text.splitlines()) < 300
    assert "(benchmarks-history.md)" in text
    history = (ROOT / "docs" / "benchmarks-history.md").read_text()
    assert "## Codec (C1)" in history and "### Session 10 (2026-12-01): CUDA IPC" in history
