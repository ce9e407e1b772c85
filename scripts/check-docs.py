#!/usr/bin/env python3
"""Checks the links in the repository's Markdown documentation.

Checked: README.md, docs/*.md, and every Markdown file inside the repository they link to
(data/SOURCES.md, say), or the files named on the command line.

For every link and image (inline, reference definitions, autolinks, HTML href/src):
  - http(s) and mailto links are allowed and not fetched;
  - file:// links are refused;
  - absolute paths are refused (they name a place on one machine; use a relative link);
  - relative links must stay inside the repository and resolve to an existing file or
    directory; an anchor into a Markdown file (or within the same file) must name one of
    its headings, slugged as GitHub does (lowercase, punctuation other than '-' and '_'
    dropped, spaces to '-', '-1', '-2' ... for repeats).
Also refused: paths starting with ../shared or /work/ in inline code, code blocks or links.

Prints one line per problem, "file:line: link -> problem", and exits 1; prints nothing and
exits 0 when all is well (-v prints a summary line). Standard library only.
"""

import os
import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN_PREFIXES = ("../shared", "/work/")
# A forbidden path inside code: at the start or after a space, quote, '=', '(' or ':'.
FORBIDDEN_IN_CODE = re.compile(r"(?:^|[\s'\"=(:,])((?:\.\./)*\.\./shared\b\S*|/work/\S*)")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
# [text](target "title") and ![alt](target); text may hold one level of brackets.
INLINE_LINK = re.compile(
    r"(!?)\[((?:[^\[\]\\]|\\.|\[(?:[^\[\]\\]|\\.)*\])*)\]"
    r"\(\s*(<[^>\n]*>|[^\s()<>]*(?:\([^\s()]*\)[^\s()<>]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:[ \t]*(<[^>\n]*>|\S+)", re.M)
AUTOLINK = re.compile(r"<([A-Za-z][A-Za-z0-9+.-]{1,31}:[^\s<>]*)>")
HTML_ATTR = re.compile(r"<[A-Za-z][^>]*?\b(?:href|src)\s*=\s*(?:\"([^\"]*)\"|'([^']*)')", re.S)
HTML_ANCHOR = re.compile(r"<[A-Za-z][^>]*?\b(?:id|name)\s*=\s*(?:\"([^\"]*)\"|'([^']*)')")
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def split_code(text):
    """Returns (prose, code): the text with fenced blocks and inline code spans blanked
    (newlines kept, so offsets and line numbers stay), and a list of (offset, code)."""
    chars = list(text)
    code = []
    lines = text.splitlines(keepends=True)
    pos = 0
    fence = None
    for line in lines:
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blank(chars, pos, pos + len(line))
        elif fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                fence = None
            else:
                code.append((pos, line))
            blank(chars, pos, pos + len(line))
        pos += len(line)
    prose = "".join(chars)
    # Inline code spans: a run of N backticks up to the next run of exactly N.
    out = list(prose)
    i = 0
    n = len(prose)
    while i < n:
        if prose[i] == "`":
            j = i
            while j < n and prose[j] == "`":
                j += 1
            ticks = j - i
            k = j
            close = -1
            while k < n:
                if prose[k] == "`":
                    m = k
                    while m < n and prose[m] == "`":
                        m += 1
                    if m - k == ticks:
                        close = k
                        break
                    k = m
                else:
                    k += 1
            if close < 0:
                i = j
                continue
            code.append((j, prose[j:close]))
            blank(out, i, close + ticks)
            i = close + ticks
        else:
            i += 1
    return "".join(out), code


def blank(chars, start, end):
    for k in range(start, min(end, len(chars))):
        if chars[k] != "\n":
            chars[k] = " "


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def heading_text_to_plain(raw):
    s = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = s.replace("`", "")
    s = re.sub(r"(\*\*|__|\*)", "", s)
    return s.strip()


def slug(text):
    """GitHub's heading anchor: lowercase, drop punctuation except '-' and '_' (letters,
    digits and marks of any script stay), each space to '-'."""
    out = []
    for ch in heading_text_to_plain(text).lower():
        if ch in "-_":
            out.append(ch)
        elif ch == " ":
            out.append("-")
        elif unicodedata.category(ch)[0] in ("L", "N", "M"):
            out.append(ch)
    return "".join(out)


_anchor_cache = {}


