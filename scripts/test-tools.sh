#!/usr/bin/env bash
# The real components some tests run: Debian's `prometheus` (prometheus and promtool) and
# `chromium` (headless). Installs what is missing when it can (root with apt-get, as on CI), with
# --no-install-recommends: about 700 MB on disk, under a minute here. Where it cannot, it says so
# and those tests skip with the reason (under CI=true they fail instead). Quiet when all is there.
set -uo pipefail

missing=()
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "test set-up: ${missing[*]} not installed, and installing needs root and apt-get; their tests skip" >&2
    exit 0
fi
echo "test set-up: apt-get install --no-install-recommends ${missing[*]}" >&2
log=$(mktemp)
install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1
}
if ! install && ! { apt-get update -qq >>"$log" 2>&1 && install; }; then
    echo "test set-up: installing ${missing[*]} failed; their tests skip (fail under CI=true). Last lines:" >&2
    tail -n 20 "$log" >&2
fi
rm -f "$log"
exit 0
