#!/bin/busybox sh
# PID 1 of the test guest: mount what the tests need, load the VFIO/mdev stack and the SmartIO
# stand-in (smartio: the contract's sysfs; smartio_mdev: mtty renamed, the mdev parent of its
# devices), run pytest against the real sysfs, print the result between markers on the serial
# console (the host's boot.sh reads them), power off.
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs shm /dev/shm
# /tmp stays the initramfs' own (writable): a tmpfs over it would hide a checkout under /tmp
mkdir -p /tmp && chmod 1777 /tmp
mount -t tmpfs tmpfs /run
# loopback, for the daemons tests start on 127.0.0.1 (etcd); the guest has no other network
ip link set lo up
# the SmartIO stand-in's control (smartio/ctl: what the rest of the fabric does)
mount -t debugfs debugfs /sys/kernel/debug
. /kernel-tier.env
say() { echo "kernel-tier: $*"; }
fail=0
for m in vfio vfio_iommu_type1 mdev smartio smartio_mdev; do
  args=
  [ $m = smartio ] && args=node_id=12   # gamma, where the default topology's VMs borrow
  # shellcheck disable=SC2086  # no arguments, or one word
  insmod /lib/modules/vmlend/$m.ko $args || { say "insmod $m failed"; fail=1; }
done
say "iommu groups: $(ls /sys/kernel/iommu_groups | wc -l); smartio node $(cat /sys/class/smartio/node_id 2>/dev/null)"
if [ $fail = 0 ]; then
  cd "$REPO"
  export PATH="$VENV/bin:$PATH" VMLEND_ROOT=/ VMLEND_KERNEL_GUEST=1 PYTHONDONTWRITEBYTECODE=1
  # which tier's tests tests/kernel/conftest.py keeps (main, or backports)
  export VMLEND_KERNEL_TIER="${KERNEL_TIER:-main}"
  # One of several guests side by side (boot.sh): run only this guest's share of the tests.
  for word in $(cat /proc/cmdline); do
    case $word in vmlend.shard=*) export VMLEND_TIER_SHARD="${word#vmlend.shard=}" ;; esac
  done
  [ -n "${VMLEND_TIER_SHARD:-}" ] && say "shard $VMLEND_TIER_SHARD"
  start=$(date +%s)
  # shellcheck disable=SC2086  # PYTEST_ARGS is plain words
  python -m pytest -p no:cacheprovider $PYTEST_ARGS > /tmp/pytest.out 2>&1
  rc=$?
  say "pytest took $(( $(date +%s) - start )) s"
  # A narrow selection (make test-kernel KERNEL_TESTS=one_file.py) can leave a guest's shard
  # empty: pytest's 5 is then no failure of this guest; run.sh fails if every shard was empty.
  if [ "$rc" = 5 ] && [ -n "${VMLEND_TIER_SHARD:-}" ]; then
    say "shard $VMLEND_TIER_SHARD ran no test"; rc=0
  fi
else
  echo "modules did not load" > /tmp/pytest.out; rc=3
fi
echo "=== VMLEND-KERNEL-TIER OUTPUT BEGIN ==="
cat /tmp/pytest.out
if [ "$rc" != 0 ]; then  # the private daemons' and QEMU's logs die with the guest: show them
  find /tmp -name '*.log' -path '*libvirtd*' 2>/dev/null | while read -r f; do
    echo "--- tail of $f"; tail -n 25 "$f"
  done
fi
echo "=== VMLEND-KERNEL-TIER OUTPUT END ==="
echo "=== VMLEND-KERNEL-TIER RC=$rc ==="
sync
poweroff -f
