#!/usr/bin/env bash
# A Python 3.10 virtual environment with fairseq 0.12.2, to load, score and decode exported models
# (fairseq 0.12.2 does not import on Python 3.11). Cached: a finished environment is reused.
#
#   bash scripts/setup_fairseq_env.sh [DIR]     # default $FATHOM_FAIRSEQ_ENV or ~/.cache/fathom/fairseq-0.12.2
#   DIR/bin/fairseq-generate ...                # then use its commands
#
# PyPI has only fairseq's source release, and that release lists C++ sources it does not ship
# (clib/libbase, libnat): it is built without the torch extensions, which translation never uses.
set -euo pipefail

ENV_DIR="${1:-${FATHOM_FAIRSEQ_ENV:-$HOME/.cache/fathom/fairseq-0.12.2}}"
if [[ -f "$ENV_DIR/.complete" ]]; then
  echo "$ENV_DIR"
  exit 0
fi

is_310() { [[ -n "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; }
PY310=""
for candidate in "${PYTHON310:-}" "$(command -v python3.10 || true)" \
  $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.10*/bin/python3.10 2>/dev/null); do
  if is_310 "$candidate"; then PY310="$candidate"; break; fi
done
if [[ -z "$PY310" ]]; then
  echo "fathom: error: fairseq 0.12.2 needs Python 3.10; install it (e.g. pyenv install 3.10) or set PYTHON310" >&2
  exit 2
fi

mkdir -p "$(dirname "$ENV_DIR")"
# One build at a time: parallel test workers (make test runs pytest -n 2) may ask for it together.
exec 9>"$ENV_DIR.lock"
flock 9
if [[ -f "$ENV_DIR/.complete" ]]; then
  echo "$ENV_DIR"
  exit 0
fi
rm -rf "$ENV_DIR"
"$PY310" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip --quiet --disable-pip-version-check)
"${PIP[@]}" install torch==1.12.1 "numpy<2" cython wheel "setuptools<70"
"${PIP[@]}" install "hydra-core>=1.0.7,<1.1" "omegaconf<2.1" bitarray regex sacrebleu==2.4.3 sentencepiece tqdm cffi

BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
"${PIP[@]}" download --no-deps --no-build-isolation fairseq==0.12.2 -d "$BUILD"
tar -xzf "$BUILD"/fairseq-0.12.2.tar.gz -C "$BUILD"
sed -i 's/^    from torch.utils import cpp_extension$/    raise ImportError  # fathom: skip the torch extensions/' \
  "$BUILD/fairseq-0.12.2/setup.py"
"${PIP[@]}" install --no-build-isolation --no-deps "$BUILD/fairseq-0.12.2"
"$ENV_DIR/bin/python" -c "import fairseq.models.transformer, fairseq.checkpoint_utils" 2>/dev/null
touch "$ENV_DIR/.complete"
echo "$ENV_DIR"
