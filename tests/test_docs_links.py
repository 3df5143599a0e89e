"""Every relative link in the documentation resolves: the file exists and, for `file.md#anchor`, the anchor is one of
that file's headings as GitHub renders it (the README is a reference that points into docs/; a moved or renamed
section must not leave a dead link)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(markdown: str) -> set:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    seen, ids = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def test_anchors_follow_githubs_rule():
    ids = anchors("# A `b` c: d\n## A `b` c: d\n## `python -m x`: y / z (1-2)\n```\n# not a heading\n```\n")
    assert ids == {"a-b-c-d", "a-b-c-d-1", "python--m-x-y--z-1-2"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
        if anchor:
            assert anchor in anchors(file.read_text()), f"{doc.relative_to(ROOT)}: no heading #{anchor} in {path or doc.name}"
