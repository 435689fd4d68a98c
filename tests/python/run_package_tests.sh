#!/bin/sh
# ctest python_package (cmake/python.cmake): builds and installs the moe_harness Python package
# (python/, CPU-only) into a virtual environment under the build tree, then runs pytest over
# tests/python (NumPy implementations through moe_harness.check, the pytest plugin, golden files
# written from NumPy and verified with the CLI at $MOE_HARNESS_CLI).
#
#   run_package_tests.sh PYTHON SOURCE_DIR WORK_DIR [pytest args...]
#
# The venv, pip's wheels and the extension's CMake build directory persist in WORK_DIR, so a
# second run rebuilds nothing. Exit 77 (ctest: skipped) only when there is no Python with venv
# or pip, or pip cannot reach a package index; anything else that fails is a failure.
set -u
PY=$1
SRC=$2
WORK=$3
shift 3
SKIP=77
start=$(date +%s)
say() { echo "python_package: $*"; }
skip() { say "SKIPPED: $*"; exit $SKIP; }
fail() { say "FAILED: $*"; exit 1; }

command -v "$PY" >/dev/null 2>&1 || skip "no python ($PY)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null || skip "$PY is not Python >= 3.9"
mkdir -p "$WORK" || fail "cannot create $WORK"

VENV=$WORK/venv
if [ ! -x "$VENV/bin/python" ]; then
  rm -rf "$VENV"
  if ! "$PY" -m venv "$VENV" >"$WORK/venv.log" 2>&1; then
    cat "$WORK/venv.log"
    skip "$PY -m venv does not work (Debian: apt-get install python3-venv)"
  fi
fi
VPY=$VENV/bin/python
"$VPY" -m pip --version >/dev/null 2>&1 || skip "pip is not available in the venv"
PIP="$VPY -m pip --disable-pip-version-check"

# Build and test dependencies (once; later runs find them).
DEPS="numpy ml_dtypes pytest scikit-build-core nanobind"
if ! "$VPY" -c 'import numpy, ml_dtypes, pytest, scikit_build_core, nanobind' 2>/dev/null; then
  say "installing $DEPS into $VENV"
  if ! $PIP install --quiet $DEPS >"$WORK/deps.log" 2>&1; then
    tail -20 "$WORK/deps.log"
    if grep -qiE "could not find a version|connection|network|resolve|timed out|no matching distribution" "$WORK/deps.log"; then
      skip "pip cannot install $DEPS (no package index reachable)"
    fi
    fail "pip install $DEPS"
  fi
fi
t_deps=$(date +%s)

# The package: CPU-only C++ build in a persistent build dir (incremental on later runs).
say "pip install $SRC/python (build dir $WORK/ext)"
if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    $PIP install --no-build-isolation --no-deps --force-reinstall \
    --config-settings=build-dir="$WORK/ext" "$SRC/python" >"$WORK/install.log" 2>&1; then
  tail -60 "$WORK/install.log"
  fail "pip install $SRC/python (log: $WORK/install.log)"
fi
t_build=$(date +%s)
say "deps $((t_deps - start)) s, package build+install $((t_build - t_deps)) s"

# Import from the venv, not from the source tree: run pytest from the work dir.
cd "$WORK" || fail "cd $WORK"
"$VPY" -c 'import moe_harness, sys; print("python_package: moe_harness", moe_harness.__version__, "from", moe_harness.__file__)' ||
  fail "import moe_harness"
"$VPY" -m pytest -p no:cacheprovider -q -rs --rootdir "$SRC/tests/python" "$SRC/tests/python" "$@"
rc=$?
say "pytest exit $rc, total $(($(date +%s) - start)) s"
exit $rc
