#!/bin/sh
# Install the Debian packages listed in os-packages.txt that the base image lacks.
# A no-op on the debootstrap base (it has them all, and needs no network); on an official
# Debian image it runs apt-get once and leaves no package lists or archives behind.
set -eu
list=${1:?usage: os-packages.sh os-packages.txt}
missing=""
for pkg in $(grep -v '^#' "$list"); do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $pkg"
done
[ -z "$missing" ] && exit 0
echo "os-packages: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update
# shellcheck disable=SC2086 # word splitting of the package list is intended
apt-get install -y --no-install-recommends $missing
apt-get clean
rm -rf /var/lib/apt/lists/*
