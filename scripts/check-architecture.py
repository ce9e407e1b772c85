#!/usr/bin/env python3
"""Checks docs/architecture.md's crate table against the Cargo manifests: every workspace
crate is listed exactly once with a layer, no row names a crate that does not exist, and
every normal (non-dev) dependency of a crate on another kvrouter crate points to a lower
layer. Exits 1 with one line per problem."""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(?:root package\s+)?`([a-z0-9-]+)`[^|]*\|\s*(\d+)\b")


def manifest(path):
    """(package name, its normal kvrouter dependencies)."""
    name, deps, section = None, set(), None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        m = re.match(r"^\[([^\]]+)\]$", line)
        if m:
            section = m.group(1)
            continue
        if section == "package" and name is None:
            m = re.match(r'^name\s*=\s*"([^"]+)"', line)
            if m:
                name = m.group(1)
        if section == "dependencies":
            m = re.match(r"^(kvrouter-[a-z0-9-]+)\b", line)
            if m:
                deps.add(m.group(1))
    return name, deps


def main():
    crates = dict(manifest(p) for p in sorted(ROOT.glob("crates/*/Cargo.toml")))
    root_name, root_deps = manifest(ROOT / "Cargo.toml")
    crates[root_name] = root_deps
    layers, problems = {}, []
    for i, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        m = ROW.match(line)
        if not m:
            continue
        name, layer = m.group(1), int(m.group(2))
        if name in layers:
            problems.append(f"docs/architecture.md:{i}: {name} is listed twice")
        if name not in crates:
            problems.append(f"docs/architecture.md:{i}: {name} is not a crate of the workspace")
        layers[name] = layer
    for name in sorted(crates):
        if name not in layers:
            problems.append(f"docs/architecture.md: crate {name} is missing from the table")
            continue
        for dep in sorted(crates[name]):
            if dep in layers and layers[dep] >= layers[name]:
                problems.append(
                    f"{name} (layer {layers[name]}) depends on {dep} (layer {layers[dep]}): "
                    "imports must point to a lower layer"
                )
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
