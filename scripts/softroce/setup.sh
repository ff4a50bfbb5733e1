#!/usr/bin/env bash
# Installs what the Soft-RoCE test VM needs (Debian 12, as root) and builds its initramfs.
# Idempotent; called by scripts/setup.sh.  Skip it there with RDMASOCK_SKIP_SOFTROCE=1.
#   qemu-system-x86 linux-image-amd64   the VM and the guest kernel (with rdma_rxe)
#   python3-pyverbs rdma-core libibverbs-dev ibverbs-utils perftest rdmacm-utils
#                                       verbs in Python, the rxe provider, headers for the C
#                                       post helper, tools (ibv_devinfo, ib_write_lat, ...)
#   busybox-static kmod cpio iproute2   initramfs and guest set-up (rdma, ip netns)
set -euo pipefail
cd "$(dirname "$0")"
PKGS="qemu-system-x86 linux-image-amd64 python3-pyverbs rdma-core libibverbs-dev ibverbs-utils perftest rdmacm-utils busybox-static iproute2 kmod cpio"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "softroce: installing$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
./build-initramfs.sh >/dev/null
echo "softroce: ready ($(./build-initramfs.sh))"
