#!/usr/bin/env bash
# Build the guest kit (a kernel and our initramfs) into the kit cache, idempotently.
#
#   build-kit.sh [CACHE_DIR]      default: $LAYERSTORE_GUEST_KIT_DIR, else /var/cache/layerstore/guest-kit
#
# The kit lands in CACHE_DIR/<key>/ (vmlinuz, initrd, kit.json), where <key> is the first 16 hex
# digits of the sha256 of guest-kit.lock, init, lsguest.c and this script, concatenated in that
# order (runtime_shim/vm/kit.py computes the same key): a change to any of them builds a new kit;
# an unchanged repo finds its kit and does nothing. It is built in a temporary directory beside it
# and renamed into place, so a kit directory that exists is complete.
#
# Inputs: the kernel package pinned in guest-kit.lock (apt-get download from the machine's apt
# sources, checked against the pinned sha256; only the listed modules are kept), the host's static
# busybox (busybox-static), and lsguest.c compiled static with gcc.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
lock="$here/../guest-kit.lock"
cache="${1:-${LAYERSTORE_GUEST_KIT_DIR:-/var/cache/layerstore/guest-kit}}"
key=$(cat "$lock" "$here/init" "$here/lsguest.c" "$here/build-kit.sh" | sha256sum | cut -c1-16)
kit="$cache/$key"
if [ -f "$kit/kit.json" ]; then
    exit 0
fi

get() { sed -n "s/^$1=//p" "$lock"; }
package=$(get package); version=$(get version); sha256=$(get sha256); release=$(get release); modules=$(get modules)
busybox=$(command -v busybox || true)
if [ -z "$busybox" ] || ! dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed"; then
    echo "guest-kit: needs busybox-static (.ci/install-deps.sh)" >&2; exit 1
fi
if [ ! -e /usr/lib/x86_64-linux-gnu/libc.a ] && [ "$(id -u)" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libc6-dev >/dev/null
fi

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.build-$key-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"

echo "guest-kit: building $key ($package $version)"
if ! apt-cache show "$package=$version" >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq  # (package lists missing or stale: the pin names a version they lack)
fi
if ! apt-get -q -o APT::Sandbox::User=root download "$package=$version" >/dev/null; then
    echo "guest-kit: $package=$version is not in this machine's apt sources; pin another in $lock" >&2
    exit 1
fi
deb=$(ls ./*.deb)
echo "$sha256  $deb" | sha256sum -c --quiet -

root="$tmp/root"
mkdir -p "$root"/{bin,dev,proc,sys,run,tmp,newroot,layers,upperfs,mnt} "$root/lib/modules/$release"
dpkg-deb --fsys-tarfile "$deb" > pkg.tar
tar -tf pkg.tar > all
{
    grep -x "./boot/vmlinuz-$release" all || true
    for m in $modules; do grep -e "^./lib/modules/$release/kernel/.*/$m\.ko\$" all || true; done
} > wanted
want=$(wc -l < wanted)
have=$(( $(echo "$modules" | wc -w) + 1 ))
if [ "$want" -ne "$have" ]; then
    echo "guest-kit: found $want of $have files (kernel + modules) in $package" >&2; exit 1
fi
tar -xf pkg.tar -T wanted
rm -f pkg.tar all "$deb"
cp "boot/vmlinuz-$release" vmlinuz
cp -r "lib/modules/$release/kernel" "$root/lib/modules/$release/"
"$busybox" depmod -b "$root" "$release"

cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
done
gcc -static -Os -Wall -o "$root/bin/lsguest" "$here/lsguest.c"
strip "$root/bin/lsguest" 2>/dev/null || true
install -m 0755 "$here/init" "$root/init"
(cd "$root" && find . | LC_ALL=C sort | "$busybox" cpio -o -H newc 2>/dev/null) > initrd

bbver=$(dpkg-query -W -f='${Version}' busybox-static)
cat > kit.json <<JSON
{"key": "$key", "package": "$package", "version": "$version", "release": "$release", "busybox": "$bbver",
 "modules": "$modules"}
JSON
mkdir "$tmp/kit"
mv vmlinuz initrd kit.json "$tmp/kit/"
chmod 0755 "$tmp/kit"
chmod 0644 "$tmp/kit"/*
mv -T "$tmp/kit" "$kit" 2>/dev/null || [ -f "$kit/kit.json" ]  # (a concurrent build won)
echo "guest-kit: $kit"
