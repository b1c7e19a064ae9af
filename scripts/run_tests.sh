#!/usr/bin/env bash
# The test suite as `make test` runs it, in two parts:
#   1. every test but those marked serial, spread over TEST_WORKERS pytest-xdist workers (default 2), a test
#      module per worker at a time (--dist loadfile: a module's shared fixtures are made once);
#   2. the serial tests (tests/conftest.py SERIAL_MODULES: the watchdog's and heartbeats' wall-clock bounds), alone.
# Arguments go to both parts (-k, -x, a file...); a part they select nothing from is skipped. TEST_WORKERS=0, or an
# environment without pytest-xdist, runs part 1 in one process.
set -uo pipefail
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}

# --no-loadscope-reorder: the modules are handed out in the order the workers collect them, the slowest first
# (tests/conftest.py SLOW_MODULES).
spread=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
if [ "$WORKERS" = 0 ] || ! "$PY" -c "import xdist" 2>/dev/null; then
  [ "$WORKERS" = 0 ] || echo "run_tests: pytest-xdist is not installed: the tests run in one process"
  spread=(-p no:xdist)
fi

"$PY" -m pytest -q --durations=15 "${spread[@]}" -m "not serial" "$@"
first=$?
"$PY" -m pytest -q --durations=5 -p no:xdist -m serial "$@"
second=$?
# 5: no test selected (arguments that name only the other part's tests).
[ "$first" = 5 ] && [ "$second" != 5 ] && first=0
[ "$second" = 5 ] && [ "$first" != 5 ] && second=0
[ "$first" != 0 ] && exit "$first"
exit "$second"
