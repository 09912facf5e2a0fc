#!/bin/bash
# Build the guest's initramfs in two archives the kernel unpacks one after the other:
#   base.cpio  busybox, the five modules, Python 3.11 with the project's venv (pre-compiled),
#              QEMU, libvirtd, virsh and etcd, the shared libraries they load, an ld.so.cache:
#              rebuilt only when an input changes;
#   src.cpio   the worktree's vmlend/ tests/ ... (bytecode compiled on the host) and /init:
#              rebuilt every run (a second or two).
# Usage: initramfs.sh BUILD_DIR PYTEST_ARGS...     (writes BUILD_DIR/initramfs.cpio)
# KERNEL_TIER_SYSROOT: take QEMU and libvirt (and the libraries they load) from this unpacked
# tree instead of the host's /usr: the backports tier's BUILD_DIR/root (QEMU 10, libvirt 11.3).
# KERNEL_TIER_NAME: the tier the guest's tests/kernel/conftest.py selects (main, backports).
set -euo pipefail
B=$(cd "${1:?build dir}" && pwd); shift
. "$B/env"
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
VENV=$REPO/.venv
PYHOME=$(cd "$(dirname "$(readlink -f "$VENV/bin/python3")")/.." && pwd)   # the venv's base Python
PYVER=$(readlink -f "$VENV/bin/python3" | sed 's|.*/python||')
BB=$B/root/bin/busybox
MODDIR=$B/root/lib/modules/$KREL/kernel/drivers/vfio
MODULES="$MODDIR/vfio.ko $MODDIR/vfio_iommu_type1.ko $MODDIR/mdev/mdev.ko $B/module/smartio.ko $B/module/smartio_mdev.ko"
SYSROOT=${KERNEL_TIER_SYSROOT:-}
TIER=${KERNEL_TIER_NAME:-main}
# Where the loader finds the sysroot's libraries first (ldd below, and the guest's ld.so.cache).
SYSLIBS=${SYSROOT:+$SYSROOT/usr/lib/x86_64-linux-gnu:$SYSROOT/lib/x86_64-linux-gnu}

