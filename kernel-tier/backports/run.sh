#!/bin/bash
# make test-kernel-backports: the kernel tier's second configuration, built from Debian's
# bookworm-backports: Linux 6.12 (its mtty sample implements VFIO migration), QEMU 10 and
# libvirt 11.3, fetched through a private apt (apt.sh) and unpacked under BUILD_DIR, never
# installed on the host. The same steps as the main tier (fetch, module, initramfs, boot), each
# timed; one guest runs the tests marked 'backports' (tests/kernel/conftest.py).
# Usage: run.sh BUILD_DIR PYTEST_ARGS...
set -euo pipefail
B=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
K=$(cd "$HERE/.." && pwd)
mkdir -p "$B" && B=$(cd "$B" && pwd)
step() {
  local name=$1; shift
  local t0=$SECONDS r=0
  "$@" || r=$?
  echo "kernel-tier-backports: $name took $(( SECONDS - t0 )) s"
  return $r
}
t0=$SECONDS
APT_CONFIG=$(sh "$HERE/apt.sh" "$B")   # its lists: a download once a day
echo "kernel-tier-backports: apt took $(( SECONDS - t0 )) s"
export APT_CONFIG KERNEL_TIER_SERIES=6.12 KERNEL_TIER_NAME=backports
export KERNEL_TIER_USERLAND="qemu-system-x86 libvirt-daemon-driver-qemu libvirt-clients"
export KERNEL_TIER_PATCH=$HERE/smartio_mdev-6.12.patch KERNEL_TIER_SYSROOT=$B/root
step fetch sh "$K/fetch.sh" "$B"
step module sh "$K/build-module.sh" "$B"
step initramfs bash "$K/initramfs.sh" "$B" "$@"
rc=0
step "boot+tests" bash "$K/boot.sh" "$B" || rc=$?
echo "kernel-tier-backports: total $(( SECONDS - t0 )) s, exit $rc"
exit $rc
