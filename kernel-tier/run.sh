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
rc=0
step "boot+tests" bash "$HERE/boot.sh" "$B" || rc=$?
echo "kernel-tier: total $(( SECONDS - t0 )) s, exit $rc"
exit $rc
