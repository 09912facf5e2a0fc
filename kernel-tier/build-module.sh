#!/bin/sh
# Build the kernel's mtty sample mdev parent (samples/vfio-mdev/mtty.c from linux-source-6.1)
# out of tree against the linux-headers of the SAME Debian version as the image.
# Usage: build-module.sh BUILD_DIR      (after fetch.sh; writes BUILD_DIR/module/mtty.ko)
set -eu
B=$(cd "${1:?build dir}" && pwd)
. "$B/env"
H="$B/root/usr/src/linux-headers-$KREL"
M="$B/module"
if [ -f "$M/mtty.ko" ] && [ "$M/mtty.ko" -nt "$B/.fetched" ]; then
  echo "module: cached ($M/mtty.ko)"; exit 0
fi
# The headers' Makefile includes the -common tree by its installed absolute path: point it at
# the unpacked copy (everything else in the tree is linked relatively).
sed -i "s|^include /usr/src/|include $B/root/usr/src/|" "$H/Makefile"
rm -rf "$M" && mkdir -p "$M"
cp "$B"/linux-source-6.1/samples/vfio-mdev/mtty.c "$M/"
echo 'obj-m := mtty.o' > "$M/Kbuild"
make -s -C "$H" M="$M" -j2 modules 2>&1 | grep -v "Skipping BTF" || true
tr "\\0" "\\n" < "$M/mtty.ko" | grep -q "^vermagic=$KREL " || { rm -f "$M/mtty.ko"; echo "module: wrong vermagic" >&2; exit 1; }
echo "module: built $M/mtty.ko for $KREL"