# --- shared libraries: every ELF under the staging tree, with what ldd says it needs ----------
copy_libs() {  # STAGE: copy the libraries of every ELF object found under STAGE
  local stage=$1
  find "$stage" -type f \( -name '*.so*' -o -perm -u+x \) -print0 |
    xargs -0 file -N --mime-type 2>/dev/null | sed -n 's#^\(.*\): application/x-\(pie-\)*\(executable\|sharedlib\)$#\1#p' |
    while read -r elf; do LD_LIBRARY_PATH=$SYSLIBS ldd "$elf" 2>/dev/null || true; done |
    sed -n 's|.*=> \(/[^ ]*\) .*|\1|p; s|^[[:space:]]*\(/[^ ]*ld-linux[^ ]*\) .*|\1|p' | sort -u |
    while read -r lib; do
      dest=${SYSROOT:+${lib#"$SYSROOT"}}   # a sysroot's library goes where it belongs
      dest=${dest:-$lib}
      mkdir -p "$stage$(dirname "$dest")"
      cp -L -n "$lib" "$stage$dest"
    done
}

# --- base ----------------------------------------------------------------------------------
BASE_INPUTS=$(cat "$0" "$B/env" "$VENV/pyvenv.cfg" "$B/module/smartio.ko" "$B/module/smartio_mdev.ko" <(ls -l --time-style=+%s "$VENV/lib/python$PYVER/site-packages") | sha256sum | cut -c1-16)
if [ ! -f "$B/base.cpio" ] || [ "$(cat "$B/base.stamp" 2>/dev/null)" != "$BASE_INPUTS" ]; then
  S=$B/stage-base
  rm -rf "$S" && mkdir -p "$S"/{bin,sbin,proc,sys,dev,tmp,run,etc,root,var/lib,lib/modules/vmlend}
  cp "$BB" "$S/bin/busybox"
  for m in $MODULES; do   # 6.12's modules are xz-compressed; busybox's insmod takes them plain
    if [ -f "$m" ]; then cp "$m" "$S/lib/modules/vmlend/"
    else xz -dc "$m.xz" > "$S/lib/modules/vmlend/$(basename "$m")"; fi
  done
  # The base interpreter where the venv expects it, without its own site-packages or tests.
  mkdir -p "$S$PYHOME/bin" "$S$PYHOME/lib"
  cp -a "$PYHOME/bin/python$PYVER" "$PYHOME/bin/python3" "$S$PYHOME/bin/"
  cp -a "$PYHOME"/lib/libpython"$PYVER"*.so* "$S$PYHOME/lib/" 2>/dev/null || true
  tar -C "$PYHOME/lib" --exclude=site-packages --exclude=test --exclude=idlelib \
      --exclude=tkinter --exclude=turtledemo --exclude=ensurepip --exclude=lib2to3 \
      --exclude='config-*' -cf - "python$PYVER" | tar -C "$S$PYHOME/lib" -xf -
  # The venv at its own path (its editable install points at $REPO), minus the lint tools.
  mkdir -p "$S$VENV"
  tar -C "$VENV" --exclude='mypy*' --exclude='*__mypyc*' --exclude=pip --exclude='pip-*' \
      --exclude='ruff*' -cf - . | tar -C "$S$VENV" -xf -
  # QEMU, to open an mdev through VFIO inside the guest: the binary, its TCG accelerator
  # module and its firmware (SeaBIOS).
  mkdir -p "$S/usr/bin" "$S/usr/share" "$S/usr/lib/x86_64-linux-gnu/qemu"
  cp "$SYSROOT/usr/bin/qemu-system-x86_64" "$S/usr/bin/"
  # (QEMU 10 builds TCG in: no module)
  if [ -f "$SYSROOT/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so" ]; then
    cp "$SYSROOT/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so" "$S/usr/lib/x86_64-linux-gnu/qemu/"
  fi
  cp -a "$SYSROOT/usr/share/qemu" "$SYSROOT/usr/share/seabios" "$S/usr/share/"
  # libvirt's daemons and drivers, for the private libvirtd of tests/support/libvirt_daemon.py.
  mkdir -p "$S/usr/sbin" "$S/usr/lib/x86_64-linux-gnu"
  cp "$SYSROOT/usr/sbin/libvirtd" "$SYSROOT/usr/sbin/virtlogd" "$S/usr/sbin/"
  # virsh, which tests run as an operator would (the library itself never shells out to it).
  cp "$SYSROOT/usr/bin/virsh" "$S/usr/bin/"
  # etcd (Debian's etcd-server, make sysdeps), for tests/support/etcd_daemon.py's private
  # cluster registry on loopback.
  cp /usr/bin/etcd "$S/usr/bin/"
  cp -a "$SYSROOT/usr/lib/x86_64-linux-gnu/libvirt" "$S/usr/lib/x86_64-linux-gnu/"
  cp -a "$SYSROOT/usr/lib/libvirt" "$S/usr/lib/"
  cp -a "$SYSROOT/usr/share/libvirt" "$S/usr/share/"
  # libvirt 11's network driver refuses to initialise without a firewall backend (nft or
  # iptables: "could not find a usable firewall backend"), and libvirtd then exits; the
  # guests need no libvirt network, so the backports tier leaves that driver (and nwfilter) out.
  if [ -n "$SYSROOT" ]; then
    rm -f "$S"/usr/lib/x86_64-linux-gnu/libvirt/connection-driver/libvirt_driver_{network,nwfilter}.so
  fi
  cp /bin/bash "$S/bin/bash"   # the test hook trampoline is a bash script
  # pyudev finds libudev with ctypes.util.find_library, which asks ldconfig's cache.
  mkdir -p "$S/usr/lib/x86_64-linux-gnu"
  cp -L /lib/x86_64-linux-gnu/libudev.so.1 "$S/usr/lib/x86_64-linux-gnu/"
  cp /sbin/ldconfig "$S/sbin/"
  copy_libs "$S"
  printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n%s/lib\n' "$PYHOME" > "$S/etc/ld.so.conf"
  ldconfig -r "$S"
  # root, and the users libvirt's qemu driver looks up at start (its compiled-in defaults).
  { echo 'root:x:0:0:root:/root:/bin/sh'; grep -E '^libvirt-qemu:' /etc/passwd || true; } > "$S/etc/passwd"
  { echo 'root:x:0:'; grep -E '^(kvm|libvirt|libvirt-qemu):' /etc/group || true; } > "$S/etc/group"
  (cd "$S" && find . -mindepth 1 | LC_ALL=C sort | "$BB" cpio -o -H newc 2>/dev/null) > "$B/base.cpio"
  echo "$BASE_INPUTS" > "$B/base.stamp"
  echo "initramfs: base $(du -h "$B/base.cpio" | cut -f1)"
else
  echo "initramfs: base cached"
fi

# --- src -----------------------------------------------------------------------------------
S=$B/stage-src
rm -rf "$S" && mkdir -p "$S$REPO"
(cd "$REPO" && git ls-files -co --exclude-standard vmlend tests hooks xml-templates docs \
   pyproject.toml setup.cfg | tar -cf - -T - | tar -C "$S$REPO" -xf -)
"$VENV/bin/python" -m compileall -q --invalidation-mode unchecked-hash "$S$REPO/vmlend" "$S$REPO/tests" >/dev/null
cp "$HERE/init.sh" "$S/init" && chmod +x "$S/init"
# Plain words only: busybox sh splits PYTEST_ARGS on spaces.
printf 'REPO=%s\nVENV=%s\nKERNEL_TIER=%s\nPYTEST_ARGS="%s"\n' "$REPO" "$VENV" "$TIER" "$*" > "$S/kernel-tier.env"
(cd "$S" && find . -mindepth 1 | LC_ALL=C sort | "$BB" cpio -o -H newc 2>/dev/null) > "$B/src.cpio"
cat "$B/base.cpio" "$B/src.cpio" > "$B/initramfs.cpio"
echo "initramfs: $(du -h "$B/initramfs.cpio" | cut -f1)"
