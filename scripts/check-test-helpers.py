#!/usr/bin/env python3
"""Lists test helpers defined in more than one file: top-level functions and types (not the
tests themselves) under tests/ and crates/*/tests. A helper two suites need belongs in one
place: crates/testkit (real processes, ports, HTTP, metrics), tests/common (the kvrouter
binary's fleets) or the suite's own module. Exits 1 with one line per name defined twice.

Top-level means at column 0 of the file (methods and items inside a function are not helpers
other files could share); a function marked #[test], #[tokio::test] or written inside a
proptest! block is a test, not a helper."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ITEM = re.compile(
    r"^(?:pub(?:\([a-z]+\))?\s+)?(?:async\s+)?(fn|struct|enum|type|trait)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
TEST_ATTR = re.compile(r"^\s*#\[(?:[a-z_]+::)?test\b")


def files():
    roots = [ROOT / "tests"] + sorted((ROOT / "crates").glob("*/tests"))
    for r in roots:
        if r.is_dir():
            yield from sorted(r.rglob("*.rs"))


def helpers(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    in_proptest = 0  # brace depth inside a proptest! block, 0 when outside
    attrs = []
    for i, line in enumerate(lines, 1):
        if in_proptest:
            in_proptest += line.count("{") - line.count("}")
            continue
        if re.match(r"^proptest!\s*\{", line):
            in_proptest = line.count("{") - line.count("}")
            continue
        stripped = line.strip()
        if stripped.startswith("#["):
            attrs.append(stripped)
            continue
        if not stripped or stripped.startswith("//"):
            continue
        m = ITEM.match(line)
        if m and not any(TEST_ATTR.match(a) for a in attrs):
            yield m.group(2), i
        attrs = []


def main():
    seen = {}
    for f in files():
        for name, line in helpers(f):
            seen.setdefault(name, []).append((f.relative_to(ROOT), line))
    dups = {n: locs for n, locs in seen.items() if len({p for p, _ in locs}) > 1}
    for name in sorted(dups):
        where = ", ".join(f"{p}:{l}" for p, l in dups[name])
        print(f"{name}: defined in {where}")
    if dups:
        print(f"{len(dups)} test helper(s) defined in more than one file", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
