"""A libvirt qemu hook for tests: records each call, optionally fails one operation.

Environment (set through the trampoline's qemu.env):
  RECORD_HOOK_LOG      JSON-lines file to append one record per call to (required)
  RECORD_HOOK_FAIL     "OPERATION" or "OPERATION/SUB-OPERATION" to fail with exit 1
  RECORD_HOOK_MESSAGE  the stderr line printed when failing
  RECORD_HOOK_SNAPSHOT a file whose text each record keeps as it is when the call comes
Each record: {"argv": [object, operation, sub-operation, extra], "name": ..., "uuid": ...,
"mdevs": [...], "snapshot": ...} with the name, UUID and mdev hostdev UUIDs read from the
domain XML libvirt writes to stdin (null if the XML is unreadable), and the snapshot file's
text (no key without one; null when it does not exist). libvirtd runs this main hook before the
scripts in qemu.d, so a snapshot shows what those did up to the call before.
"""

from __future__ import annotations

import json
import os
import sys

from lxml import etree


def _describe(xml: bytes) -> dict[str, object]:
    try:
        root = etree.fromstring(xml)
    except etree.XMLSyntaxError:
        return {"name": None, "uuid": None, "mdevs": None}
    mdevs = root.xpath("devices/hostdev[@type='mdev']/source/address/@uuid")
    return {"name": root.findtext("name"), "uuid": root.findtext("uuid"), "mdevs": mdevs}


def _should_fail(argv: list[str], spec: str) -> bool:
    if not spec or len(argv) < 3:
        return False
    operation, _, sub_operation = spec.partition("/")
    return argv[1] == operation and (not sub_operation or argv[2] == sub_operation)


def _snapshot(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def main() -> int:
    argv = sys.argv[1:]
    record = {"argv": argv, **_describe(sys.stdin.buffer.read())}
    snapshot = os.environ.get("RECORD_HOOK_SNAPSHOT")
    if snapshot:  # only where a test asked for one
        record["snapshot"] = _snapshot(snapshot)
    # One write of one line in append mode: concurrent hook runs cannot interleave records.
    with open(os.environ["RECORD_HOOK_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")
    if _should_fail(argv, os.environ.get("RECORD_HOOK_FAIL", "")):
        message = os.environ.get("RECORD_HOOK_MESSAGE", "record_hook: told to fail")
        sys.stderr.write(message + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
