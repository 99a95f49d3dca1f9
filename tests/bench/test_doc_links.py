"""Every link in README.md, docs/ and results/README.md resolves to a file in the tree (and a #fragment to a
heading of the markdown file it names), and every results/<gpu>/... path the prose names exists, so moving a
result file or renaming a section cannot leave a dangling reference behind."""
import glob
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "results" / "README.md", *(REPO / "docs").rglob("*.md")])
# names starting with "_" are other engineers' drafts (docs/measurements/_from_code_*.md, _from_studies_*.md),
# checked once they are folded into the notes
DOCS = [p for p in DOCS if p.exists() and not p.name.startswith("_")]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
# a path into results/ in the new layout, as prose names it in backticks (old results/gpu/... paths are history)
RESULT_PATH = re.compile(r"`(results/(?!gpu/)[^`\s]+)`")

IGNORED = ("results/html", "results/asv/vm")

pytestmark = pytest.mark.skipif(not DOCS, reason="no documentation in this tree")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for line in CODE_BLOCK.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    text = CODE_BLOCK.sub("", path.read_text())
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def expand(pattern: str):
    """`a.{json,md}` -> a.json, a.md; globs left to glob."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    broken = []
    for target in links(doc):
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif not str(dest).startswith(str(REPO)):
            broken.append(f"{target}: outside the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_result_path_exists(doc):
    missing = []
    for path in RESULT_PATH.findall(doc.read_text()):
        path = path.rstrip(".,;:)")
        if "<" in path or path.startswith(IGNORED):  # a pattern (results/<gpu>/...), or a folder git ignores
            continue
        if path.endswith("/"):
            found = (REPO / path).is_dir()
        else:
            found = all(glob.glob(os.path.join(REPO, p)) for p in expand(path))
        if not found:
            missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} names result paths that do not exist: {sorted(set(missing))}"
