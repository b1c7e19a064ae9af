#!/usr/bin/env bash
# Create or refresh the virtualenv that `make` uses; does nothing when it is up to date. Called by the Makefile:
#   VENV=.venv ACCEL=auto INSTALLER=auto PYTHON= scripts/setup_env.sh [--report] [--dry-run]
#
# ACCEL   auto (default): CUDA when `nvidia-smi -L` lists a GPU, or when the interpreter already has a CUDA-enabled
#         jax; the CPU otherwise. cpu / cuda force one.
#         CUDA means: the interpreter's own CUDA-enabled jax when it has one (a GPU image, maybe offline: the venv is
#         made with --system-site-packages and only what is missing is installed, jax never), else `.[cuda,dev]`.
# INSTALLER  auto (default): uv (from PATH, else bootstrapped once with pip into ~/.cache/angel_jax/tools), pip
#         when uv cannot be had; uv or pip forces one.
# --report   also say so when nothing needed doing;  --dry-run   print the decisions and commands, change nothing
#         (DRY_RUN=1 does the same).
# The stamp $VENV/.installed records what was built (accelerator, interpreter, the inputs' checksum): a change in
# any of them rebuilds the venv from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VENV=${VENV%/}
ACCEL=${ACCEL:-auto}
INSTALLER=${INSTALLER:-auto}
UV_VERSION=${ANGEL_JAX_UV_VERSION:-0.13.9}
TOOLS=${ANGEL_JAX_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/angel_jax/tools}
STAMP=$VENV/.installed
STAMP_FORMAT=1      # bump when what a build does changes, so that existing venvs are rebuilt
REPORT=0
DRY=${DRY_RUN:-0}
[ "$DRY" = 0 ] || DRY=1
for arg in "$@"; do
  case $arg in
    --report) REPORT=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "setup_env.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

say() { echo "$*"; }
die() { echo "$*" >&2; exit 1; }
run() {  # run a command, or print it under --dry-run
  if [ "$DRY" = 0 ]; then "$@"; return; fi
  printf '  would run:'
  for a in "$@"; do case $a in *[!A-Za-z0-9_./=:,+@%-]*) printf " '%s'" "$a" ;; *) printf ' %s' "$a" ;; esac; done
  echo
}
stamp_field() { [ -f "$STAMP" ] && sed -n "s/^$1=//p" "$STAMP" | head -1 || true; }

case $ACCEL in auto | cpu | cuda) ;; *) die "ACCEL must be auto, cpu or cuda (got '$ACCEL')" ;; esac
case $INSTALLER in auto | uv | pip) ;; *) die "INSTALLER must be auto, uv or pip (got '$INSTALLER')" ;; esac

# The interpreter: the one the stamp recorded for the same PYTHON request (finding one costs ~0.5 s of pyenv shims),
# else scripts/find_python.sh.
py=$(stamp_field python)
if [ -z "$py" ] || [ "$(stamp_field python_request)" != "${PYTHON:-}" ] || [ ! -x "$py" ]; then
  py=$(PYTHON="${PYTHON:-}" scripts/find_python.sh)
fi

gpu_listed() {
  command -v nvidia-smi >/dev/null 2>&1 || return 1
  local t=()
  if command -v timeout >/dev/null 2>&1; then t=(timeout 20); fi
  "${t[@]}" nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]'
}

# Does the interpreter have a CUDA-enabled jax in range? (metadata only: no jax import, no GPU needed)
sys_jax=""
sys_jax_note=""
probe_system() {
  local out
  if out=$("$py" scripts/env_probe.py cuda-jax 2>/dev/null); then sys_jax=$out; else sys_jax_note=$out; fi
}

reason=""
case $ACCEL in
  cpu) accel=cpu; reason="ACCEL=cpu: installing jax for the CPU" ;;
  cuda) accel=cuda; probe_system ;;
  auto)
    if gpu_listed; then
      accel=cuda; probe_system
    else
      probe_system
      if [ -n "$sys_jax" ]; then accel=cuda; else accel=cpu; fi
    fi ;;
esac

if [ "$accel" = cuda ] && [ -n "$sys_jax" ]; then
  mode=system
  read -r jax_version cuda_major <<<"$sys_jax"
  reason="$py already has jax $jax_version with its CUDA $cuda_major plugin: $VENV uses it as is (--system-site-packages; jax is not reinstalled; ACCEL=cpu for a CPU-only venv)"
else
  mode=install
  if [ "$accel" = cuda ] && [ "$ACCEL" = cuda ]; then
    reason="ACCEL=cuda: installing jax with CUDA 13"
  elif [ "$accel" = cuda ]; then
    reason="nvidia-smi found a GPU: installing jax with CUDA 13 (ACCEL=cpu to force the CPU)"
  elif [ "$ACCEL" = auto ]; then
    reason="no NVIDIA GPU found (nvidia-smi -L): installing jax for the CPU (ACCEL=cuda to force CUDA)"
  fi
