#!/bin/sh
# The backports tier's private apt: bookworm and bookworm-backports, its lists and cache under
# BUILD_DIR/apt, the tier's packages pinned to backports (everything else stays bookworm's).
# Nothing under /etc/apt changes and nothing is installed: fetch.sh only downloads and unpacks.
# Usage: apt.sh BUILD_DIR      (prints the APT_CONFIG file to export)
set -eu
B=${1:?build dir}
mkdir -p "$B/apt/lists/partial" "$B/apt/cache/archives/partial"
B=$(cd "$B" && pwd)
A=$B/apt
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
cat > "$A/sources.list" <<LIST
deb [signed-by=$KEYRING] http://deb.debian.org/debian bookworm main
deb [signed-by=$KEYRING] http://deb.debian.org/debian bookworm-backports main
LIST
# n= (the codename): the suite's name (a=) moved from bookworm-backports to oldstable-backports.
cat > "$A/preferences" <<PREF
Package: linux-* qemu-* libvirt* seabios
Pin: release n=bookworm-backports
Pin-Priority: 990
PREF
cat > "$A/apt.conf" <<CONF
Dir::Etc::SourceList "$A/sources.list";
Dir::Etc::SourceParts "/dev/null";
Dir::Etc::Preferences "$A/preferences";
Dir::Etc::PreferencesParts "/dev/null";
Dir::State::Lists "$A/lists";
Dir::Cache "$A/cache";
APT::Sandbox::User "root";
CONF
# The lists once a day: a second run the same day asks the network nothing.
if [ -z "$(find "$A/lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
  APT_CONFIG=$A/apt.conf apt-get update -qq >&2
fi
echo "$A/apt.conf"
