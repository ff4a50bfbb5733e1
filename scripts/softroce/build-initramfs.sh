#!/usr/bin/env bash
# Builds (once) the Soft-RoCE guest's initramfs and prints its path.
#   scripts/softroce/build-initramfs.sh [--force]
# Contents: static busybox, this directory's `init`, and the virtio-pci / 9p modules of the
# newest kernel under /lib/modules (override with SOFTROCE_KERNEL=VERSION).  The file is cached
# in .cache/softroce/ under a name that includes the kernel version and a hash of `init`, so
# editing `init` or installing another kernel rebuilds it; everything else reuses the cache.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
KVER=${SOFTROCE_KERNEL:-$(ls /lib/modules 2>/dev/null | sort -V | tail -n 1)}
[ -n "$KVER" ] || { echo "build-initramfs: no kernel modules under /lib/modules (run scripts/softroce/setup.sh)" >&2; exit 2; }
if [ ! -x /bin/busybox ] || [[ "$(ldd /bin/busybox 2>&1 || true)" != *"not a dynamic"* ]]; then
  echo "build-initramfs: /bin/busybox must be the static one (apt-get install busybox-static)" >&2; exit 2
fi
CACHE="$REPO/.cache/softroce"
mkdir -p "$CACHE"
[ -f "$REPO/.cache/.gitignore" ] || echo '*' > "$REPO/.cache/.gitignore"
KEY=$(cat "$HERE/init" /bin/busybox | sha256sum | cut -c1-12)
OUT="$CACHE/initramfs-$KVER-$KEY.cpio.gz"
if [ -s "$OUT" ] && [ "${1:-}" != "--force" ]; then echo "$OUT"; exit 0; fi

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,sbin,proc,sys,dev,newroot,lib/rs-modules}
cp /bin/busybox "$STAGE/bin/busybox"
cp "$HERE/init" "$STAGE/init"
chmod 755 "$STAGE/init"
# modprobe --show-depends lists "insmod FILE" in load order (dependencies first).
for mod in virtio_pci 9pnet_virtio 9p; do
  modprobe -S "$KVER" --show-depends "$mod"
done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' > "$STAGE/files"
while read -r f; do
  cp "$f" "$STAGE/lib/rs-modules/"
  basename "$f"
done < "$STAGE/files" > "$STAGE/lib/rs-modules/load-order"
rm "$STAGE/files"
(cd "$STAGE" && find . -print | cpio -o -H newc --quiet | gzip -1) > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
# older builds for the same kernel are stale
find "$CACHE" -maxdepth 1 -name "initramfs-$KVER-*.cpio.gz" ! -name "$(basename "$OUT")" -delete
echo "$OUT"
