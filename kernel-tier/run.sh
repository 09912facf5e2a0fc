#!/bin/bash
# make test-kernel: fetch, build the module, pack the initramfs, boot and test, each timed.
# Usage: run.sh BUILD_DIR PYTEST_ARGS...
set -euo pipefail
B=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
step() {
  local name=$1; shift
  local t0=$SECONDS r=0
  "$@" || r=$?
  echo "kernel-tier: $name took $(( SECONDS - t0 )) s"
  return $r
}
t0=$SECONDS
step fetch sh "$HERE/fetch.sh" "$B"
step module sh "$HERE/build-module.sh" "$B"
step initramfs bash "$HERE/initramfs.sh" "$B" "$@"
# The guests run under TCG and are bound by the host's CPU: one per core (at most 2, the
# tier's tests split well in two), each running its share of the tests
# (tests/support/tier_shards.py). KERNEL_TIER_GUESTS=1 boots one guest running all of them.
guests() {
  local n=${KERNEL_TIER_GUESTS:-$(( $(nproc) < 2 ? 1 : 2 ))} k pids=() r=0 status
  case $n in
    '' | *[!0-9]* | 0) echo "kernel-tier: KERNEL_TIER_GUESTS must be 1 or more, not '$n'" >&2; return 2 ;;
  esac
  if [ "$n" = 1 ]; then bash "$HERE/boot.sh" "$B"; return; fi
  for k in $(seq 1 "$n"); do
    bash "$HERE/boot.sh" "$B" "$k/$n" > "$B/boot-$k.log" 2>&1 & pids+=($!)
  done
  for k in $(seq 1 "$n"); do
    status=0; wait "${pids[$((k - 1))]}" || status=$?
    echo "=== guest $k of $n: exit $status"
    cat "$B/boot-$k.log"
    [ "$r" != 0 ] || r=$status
  done
  # every shard empty: the selection matched no test, as one guest's pytest would say (5).
  # (No pipe into grep -q here: under pipefail its early exit fails the pipe.)
  local ran=0
  for k in $(seq 1 "$n"); do grep -q "ran no test" "$B/boot-$k.log" || ran=1; done
  if [ "$r" = 0 ] && [ "$ran" = 0 ]; then
    echo "kernel-tier: no guest ran a test (the selection matched none)"; r=5
  fi
  return $r
}
rc=0
step "boot+tests" guests || rc=$?
echo "kernel-tier: total $(( SECONDS - t0 )) s, exit $rc"
exit $rc
