"""The documentation holds together: every relative link in README.md, BENCHMARKS.md, docs/ and benchmarks/ reaches a
file (and a heading, where it names one), README stays a front page, BENCHMARKS.md stays short, and library comments
say why rather than which run (the numbers live in the docs)."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted({REPO / "README.md", REPO / "BENCHMARKS.md", *REPO.glob("docs/**/*.md"),
                    *REPO.glob("benchmarks/*.md")})
# Pages written on other branches of the same round; the guide links them already. Drop a name once its file is in.
COMING: set[str] = set()  # guide pages linked before they exist (none now)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`[^`\n]*`")
_GENERATED = re.compile(r"<!-- bench:([a-z]+)[^>]*-->\n(.*?)<!-- /bench:\1 -->", re.DOTALL)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link there is an example, not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = _slug(match[1])
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _relative_links(path: Path) -> list[tuple[str, str]]:
    """(target path, anchor) of each relative link in a markdown file."""
    links = []
    for match in _LINK.finditer(_prose(path.read_text())):
        target = match[1] or match[2]
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto: ...
        file, _, anchor = target.partition("#")
        links.append((file, anchor))
    return links


def _broken_links(doc: Path, root: Path = REPO) -> list[str]:
    broken = []
    for file, anchor in _relative_links(doc):
        target = (doc.parent / file).resolve() if file else doc
        name = target.relative_to(root).as_posix() if target.is_relative_to(root) else str(target)
        if not target.exists():
            if name not in COMING:
                broken.append(f"{file}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{file}#{anchor}: no such heading in {name}")
    return broken


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = _broken_links(doc)
    assert not broken, f"{doc.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# B page\n\n## Where the step time goes (2026-11-29)\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](sub/b.md#where-the-step-time-goes-2026-11-29) [self](#top) [web](https://x.org/y.md)\n"
                   "[gone](sub/c.md) [bad anchor](sub/b.md#nowhere) `[code](not/a/link.md)`\n\n# Top\n"
                   "```\n[fenced](also/not.md)\n```\n")
    assert _broken_links(doc, tmp_path) == ["sub/c.md: no such file", "sub/b.md#nowhere: no such heading in sub/b.md"]


def test_readme_is_a_front_page():
    """≤160 lines, none over 120 characters (rows of a generated table excepted: markdown cannot wrap them), and a
    heading at least every 40 lines (code blocks' comment lines are not headings)."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines (at most 160; move detail into docs/guide/)"
    generated = {line for region in _GENERATED.finditer(text) for line in region[2].splitlines()}
    long = [f"line {n}: {len(line)} characters" for n, line in enumerate(lines, 1)
            if len(line) > 120 and not (line in generated and line.startswith("|"))]
    assert not long, "README.md lines over 120 characters:\n" + "\n".join(long)
    in_code, last = False, 0
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            assert n - last <= 40, f"README.md lines {last}-{n}: no heading for {n - last} lines (at most 40)"
            last = n
    assert len(lines) - last <= 40, f"README.md: no heading after line {last}"


def test_readme_states_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && hf-accel sft" in text
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q -n 2' in text  # .ci/run greps it too


def test_benchmarks_md_stays_short():
    lines = (REPO / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 400, (f"BENCHMARKS.md has {len(lines)} lines (at most 400): move dated notes to "
                               "benchmarks/HISTORY.md")


# A line cites a run when it names the GPU it ran on, a date, or a measured rate.
_RUN_CITATION = re.compile(r"\bH[12]00\b|\b20\d\d-[01]\d-[0-3]\d\b|\d[kM]?\s*(tokens/s|TF/s|TFLOP/s)"
                           r"|measured[^.]*\d\s*GiB|\d\s*GiB[^.]*measured")
MAX_RUN_CITATIONS = 5


def test_library_comments_say_why_not_which_run():
    """At most a handful of lines in hf_accel/ and patches/ cite a GPU, a date or a measured rate; the measurements
    live in BENCHMARKS.md and docs/, and a comment names the reason with a pointer there."""
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for folder in ("hf_accel", "patches") for path in sorted((REPO / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if _RUN_CITATION.search(line)]
    assert len(hits) <= MAX_RUN_CITATIONS, (
        f"{len(hits)} lines cite a run (at most {MAX_RUN_CITATIONS}); say why, and point to BENCHMARKS.md / docs "
        "where the number lives:\n" + "\n".join(hits))


def test_the_run_citation_pattern_catches_what_it_should():
    for cited in ("# measured on the H200: 454 TF/s", "stalled 0.16 s (2026-11-30)", "28.1k vs 39.1k tokens/s",
                  "46 -> 22 TFLOP/s", "predicted 22.05 GiB, measured 21.12"):
        assert _RUN_CITATION.search(cited), cited
    for plain in ("real tokens/s per logging interval", "budget:20GiB", "compute capability (9, 0)",
                  "intermediates would exceed 16 GiB", "the plan's predicted peak against the measured one"):
        assert not _RUN_CITATION.search(plain), plain
