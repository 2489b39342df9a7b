#!/usr/bin/env bash
# What building the Python wheel needs on Debian 12, and where its build backend lives.
#
#   PYTHONPATH=$(bash tools/install_wheel_deps.sh) python3 -m build --wheel --no-isolation .
#
# 1. Debian 12 packages (apt; skipped when installed): the PEP 517 front end (python3-build),
#    venv, patchelf and the backend's dependencies.
# 2. The backend, scikit-build-core, is not packaged in Debian 12. Its Debian 13 package is pure
#    Python; it needs a newer `packaging` than Debian 12's (canonicalize_name(validate=...)), also
#    pure Python. Both are downloaded from the trixie archive through a private apt configuration
#    (its own sources list, package lists and cache under $PREFIX/apt; the system's apt sources are
#    not touched; signatures are checked with Debian's keyring) and unpacked with `dpkg -x` into
#    $PREFIX, whose dist-packages then comes first on PYTHONPATH for the build. Nothing is
#    installed into the system's Python.
#
# stdout: one line, the directory to put on PYTHONPATH. Progress and errors go to stderr; a
# failure names the step and the package. Needs root for step 1 only. Idempotent: a second run
# downloads nothing.
#
# Environment: PYTHON (default /usr/bin/python3, the Debian Python the packages are for),
#              MORI_WHEEL_TOOLS_PREFIX (default /opt/mori-wheel-tools),
#              MORI_WHEEL_TOOLS_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

PY=${PYTHON:-/usr/bin/python3}
PREFIX=${MORI_WHEEL_TOOLS_PREFIX:-/opt/mori-wheel-tools}
MIRROR=${MORI_WHEEL_TOOLS_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie
BACKEND_PKGS=(python3-scikit-build-core python3-packaging)
BACKEND_MIN=0.8 # pyproject.toml's build-system.requires
SITE="$PREFIX/usr/lib/python3/dist-packages"
PKGS=(python3-build python3-wheel python3-venv python3-packaging python3-pathspec
  python3-pyproject-metadata patchelf)
# Bounded network waits: without a package network this fails in minutes, not hours.
APT_NET=(-o Acquire::Retries=1 -o Acquire::http::Timeout=30 -o Acquire::https::Timeout=30)

log() { echo "install_wheel_deps: $*" >&2; }
fail() {
  log "ERROR: $*"
  exit 1
}

# --- 1. Debian 12 packages ------------------------------------------------------------------
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  timeout 600 apt-get update -qq "${APT_NET[@]}" >&2 ||
    fail "apt-get update failed (package network?); needed for: ${missing[*]}"
  timeout 900 apt-get install -y -qq --no-install-recommends "${APT_NET[@]}" "${missing[@]}" >&2 ||
    fail "apt-get install failed for: ${missing[*]} (are they all in this release's archive?)"
fi

# --- 2. scikit-build-core from the trixie archive, unpacked into $PREFIX ---------------------
backend_version() {  # the version unpacked in $SITE, or nothing
  PYTHONPATH="$SITE" timeout 60 "$PY" -c \
    'import importlib.metadata as m; print(m.version("scikit-build-core"))' 2>/dev/null || true
}
have=$(backend_version)
if [[ -z "$have" || ! -f "$SITE/packaging/__init__.py" ]]; then
  work="$PREFIX/apt"
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
  : >"$work/status"
  cat >"$work/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $SUITE main
EOF
  # A private apt: its own sources, lists, cache and an empty dpkg status, one architecture,
  # no translations. The system's /etc/apt sources and lists stay as they are.
  APT_PRIV=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
    -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache" -o Dir::State::Status="$work/status"
    -o APT::Architectures=amd64 -o Acquire::Languages=none -o Debug::NoLocking=1 -o APT::Sandbox::User=root "${APT_NET[@]}")
  log "fetching the $SUITE package index from $MIRROR"
  timeout 600 apt-get "${APT_PRIV[@]}" update -qq --error-on=any >&2 ||
    fail "apt-get update of the private $SUITE index ($MIRROR) failed: cannot fetch ${BACKEND_PKGS[*]}"
  for pkg in "${BACKEND_PKGS[@]}"; do
    log "downloading $pkg"
    (cd "$work/debs" && timeout 300 apt-get "${APT_PRIV[@]}" download "$pkg" >&2) ||
      fail "apt-get download $pkg from $SUITE failed"
    deb=$(ls -t "$work/debs/${pkg}"_*.deb 2>/dev/null | head -1)
    [[ -n "$deb" ]] || fail "apt-get download left no ${pkg}_*.deb in $work/debs"
    dpkg -x "$deb" "$PREFIX" || fail "dpkg -x $deb $PREFIX failed"
  done
  rm -rf "$work/lists" "$work/cache"  # the index is large; the .deb stays as a record
  have=$(backend_version)
  [[ -n "$have" ]] || fail "$deb unpacked into $PREFIX, but $PY cannot import scikit_build_core from $SITE"
fi
# The backend must import with these packages and Debian 12's pathspec, and its project-name
# check needs packaging's canonicalize_name(validate=True).
PYTHONPATH="$SITE" timeout 60 "$PY" -c 'import scikit_build_core.build, packaging.utils as u
u.canonicalize_name("mori-ep", validate=True)' >&2 ||
  fail "scikit-build-core $have in $SITE does not work with the packages beside it (see above)"
PYTHONPATH="$SITE" "$PY" - "$have" "$BACKEND_MIN" <<'EOF' || fail "scikit-build-core $have is older than $BACKEND_MIN"
import sys
from packaging.version import Version
sys.exit(Version(sys.argv[1]) < Version(sys.argv[2]))
EOF
log "scikit-build-core $have in $SITE"
echo "$SITE"