fi
[ -z "$sys_jax_note" ] || [ "$mode" = system ] || [ "$accel" = cpu ] || say "note: not using $py's own jax: $sys_jax_note"

inputs=$(cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
want="format=$STAMP_FORMAT
accel=$accel
mode=$mode
python_request=${PYTHON:-}
python=$py
inputs=$inputs"
cli_line="angel-jax is at $VENV/bin/angel-jax (or: source $VENV/bin/activate)"

# One set-up of a venv at a time (two `make test` started together): the second waits, then finds it current.
case $VENV in /*) abs=$VENV ;; *) abs=$PWD/$VENV ;; esac
if [ "$DRY" = 0 ] && command -v flock >/dev/null 2>&1; then
  exec 9>"${TMPDIR:-/tmp}/angel_jax-setup-$(printf '%s' "$abs" | cksum | cut -d' ' -f1).lock"
  flock -n 9 || { say "waiting for another set-up of $VENV to finish"; flock 9; }
fi

current() { [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ] && [ "$(grep -v '^installer=' "$STAMP")" = "$want" ]; }

# A venv built by the Makefile before this script (an empty stamp, newer than the inputs, CPU jax) is adopted
# as it is: the same pip install of '.[dev]' with constraints.txt made it.
if [ -f "$STAMP" ] && [ ! -s "$STAMP" ] && [ "$accel" = cpu ] && [ -x "$VENV/bin/python" ] \
  && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt constraints.txt ] \
  && ! "$VENV/bin/python" scripts/env_probe.py cuda-jax >/dev/null 2>&1; then
  if [ "$DRY" = 1 ]; then say "$VENV (made before setup_env.sh, jax for the CPU) would be kept as it is"; exit 0; fi
  printf '%s\ninstaller=pip (before setup_env.sh)\n' "$want" >"$STAMP"
fi

if current; then
  if [ "$DRY" = 1 ]; then say "$VENV is up to date ($accel, $mode): nothing would be done"; exit 0; fi
  [ "$REPORT" = 0 ] || say "$VENV is up to date (jax for $accel; $(stamp_field installer)); $cli_line"
  exit 0
fi

if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
  die "VENV=$VENV exists and is not a virtualenv: not deleting it"
fi
say "using $py"
[ -z "$reason" ] || say "$reason"
[ "$DRY" = 0 ] || say "(dry run: $VENV would be rebuilt; nothing is changed)"
run rm -rf "$VENV"

if [ "$mode" = system ]; then
  # The interpreter's packages stay as they are: the venv sees them, pip adds only what is missing (no network
  # needed when nothing is), and never replaces an installed package to satisfy a pin of constraints.txt.
  if [ "$DRY" = 0 ] && ! "$py" -m venv --system-site-packages "$VENV" 2>/dev/null; then
    rm -rf "$VENV"   # no ensurepip (Debian's python3-venv): the interpreter's own pip serves the venv
    "$py" -m venv --system-site-packages --without-pip "$VENV"
  elif [ "$DRY" = 1 ]; then
    run "$py" -m venv --system-site-packages "$VENV"
  fi
  # --system-site-packages reaches the base interpreter's packages only: when $py is itself a venv's (the GPU
  # image's python3 is /opt/torch/.venv's), its packages are put on the new venv's path by a .pth file, after the
  # venv's own.
  parent_sites=$("$py" scripts/env_probe.py venv-sites)
  if [ -n "$parent_sites" ]; then
    if [ "$DRY" = 0 ]; then
      site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      # addsitedir, not a bare path: the parent's own .pth files (editable installs, namespace hooks) apply too.
      while IFS= read -r d; do printf 'import site; site.addsitedir(%s)\n' "'$d'"; done <<<"$parent_sites" \
        >"$site/angel_jax_parent_env.pth"
    fi
    say "$py is a virtualenv's: $VENV also sees its packages (${parent_sites//$'\n'/, })"
  fi
  vpy=$VENV/bin/python
  [ "$DRY" = 0 ] || vpy=$py
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$vpy" scripts/env_probe.py missing dev "$tmp/constraints.txt" >"$tmp/missing"
  need_run=$(sed -n 's/^run //p' "$tmp/missing")
  need_dev=$(sed -n 's/^dev //p' "$tmp/missing")
  pip=("$vpy" -m pip install -q -c "$tmp/constraints.txt")
  if [ -n "$need_run" ]; then
    say "installing what $py lacks: ${need_run//$'\n'/ }"
    mapfile -t reqs <<<"$need_run"
    run "${pip[@]}" "${reqs[@]}" || die "could not install ${need_run//$'\n'/ } (no network here? install them into $py)"
  fi
  if [ -n "$need_dev" ]; then
    say "installing the test tools $py lacks: ${need_dev//$'\n'/ }"
    mapfile -t reqs <<<"$need_dev"
    # Optional for training: a short try, pip's messages kept back unless it fails.
    run "${pip[@]}" --retries 1 --timeout 20 "${reqs[@]}" 2>"$tmp/err" \
      || say "warning: could not install them ($(grep -m1 -o "\[Errno[^']*\|ERROR: .*" "$tmp/err" || tail -1 "$tmp/err")): training works; make test needs pytest and hypothesis"
  fi
  [ -n "$need_run$need_dev" ] || say "$py has every dependency: nothing downloaded"
  # angel_jax itself, editable, without its dependencies; offline when the interpreter has setuptools.
  if "$vpy" scripts/env_probe.py build-backend; then
    run "$vpy" -m pip install -q --no-deps --no-build-isolation -e .
  elif [ "$DRY" = 1 ]; then
    run "$vpy" -m pip install -q --no-deps -e .
  elif ! "$vpy" -m pip install -q --no-deps -e . 2>"$tmp/err"; then
    # No setuptools to build with and none to download: put the repository on the venv's path by hand.
    site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$PWD" >"$site/angel_jax_repo.pth"
    printf '#!%s\nimport sys\nfrom angel_jax.cli import main\nsys.exit(main())\n' "$(cd "$VENV" && pwd)/bin/python" >"$VENV/bin/angel-jax"
    chmod +x "$VENV/bin/angel-jax"
    say "pip could not build angel_jax (no setuptools >= 68 in $py, and none to download): $VENV finds it through angel_jax_repo.pth instead"
  fi
  installer="pip (system packages)"
else
  extras=dev
  [ "$accel" = cpu ] || extras=cuda,dev
  uv=""
  if [ "$INSTALLER" != pip ]; then
    if command -v uv >/dev/null 2>&1 && uv --version >/dev/null 2>&1; then
      uv=$(command -v uv)
    elif [ -x "$TOOLS/uv-$UV_VERSION/bin/uv" ]; then
      uv=$TOOLS/uv-$UV_VERSION/bin/uv
    elif [ "$DRY" = 1 ]; then
      uv="$TOOLS/uv-$UV_VERSION/bin/uv"
      run "$py" -m pip install -q --target "$TOOLS/uv-$UV_VERSION" "uv==$UV_VERSION"
    else
      say "bootstrapping uv $UV_VERSION into $TOOLS (once per machine; INSTALLER=pip to use pip only)"
      mkdir -p "$TOOLS"
      part=$(mktemp -d "$TOOLS/.uv-XXXXXX") && chmod 755 "$part"
      if PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --disable-pip-version-check --target "$part" "uv==$UV_VERSION" \
        2>"$part.err" && "$part/bin/uv" --version >/dev/null 2>&1; then
        rm -rf "$TOOLS/uv-$UV_VERSION" && mv "$part" "$TOOLS/uv-$UV_VERSION" && uv=$TOOLS/uv-$UV_VERSION/bin/uv
      else
        why=$(grep -v '^WARNING' "$part.err" | tail -1 | cut -c1-200)
        rm -rf "$part" "$part.err"
        [ "$INSTALLER" = auto ] || die "INSTALLER=uv: uv could not be installed ($why)"
        say "uv could not be installed ($why): installing with pip"
      fi
      rm -f "$part.err"
    fi
  fi
  if [ -n "$uv" ]; then
    # uv reads no pip configuration files; an index named in PIP_INDEX_URL (a mirror of PyPI) is carried over.
    # Extra indexes are not: uv would take a package only from the first index that has it.
    if [ -n "${PIP_INDEX_URL:-}" ] && [ -z "${UV_INDEX_URL:-}${UV_DEFAULT_INDEX:-}" ]; then export UV_DEFAULT_INDEX=$PIP_INDEX_URL; fi
    installer="uv $( [ "$DRY" = 1 ] && echo "$UV_VERSION" || "$uv" --version | cut -d' ' -f2)"
    say "installing with $installer"
    if ! { run "$uv" venv -q --seed --python "$py" "$VENV" \
      && run "$uv" pip install -q --python "$VENV/bin/python" -c constraints.txt -e ".[$extras]"; }; then   # --seed: pip inside, as a plain venv has
      [ "$INSTALLER" = auto ] || die "INSTALLER=uv: uv failed"
      say "uv failed (above): installing with pip instead (INSTALLER=pip goes straight to pip)"
      rm -rf "$VENV"
      uv=""
    fi
  fi
  if [ -z "$uv" ]; then
    installer=pip
    run "$py" -m venv "$VENV"
    run "$VENV/bin/python" -m pip install -q --upgrade pip
    run "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[$extras]"
  fi
fi

[ "$DRY" = 0 ] || exit 0
printf '%s\ninstaller=%s\n' "$want" "$installer" >"$STAMP"
say "$cli_line"
