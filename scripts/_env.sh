# Sourced by scripts/demo and scripts/test: make .venv on a fresh machine and keep it current.
# The pinned CPU torch wheel goes in first and only when torch is missing, so pip never
# reaches for a multi-GB CUDA build; users with a GPU install their own torch (pyproject says torch>=2.3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setting up $VENV (first run: a few minutes)" >&2
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.ttpeer-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/bootstrap-relay/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip >&2
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" >&2
  # [all]: the tests cover every extra (Hugging Face: about 40 s more CPU on a fresh .venv)
  # PYTHONWARNINGS: setuptools warns of every editable install ("be careful with folders
  # ... with the same name as your package"), which only worries a newcomer here.
  PYTHONWARNINGS=ignore python -m pip install -q -e "$ROOT[test,all]" >&2
  echo "$want" >"$stamp"
fi
