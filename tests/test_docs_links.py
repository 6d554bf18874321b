"""Every relative link in README.md and docs/*.md reaches a file, and where it names an
anchor, a heading of that file; docs/benchmarks.md stays a reference, and README.md a
front door of bounded size (the rest lives in the docs it links).

Why: sections move and measurement files are renamed, and a link that no longer
resolves breaks silently, on GitHub and in an editor alike. Anchors follow GitHub's
rule for headings (lowercase; punctuation but '-' and '_' removed; spaces to '-'; a
repeated heading gets '-1', '-2', ...). docs/benchmarks.md answers each question with
its current figures, so it has a size limit and carries no issue numbers (history
lives in git). Pure text checks: no cluster, no network.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers import summary_keys_documented

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
#: docs/benchmarks.md's size limit, in characters.
BENCHMARKS_LIMIT = 40_000
README = ROOT / "README.md"
#: README.md's size limit, in characters.
README_LIMIT = 14_000

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")
ISSUE_NUMBER = re.compile(r"\bissues?[\s_#-]*\d+", re.I)


def prose(text: str) -> str:
    """The text outside fenced code blocks, with code spans blanked: a command such as
    `"axes.x=[a]" (b)` is no link, and neither is a heading-like line in a block."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            kept.append("")
        else:
            kept.append("" if in_fence else CODE_SPAN.sub("code", line))
    return "\n".join(kept)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (its link syntax reduced to the text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into `path` may name: its headings' and explicit HTML ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            slug = github_anchor(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def link_targets(text: str) -> list[str]:
    """The targets of a document's inline links, images and reference definitions."""
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_DEFINITION.findall(body)


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `doc` that reaches no file, or no heading of its file."""
    broken = []
    for target in link_targets(doc.read_text(encoding="utf-8")):
        if URL_SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            resolved = doc
        elif path_part.startswith("/"):
            resolved = root / path_part.lstrip("/")
        else:
            resolved = doc.parent / path_part
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_benchmarks_is_a_reference_of_bounded_size_without_issue_numbers():
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert len(text) <= BENCHMARKS_LIMIT, f"{len(text)} characters"
    assert ISSUE_NUMBER.findall(text) == []


def test_the_readme_is_a_front_door_of_bounded_size():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= README_LIMIT, f"{len(text)} characters"


def test_anchors_follow_githubs_rule():
    assert github_anchor("The model's error") == "the-models-error"
    assert github_anchor("`kernel` on 3 workers (10gbit)") == "kernel-on-3-workers-10gbit"
    assert github_anchor("CPUs and GPUs in one run") == "cpus-and-gpus-in-one-run"
    assert github_anchor("A [linked](x.md) heading_with-marks!") == "a-linked-heading_with-marks"


def test_broken_files_and_anchors_are_reported(tmp_path):
    """The check can fail: a missing file, a missing heading and a same-file anchor to
    nothing are reported; links inside code, external URLs and a repeated heading's
    second anchor are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Title\n\n## Part\n\n## Part\n")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "# Page\n\n"
        "[ok](other.md#part-1) [ok](other.md) ![ok](other.md#title) [ok](#page)\n"
        "[ext](https://example.org/x#y) `[code](missing.md)`\n"
        "```\n[block](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nothing) [self](#nowhere)\n"
        "[ref]: ../docs/missing-too.md\n")
    assert broken_links(doc, tmp_path) == [
        "missing.md: no such file",
        "other.md#nothing: no heading with that anchor in other.md",
        "#nowhere: no heading with that anchor in page.md",
        "../docs/missing-too.md: no such file",
    ]


def test_issue_numbers_are_recognised():
    assert ISSUE_NUMBER.findall("(issue 21, item 3) issue21-x issues 4 and 8 Issue #9")
    assert ISSUE_NUMBER.findall("an issue of size, the issues here") == []


def test_the_summary_keys_documented_are_keys_a_run_writes():
    """docs/outputs.md's `## summary.json` table names no key the code no longer
    writes: each is a string literal of the pipeline's code (the runs of
    tests/test_prediction.py and tests/test_batch_norm_runs.py check the other way:
    every key of their summaries is in the table)."""
    code = "\n".join(path.read_text(encoding="utf-8")
                     for path in (ROOT / "pipeline").rglob("*.py"))
    documented = summary_keys_documented()
    assert len(documented) > 50
    assert sorted(key for key in documented
                  if f'"{key}"' not in code and f"'{key}'" not in code) == []
