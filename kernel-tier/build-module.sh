#!/bin/sh
# Build the two modules that stand in for the SmartIO driver, out of tree against the
# linux-headers of the SAME Debian version as the image:
#   smartio.ko       kernel-tier/smartio_stub.c: class/smartio, the contract's attributes
#   smartio_mdev.ko  the kernel's mtty sample (samples/vfio-mdev/mtty.c from linux-source-6.1)
#                    with kernel-tier/smartio_mdev.patch: the mdev parent of the stub's devices
# Usage: build-module.sh BUILD_DIR      (after fetch.sh; writes BUILD_DIR/module/*.ko)
# KERNEL_TIER_PATCH: the patch for the series' mtty.c (the backports tier's 6.12 variant,
# kernel-tier/backports/smartio_mdev-6.12.patch, keeps mtty's VFIO migration code).
set -eu
B=$(cd "${1:?build dir}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$B/env"
SERIES=${SERIES:-6.1}   # an env fetched before the series was recorded is 6.1's
PATCH=${KERNEL_TIER_PATCH:-$HERE/smartio_mdev.patch}
H="$B/root/usr/src/linux-headers-$KREL"
M="$B/module"
SOURCES="$HERE/smartio_stub.c $HERE/smartio_stub.h $PATCH"
# Rebuilt when the sources or the fetched tree change (the stamp names the sources' hash).
STAMP=$(cat $SOURCES | sha256sum | cut -c1-16)
if [ -f "$M/smartio.ko" ] && [ -f "$M/smartio_mdev.ko" ] && [ "$M/smartio.ko" -nt "$B/.fetched" ] &&
   [ "$(cat "$M/stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "module: cached ($M/smartio.ko, $M/smartio_mdev.ko)"; exit 0
fi
# The headers' Makefile includes the -common tree by its installed absolute path: point it at
# the unpacked copy (everything else in the tree is linked relatively).
sed -i "s|^include /usr/src/|include $B/root/usr/src/|" "$H/Makefile"
rm -rf "$M" && mkdir -p "$M"
cp "$HERE/smartio_stub.c" "$HERE/smartio_stub.h" "$M/"
cp "$B"/linux-source-"$SERIES"/samples/vfio-mdev/mtty.c "$M/smartio_mdev.c"
# A patch, not a sed: it fails loudly where the sample changed instead of matching nothing.
patch -s --no-backup-if-mismatch "$M/smartio_mdev.c" "$PATCH"
printf 'obj-m := smartio.o smartio_mdev.o\nsmartio-y := smartio_stub.o\n' > "$M/Kbuild"
# Warnings are errors: the stub and the patch must build clean against these headers.
# No BTF for these modules: 6.12 would run pahole, which the host need not have (6.1 skipped it).
make -s -C "$H" M="$M" KCFLAGS=-Werror CONFIG_DEBUG_INFO_BTF_MODULES= -j2 modules 2>&1 | grep -v "Skipping BTF" || true
for ko in smartio smartio_mdev; do
  [ -f "$M/$ko.ko" ] || { echo "module: $ko.ko was not built" >&2; exit 1; }
  tr "\\0" "\\n" < "$M/$ko.ko" | grep -q "^vermagic=$KREL " ||
    { rm -f "$M/$ko.ko"; echo "module: $ko.ko has the wrong vermagic" >&2; exit 1; }
done
echo "$STAMP" > "$M/stamp"
echo "module: built $M/smartio.ko and $M/smartio_mdev.ko for $KREL"
