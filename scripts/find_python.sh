#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter, or fail with a message that says how to provide one.
# Order (3.12 preferred, the GPU image's version): $PYTHON, python3.12/python3.13/python3 on PATH, then pyenv's installed versions (a bare `python3.12`
# shim fails when pyenv's global version is older, so the interpreter binary is used directly).
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  if ok "$PYTHON"; then "$PYTHON" -c 'import sys; print(sys.executable)'; exit 0; fi
  echo "PYTHON=$PYTHON is not a working Python >= 3.12" >&2; exit 1
fi
for cand in python3.12 python3 python3.13; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then "$cand" -c 'import sys; print(sys.executable)'; exit 0; fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for dir in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
  for bin in "$dir"/bin/python3.1[2-9] "$dir"/bin/python3; do
    if [ -x "$bin" ] && ok "$bin"; then echo "$bin"; exit 0; fi
  done
done
echo "no Python >= 3.12 found: install one (e.g. 'pyenv install 3.12') or pass PYTHON=/path/to/python3.12" >&2
exit 1
