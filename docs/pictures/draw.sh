#!/bin/sh
# Redraws the pictures in docs/pictures from a fresh simulated cluster (make pictures): the
# default fabric with a VM on gamma holding two GPUs and an unlent VF, and the paths the docs
# discuss. Needs Graphviz's dot (apt: graphviz) and the venv's vmlend.
set -eu
out=$(cd "$(dirname "$0")" && pwd)
vmlend=${VMLEND:-vmlend}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export VMLEND_STATE="$work/state.db" VMLEND_ROOT="$work/root"
$vmlend fabric init >/dev/null
$vmlend xml new web --memory 512M --virt-type qemu --device 0x10 --device 0x20 -o "$work/web.xml" >/dev/null 2>&1
$vmlend vm define "$work/web.xml" -c sim:///gamma >/dev/null
$vmlend vm start web -c sim:///gamma >/dev/null
$vmlend unlend 0x25 >/dev/null
$vmlend fabric show --format dot | dot -Tsvg -o "$out/fabric.svg"
$vmlend fabric show --format mermaid >"$out/fabric.mmd"
$vmlend path 0x10 0x11 --format dot | dot -Tsvg -o "$out/path-local-p2p.svg"
$vmlend path 0x10 0x20 --via gamma --format dot | dot -Tsvg -o "$out/path-via-ram.svg"
$vmlend path 0x10 0x20 --via gamma --format mermaid >"$out/path-via-ram.mmd"
$vmlend vm destroy web -c sim:///gamma >/dev/null
