#!/usr/bin/env bash
# Unpacks Debian's redis-server, and the two libraries it links that a bare machine lacks, into
# DIR without installing anything system-wide. The shared-quota test (host/cli/tests/suite/hardening.rs)
# runs it when no `redis-server` is on PATH, then starts DIR/usr/bin/redis-server with
# LD_LIBRARY_PATH=DIR/usr/lib/x86_64-linux-gnu.
set -euo pipefail
dir=${1:?usage: scripts/fetch-redis.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
pkgs=(redis-server redis-tools libjemalloc2 liblzf1)
if ! apt-get download "${pkgs[@]}" >/dev/null 2>&1; then
    # A fresh machine may have no package lists yet.
    apt-get update >/dev/null
    apt-get download "${pkgs[@]}" >/dev/null
fi
for f in *.deb; do
    dpkg-deb -x "$f" "$dir"
done
LD_LIBRARY_PATH="$dir/usr/lib/x86_64-linux-gnu" "$dir/usr/bin/redis-server" --version
