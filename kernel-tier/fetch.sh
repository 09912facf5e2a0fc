#!/bin/sh
# Fetch Debian's kernel image, its headers (with the packages they need to build a module:
# -common, linux-kbuild-6.1, linux-compiler-gcc-12-x86) and linux-source-6.1, all at ONE
# version, plus busybox-static; unpack them under $B. A second run finds them cached.
# Usage: fetch.sh BUILD_DIR            (writes BUILD_DIR/env with KREL and KVER)
set -eu
B=${1:?build dir}
mkdir -p "$B" && B=$(cd "$B" && pwd)
mkdir -p "$B/debs" "$B/root"
if [ -f "$B/env" ] && [ -f "$B/.fetched" ]; then
  echo "fetch: cached ($(cat "$B/env" | tr '\n' ' '))"; exit 0
fi
# The metapackage names the ABI (linux-image-6.1.0-N-amd64); its candidate version is the
# Debian version every other package must match.
KREL=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: linux-image-\(6\.1\.[0-9.-]*-amd64\)$/\1/p' | head -1)
KVER=$(apt-cache policy "linux-image-$KREL" | sed -n 's/^ *Candidate: //p')
[ -n "$KREL" ] && [ -n "$KVER" ] || { echo "fetch: cannot resolve the 6.1 kernel from apt" >&2; exit 1; }
ABI=${KREL%-amd64}
echo "fetch: kernel $KREL at $KVER"
cd "$B/debs"
for p in "linux-image-$KREL" "linux-headers-$KREL" "linux-headers-$ABI-common" \
         linux-kbuild-6.1 linux-compiler-gcc-12-x86 linux-source-6.1; do
  ls "${p}_"*"_"*.deb >/dev/null 2>&1 || apt-get download -q -o APT::Sandbox::User=root "$p=$KVER"
done
ls busybox-static_*.deb >/dev/null 2>&1 || apt-get download -q -o APT::Sandbox::User=root busybox-static
for d in *.deb; do
  case $d in linux-source-*) continue ;; esac   # only samples/vfio-mdev is needed from it
  dpkg-deb -x "$d" "$B/root"
done
# linux-source ships the tree as a tarball: take the one sample we build.
dpkg-deb -x linux-source-6.1_*.deb "$B/src-deb"
tar -xaf "$B"/src-deb/usr/src/linux-source-6.1.tar.* -C "$B" --wildcards '*/samples/vfio-mdev/*'
rm -rf "$B/src-deb"
printf 'KREL=%s\nKVER=%s\n' "$KREL" "$KVER" > "$B/env"
touch "$B/.fetched"
