#!/bin/sh
# Fetch Debian's kernel image, its headers (with the packages they depend on to build a module:
# -common, linux-kbuild-6.1, linux-compiler-gcc-12-x86), linux-source-6.1 and busybox-static;
# unpack them under $B. resolve.py picks each version among what apt offers: only the kernel's
# ABI (image, headers, -common) is pinned to the image's version. A second run finds them cached.
# Usage: fetch.sh BUILD_DIR     (writes BUILD_DIR/env: SERIES, KREL, KVER, DEBS: name=version)
# The backports tier (kernel-tier/backports/run.sh) runs it with APT_CONFIG naming its private
# apt configuration, KERNEL_TIER_SERIES=6.12 and KERNEL_TIER_USERLAND: packages fetched beside
# the kernel (QEMU, libvirt) at the versions apt's own resolution picks, with every dependency
# the host's installed set does not already satisfy (the guest's other libraries are the host's).
set -eu
B=${1:?build dir}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${KERNEL_TIER_PYTHON:-$HERE/../.venv/bin/python}   # resolve.py needs python-debian (make venv)
mkdir -p "$B" && B=$(cd "$B" && pwd)
mkdir -p "$B/debs" "$B/root"
if [ -f "$B/env" ] && [ -f "$B/.fetched" ]; then
  echo "fetch: cached ($(cat "$B/env" | tr '\n' ' '))"; exit 0
fi
[ -x "$PY" ] || { echo "fetch: no $PY (make venv)" >&2; exit 1; }
# On a misfit resolve.py prints one line (package, constraint, what the archive has): pass it on.
"$PY" "$HERE/resolve.py" --series "${KERNEL_TIER_SERIES:-6.1}" > "$B/resolved" ||
  { rm -f "$B/resolved"; exit 1; }
if [ -n "${KERNEL_TIER_USERLAND:-}" ]; then
  # apt's answer for installing them on this host: "Inst NAME [OLD] (VERSION ARCHIVE [ARCH])".
  # shellcheck disable=SC2086  # a list of package names
  USERLAND=$(LC_ALL=C apt-get -s -q install --no-install-recommends $KERNEL_TIER_USERLAND |
    sed -n 's/^Inst \([^ ]*\) \(\[[^]]*\] \)\{0,1\}(\([^ ]*\) .*/\1=\3/p' | tr '\n' ' ')
  [ -n "$USERLAND" ] || { echo "fetch: apt offers nothing new for $KERNEL_TIER_USERLAND" >&2; exit 1; }
  echo "USERLAND='$USERLAND'" >> "$B/resolved"
fi
. "$B/resolved"
DEBS="$DEBS ${USERLAND:-}"
echo "fetch: kernel $KREL at $KVER"
# The file apt-get download writes for NAME VERSION (an epoch's colon is escaped as %3a).
deb() { printf '%s_%s_' "$1" "$(printf %s "$2" | sed 's/:/%3a/')"; }
cd "$B/debs"
for spec in $DEBS; do
  p=${spec%%=*} v=${spec#*=}
  ls "$(deb "$p" "$v")"*.deb >/dev/null 2>&1 || apt-get download -q -o APT::Sandbox::User=root "$spec"
done
ls busybox-static_*.deb >/dev/null 2>&1 || apt-get download -q -o APT::Sandbox::User=root busybox-static
# Unpack exactly the chosen versions (debs/ may keep others from an earlier resolution).
for spec in $DEBS; do
  p=${spec%%=*} v=${spec#*=}
  case $p in linux-source-*) src=$(ls "$(deb "$p" "$v")"*.deb); continue ;; esac
  dpkg-deb -x "$(ls "$(deb "$p" "$v")"*.deb)" "$B/root"
done
dpkg-deb -x "$(ls busybox-static_*.deb | tail -1)" "$B/root"
# linux-source ships the tree as a tarball: take the one sample we build.
dpkg-deb -x "$src" "$B/src-deb"
tar -xaf "$B"/src-deb/usr/src/linux-source-"$SERIES".tar.* -C "$B" --wildcards '*/samples/vfio-mdev/*'
rm -rf "$B/src-deb"
mv "$B/resolved" "$B/env"
touch "$B/.fetched"
