#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (jax 0.11 and later need one), for `make test-newest`
# and `make test-compat COMPAT=jax011`. Messages go to stderr, the path alone to stdout.
#
# In this order, the first interpreter that runs and is new enough:
#   1. $NEWEST_PYTHON, if set (an interpreter chosen by hand);
#   2. python3.13, then python3.12 on PATH (Debian 13's system Python; a pyenv shim whose
#      version is not selected fails to run and is passed over);
#   3. pyenv's installed versions, newest first (`pyenv root`/versions/3.1x.y/bin/python3);
#   4. one this script built before, under $PYTHON_BUILD_DIR;
#   5. otherwise it builds CPython 3.13 from Debian trixie's source package `python3.13`
#      (its upstream tarball), into $PYTHON_BUILD_DIR (about 10 minutes on 2 cores). apt
#      reads a private configuration (a deb-src line for trixie with the URI of the
#      machine's own Debian source, its own lists directory): the system's sources are not
#      touched. The build dependencies (a C compiler, libssl, zlib, libffi...) must be there.
set -euo pipefail

PYTHON_BUILD_DIR="${PYTHON_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-lossscale/cpython-3.13}"

log() { echo "find_python: $*" >&2; }

# Whether $1 runs and is Python >= 3.12 with a working venv module.
usable() {
  "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

found() {
  local path
  path="$("$1" -c 'import sys; print(sys.executable)')"
  log "using $path ($("$1" --version 2>&1))"
  echo "$path"
  exit 0
}

if [[ -n "${NEWEST_PYTHON:-}" ]]; then
  usable "$NEWEST_PYTHON" || { log "NEWEST_PYTHON=$NEWEST_PYTHON is not a Python >= 3.12"; exit 1; }
  found "$NEWEST_PYTHON"
fi

for name in python3.13 python3.12; do
  if command -v "$name" >/dev/null 2>&1 && usable "$name"; then
    found "$name"
  fi
done

if command -v pyenv >/dev/null 2>&1; then
  root="$(pyenv root)"
  for dir in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -rV); do
    if [[ -x "$dir/bin/python3" ]] && usable "$dir/bin/python3"; then
      found "$dir/bin/python3"
    fi
  done
fi

if [[ -x "$PYTHON_BUILD_DIR/bin/python3" ]] && usable "$PYTHON_BUILD_DIR/bin/python3"; then
  found "$PYTHON_BUILD_DIR/bin/python3"
fi

# -- none found: build CPython 3.13 from Debian trixie's source package ----------------
log "no Python >= 3.12 found: building CPython 3.13 from Debian trixie's source package"
log "into $PYTHON_BUILD_DIR (about 10 minutes on 2 cores)"

# The URI of the machine's own Debian archive (deb822 sources or the one-line format).
uri=""
for f in /etc/apt/sources.list.d/*.sources; do
  [[ -f "$f" ]] || continue
  uri="$(awk '/^URIs:/ {print $2; exit}' "$f")"
  [[ "$uri" == */debian ]] && break
  uri=""
done
if [[ -z "$uri" && -f /etc/apt/sources.list ]]; then
  uri="$(awk '$1 == "deb" && $2 ~ /\/debian$/ {print $2; exit}' /etc/apt/sources.list)"
fi
[[ -n "$uri" ]] || { log "no Debian apt source found to take the URI from"; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt downloads as the user _apt
mkdir -p "$work/lists/partial" "$work/src"
echo "deb-src $uri trixie main" >"$work/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$work/sources.list"
  -o "Dir::Etc::SourceParts=$work/none"
  -o "Dir::State::Lists=$work/lists"
  -o "Debug::NoLocking=1"
)
apt-get "${apt_opts[@]}" -qq update >&2
(cd "$work/src" && apt-get "${apt_opts[@]}" -qq source --download-only python3.13 >&2)
tarball="$(ls "$work"/src/python3.13_*.orig.tar.* | head -n 1)"
log "building from $(basename "$tarball")"
tar -xf "$tarball" -C "$work/src"
srcdir="$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'Python-3.13*' | head -n 1)"
(
  cd "$srcdir"
  ./configure --prefix="$PYTHON_BUILD_DIR" --with-ensurepip=install >"$work/configure.log" 2>&1 \
    || { tail -n 30 "$work/configure.log" >&2; exit 1; }
  make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
  make install >"$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; exit 1; }
)
usable "$PYTHON_BUILD_DIR/bin/python3" || { log "the built Python does not run"; exit 1; }
found "$PYTHON_BUILD_DIR/bin/python3"
