"""The documentation stays whole: README.md is a short front page, every relative link in it and in docs/ leads to a
file (and a heading) that exists, and docs/cli.md mentions every flag that `sdlite <command> --help` prints.

No model, no server, no subprocess: the parser is built in this process as the ``sdlite`` command builds it. Run this
file as a script to print what it would fail on.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets; an optional "title" after the target
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str):
    """``(line number, line)`` outside fenced code blocks, code spans blanked out (their length kept)."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (links as their text, no code marks or emphasis),
    lower-cased, every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's ``-1``, ``-2`` ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links() -> list[str]:
    """``file:line: link`` and why, for every relative link that leads nowhere."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for page in pages():
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for m in LINK.finditer(line):
                target = m.group(1)
                if target.startswith(EXTERNAL):
                    continue
                where = f"{page.relative_to(ROOT)}:{number}: ({target})"
                file_part, _, anchor = target.partition("#")
                dest = (page.parent / file_part).resolve() if file_part else page
                if not dest.exists():
                    problems.append(f"{where}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
                    continue
                if anchor and dest.is_file() and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def test_every_relative_link_resolves():
    problems = broken_links()
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """The checker itself: a missing file and a missing heading are found, code is not read as links."""
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## `sdlite serve` (B)\n\n[ok](#a-title) [ok](#sdlite-serve-b) [bad](#nope)\n"
                    "[gone](missing.md) `[code](missing.md)`\n```\n[fenced](missing.md)\n```\n", encoding="utf-8")
    assert anchors(page) == {"a-title", "sdlite-serve-b"}
    found = [m.group(1) for _, line in prose_lines(page.read_text(encoding="utf-8")) for m in LINK.finditer(line)]
    assert found == ["#a-title", "#sdlite-serve-b", "#nope", "missing.md"]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from sdlite.cli import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def mentioned(flag: str, text: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def cli_sections(text: str) -> dict[str, str]:
    """The text of each ``## `sdlite NAME``` section of docs/cli.md, its sub-sections included."""
    out = {}
    parts = re.split(r"^## ", text, flags=re.M)
    for part in parts[1:]:
        m = re.match(r"`sdlite (\w+)`", part)
        if m:
            out[m.group(1)] = part
    return out


def missing_flags() -> dict[str, list[str]]:
    """For each sub-command, the option strings its ``--help`` prints that docs/cli.md does not mention in that
    sub-command's section (``-h``/``--help`` anywhere on the page)."""
    text = CLI_PAGE.read_text(encoding="utf-8")
    sections = cli_sections(text)
    out = {}
    for name, sub in subcommands().items():
        section = sections.get(name)
        if section is None:
            out[name] = ["(no section `## `sdlite " + name + "`` in docs/cli.md)"]
            continue
        missing = []
        for action in sub._actions:
            for flag in action.option_strings:
                where = text if flag in ("-h", "--help") else section
                if not mentioned(flag, where):
                    missing.append(flag)
        if missing:
            out[name] = missing
    return out


def test_cli_page_mentions_every_flag():
    missing = missing_flags()
    assert not missing, "docs/cli.md does not mention these flags:\n" + "\n".join(
        f"  sdlite {name}: {' '.join(flags)}" for name, flags in missing.items())


def test_every_subcommand_has_flags_to_check():
    """The parser is read as the command builds it: generate has its many flags, and every sub-command its help."""
    subs = subcommands()
    assert {"generate", "serve", "batch", "upscale", "info", "tokens", "samplers", "mcp"} <= set(subs)
    flags = {f for a in subs["generate"]._actions for f in a.option_strings}
    assert {"--steps", "--cfg", "--sampler", "--model", "-m", "--controlnet", "--hires"} <= flags


def readme_problems() -> list[str]:
    lines = README.read_text(encoding="utf-8").split("\n")
    while lines and not lines[-1]:
        lines.pop()
    problems = []
    if len(lines) > README_MAX_LINES:
        problems.append(f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move detail into docs/")
    prose = [(n, line) for n, line in prose_lines("\n".join(lines))]

    def first(predicate, what):
        for n, line in prose:
            if predicate(line):
                return n
        problems.append(f"README.md has no {what}")
        return None

    table = first(lambda s: s.lstrip().startswith("|"), "table")
    quick = first(lambda s: re.match(r"#+\s+Quick start", s, re.I), "'Quick start' heading")
    examples = first(lambda s: re.match(r"#+\s+Examples", s, re.I), "'Examples' heading")
    if table and quick and examples and not table < quick < examples:
        problems.append(f"README.md: the model table (line {table}) and the quick start (line {quick}) must come "
                        f"before the examples (line {examples})")
    if table:
        rows = []
        for n, line in prose:
            if n >= table and line.lstrip().startswith("|"):
                rows.append(line)
            elif n > table:
                break
        if not any("docs/models/" in row for row in rows) or not any("FLUX" in row for row in rows):
            problems.append("README.md: the first table is not the model table (rows linking docs/models/, FLUX.1 "
                            "among them)")
    if quick:
        block = "\n".join(line for n, line in enumerate(lines, 1) if quick < n < (examples or len(lines)))
        for command in ("make run", "make test"):
            if command not in block:
                problems.append(f"README.md: the quick start does not show `{command}`")
    paragraph = []
    for n, line in prose:
        if n == 1 or line.startswith("#"):
            continue
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    first_sentence = re.split(r"(?<=\.)\s", " ".join(paragraph), maxsplit=1)[0]
    if "FLUX.1" not in first_sentence:
        problems.append("README.md: the first sentence does not name FLUX.1 among the models sdlite runs")
    return problems


def test_readme_is_a_front_page():
    problems = readme_problems()
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    report = broken_links() + readme_problems()
    for name, flags in missing_flags().items():
        report.append(f"docs/cli.md: sdlite {name}: missing {' '.join(flags)}")
    print("\n".join(report) if report else "docs: nothing to report")
    sys.exit(1 if report else 0)
