#!/bin/sh
# A qemu hook that records how it was called, as libvirtd calls it: one line of argv per call
# appended to $HOOK_LOG, the domain XML from stdin kept as $HOOK_LOG.<n>.xml (n = call number).
# It exits 1 (with a message on stderr) when its operation equals $HOOK_FAIL_AT.
set -eu
echo "$*" >> "$HOOK_LOG"
n=$(wc -l < "$HOOK_LOG")
cat > "$HOOK_LOG.$n.xml"
if [ "$2" = "${HOOK_FAIL_AT:-}" ]; then
  echo "recording hook: refusing $2 of $1" >&2
  exit 1
fi
exit 0