def anchors(path):
    """Every anchor a Markdown file offers: its headings' slugs (with -1, -2 ... for
    repeats) and explicit HTML id/name attributes."""
    if path in _anchor_cache:
        return _anchor_cache[path]
    text = path.read_text(encoding="utf-8", errors="replace")
    found = set()
    seen = {}
    fence = None
    prev = ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prev = ""
            continue
        if fence is not None:
            s = line.strip()
            if s.startswith(fence[0] * len(fence)) and set(s) == {fence[0]}:
                fence = None
            continue
        heading = None
        am = ATX.match(line)
        if am:
            heading = am.group(2) or ""
        elif prev.strip() and SETEXT.match(line) and not ATX.match(prev) and not prev.lstrip().startswith("|"):
            heading = prev.strip()
        if heading is not None:
            base = slug(heading)
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
        for hm in HTML_ANCHOR.finditer(line):
            found.add(hm.group(1) if hm.group(1) is not None else hm.group(2))
        prev = line if not am else ""
    _anchor_cache[path] = found
    return found


def inside_root(path):
    try:
        path.relative_to(ROOT)
        return True
    except ValueError:
        return False


def check_target(source, target, problems, where, linked_md):
    """Checks one link target from `source` (a Path); appends problems."""
    target = target.strip()
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1].strip()
    if not target:
        problems.append(f"{where}: (empty) -> empty link target")
        return
    if target.startswith(FORBIDDEN_PREFIXES) or re.match(r"^(\.\./)+shared(/|$)", target):
        problems.append(f"{where}: {target} -> names a path outside the repository")
        return
    m = SCHEME.match(target)
    if m and len(m.group(1)) > 1:  # one letter would be a Windows drive: treat as a path
        scheme = m.group(1).lower()
        if scheme == "file":
            problems.append(f"{where}: {target} -> file:// link (names one machine's file; use a relative link)")
        return  # http(s), mailto and the like are allowed and not fetched
    path_part, _, anchor = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    path_part = unquote(path_part)
    anchor = unquote(anchor)
    if path_part.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path_part) or path_part.startswith("~"):
        problems.append(f"{where}: {target} -> absolute path (use a path relative to {source.relative_to(ROOT)})")
        return
    if path_part:
        resolved = Path(os.path.normpath(source.parent / path_part))
        if not inside_root(resolved):
            problems.append(f"{where}: {target} -> points outside the repository")
            return
        real = Path(os.path.realpath(resolved))
        if not inside_root(real):
            problems.append(f"{where}: {target} -> resolves (through a symlink) outside the repository")
            return
        if not resolved.exists():
            problems.append(f"{where}: {target} -> no such file or directory")
            return
    else:
        resolved = source
    if resolved.is_file() and resolved.suffix.lower() in (".md", ".markdown"):
        if resolved != source:
            linked_md.add(resolved)
        if anchor and anchor not in anchors(resolved):
            rel = resolved.relative_to(ROOT)
            problems.append(f"{where}: {target} -> no heading with anchor #{anchor} in {rel}")


def check_file(path, problems, linked_md):
    text = path.read_text(encoding="utf-8", errors="replace")
    rel = path.relative_to(ROOT)
    prose, code = split_code(text)
    count = 0

    def where(offset):
        return f"{rel}:{line_of(text, offset)}"

    def scan_links(chunk, base):
        nonlocal count
        for m in INLINE_LINK.finditer(chunk):
            count += 1
            check_target(path, m.group(3), problems, where(base + m.start()), linked_md)
            inner = m.group(2)
            if "](" in inner:  # a link or image inside the link text
                scan_links(inner, base + m.start(2))

    scan_links(prose, 0)
    for m in REF_DEF.finditer(prose):
        count += 1
        check_target(path, m.group(2), problems, where(m.start()), linked_md)
    for m in AUTOLINK.finditer(prose):
        count += 1
        check_target(path, m.group(1), problems, where(m.start()), linked_md)
    for m in HTML_ATTR.finditer(prose):
        count += 1
        value = m.group(1) if m.group(1) is not None else m.group(2)
        check_target(path, value, problems, where(m.start()), linked_md)
    for offset, snippet in code:
        for m in FORBIDDEN_IN_CODE.finditer(snippet):
            mention = m.group(1).rstrip("`'\".,;)")
            problems.append(
                f"{where(offset + m.start(1))}: {mention} -> code names a path outside the repository"
            )
    return count


def main(argv):
    verbose = "-v" in argv
    names = [a for a in argv if a != "-v"]
    if names:
        queue = [Path(n).resolve() for n in names]
    else:
        queue = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    queue = [p for p in queue if p.is_file()]
    done = set()
    problems = []
    links = 0
    while queue:
        path = queue.pop(0)
        if path in done:
            continue
        done.add(path)
        linked = set()
        mine = []
        links += check_file(path, mine, linked)
        mine.sort(key=lambda p: int(p.split(":", 2)[1]))  # "file:line: ..." in line order
        problems.extend(mine)
        if not names:  # follow links to other Markdown files of the repository
            queue.extend(sorted(p for p in linked if p not in done))
    for p in problems:
        print(p)
    if verbose:
        print(f"check-docs: {len(done)} files, {links} links, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
