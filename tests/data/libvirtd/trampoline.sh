#!/bin/bash
# Installed as hooks/qemu of the private test libvirtd. libvirtd only enables hooks that exist
# when it starts, so this fixed script forwards each call to whatever command the tests name
# now: hooks/qemu.target holds that command's argv (one word per line) and hooks/qemu.env
# holds NAME=VALUE lines to export (libvirtd passes hooks only LC_ALL, PATH and HOME).
# argv, stdin and the exit code pass through unchanged (exec).
dir=${0%/*}
if [[ ! -s $dir/qemu.target ]]; then
    cat >/dev/null  # no hook configured: read the XML libvirt writes, succeed
    exit 0
fi
if [[ -f $dir/qemu.env ]]; then
    while IFS= read -r line; do
        [[ -n $line ]] && export "$line"
    done <"$dir/qemu.env"
fi
mapfile -t cmd <"$dir/qemu.target"
exec "${cmd[@]}" "$@"
