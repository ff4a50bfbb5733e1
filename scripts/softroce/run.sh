#!/usr/bin/env bash
# Runs one command inside a throw-away QEMU guest with Soft-RoCE (rdma_rxe) and returns its exit
# status.  Requires scripts/softroce/setup.sh (packages; the initramfs is built on demand).
#
#   scripts/softroce/run.sh [options] [--] CMD [ARG...]
#
#   --topology lo         (default) rdma_rxe loaded, device rxe0 on the guest's loopback
#                         (RoCE v2 GID index 1 = ::ffff:127.0.0.1)
#   --topology two-hosts  two network namespaces joined by a veth pair, one rxe device each
#                         (guest/two-hosts.sh: addresses and names are listed there)
#   --topology lo,two-hosts  both (wrappers chain: each sets up its part, then runs the next)
#   --topology none       nothing set up; CMD runs as booted
#   -e NAME=VALUE         environment variable for CMD (repeatable)
#   --env-file FILE       NAME=VALUE lines (no quoting; '#' comments) for CMD
#   --timeout SECONDS     limit for CMD inside the guest (default $SOFTROCE_TIMEOUT or 900);
#                         the VM as a whole is killed SECONDS+180 s after it starts
#                         ($SOFTROCE_BOOT_MARGIN overrides the 180)
#   --mem MB, --smp N     guest size (default 2048 MB, 2 vCPUs)
#   --keep                keep the job directory (.cache/softroce/jobs/...) for inspection
#   --quiet               print only CMD's output (no boot/exit markers, no kernel messages)
#
# The guest sees the host's / read-only and this repository read-write at the same path; /tmp,
# /run and /dev/shm are private tmpfs.  CMD runs as root in the caller's working directory
# (the repository root if the caller is outside it).  The host's environment does NOT reach
# the guest: only -e / --env-file settings and the host's RDMASOCK_* variables are passed (in a
# file inside the job directory).
#
# Exit status: CMD's; 124 if CMD hit --timeout; 125 if the guest did not finish (hard timeout,
# kernel panic, mount failure); 3 if QEMU or the kernel is not installed.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TOPOLOGY=lo TIMEOUT=${SOFTROCE_TIMEOUT:-900} MEM=${SOFTROCE_MEM:-2048} SMP=${SOFTROCE_SMP:-2}
KEEP=0 QUIET=0
ENVS=()
die() { echo "softroce: $*" >&2; exit "${2:-2}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --topology) TOPOLOGY=$2; shift 2 ;;
    -e) [[ "$2" == [A-Za-z_]*=* ]] || die "bad -e '$2' (want NAME=VALUE)"; ENVS+=("$2"); shift 2 ;;
    --env-file)
      [ -r "$2" ] || die "cannot read $2"
      while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in ''|'#'*) continue ;; [A-Za-z_]*=*) ENVS+=("$line") ;; *) die "bad line in $2: $line" ;; esac
      done < "$2"
      shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --smp) SMP=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --quiet) QUIET=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || die "no command given (see --help)"
WRAP=()
IFS=, read -ra TOPOS <<< "$TOPOLOGY"
for t in "${TOPOS[@]}"; do
  case "$t" in
    lo) WRAP+=("$HERE/guest/rxe-lo.sh") ;;
    two-hosts) WRAP+=("$HERE/guest/two-hosts.sh") ;;
    none) ;;
    *) die "unknown topology '$t' (lo, two-hosts, none, or a comma-separated list)" ;;
  esac
done

QEMU=$(command -v qemu-system-x86_64) || die "qemu-system-x86_64 is not installed: run scripts/softroce/setup.sh (or scripts/setup.sh)" 3
KVER=${SOFTROCE_KERNEL:-$(ls /lib/modules 2>/dev/null | sort -V | tail -n 1)}
KERNEL=/boot/vmlinuz-$KVER
[ -n "$KVER" ] && [ -r "$KERNEL" ] || die "no kernel image /boot/vmlinuz-* with modules: run scripts/softroce/setup.sh (package linux-image-amd64)" 3
INITRD=$("$HERE/build-initramfs.sh") || die "cannot build the initramfs" 3
[[ "$REPO" != *[[:space:]]* ]] || die "the repository path must not contain spaces: $REPO"

# The job directory lives inside the repository, which the guest mounts read-write.
mkdir -p "$REPO/.cache/softroce/jobs"
JOB=$(mktemp -d "$REPO/.cache/softroce/jobs/job.XXXXXX") || die "cannot create a job directory"
cleanup() {
  local pid; pid=$(cat "$JOB/qemu.pid" 2>/dev/null)
  [ -n "$pid" ] && [ ! -f "$JOB/qemu.rc" ] && kill "$pid" 2>/dev/null
  [ "$KEEP" = 1 ] || rm -rf "$JOB"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
q() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }   # POSIX sh single quoting
case "$PWD/" in "$REPO"/*) CWD=$PWD ;; *) CWD=$REPO ;; esac
{
  echo "# written by scripts/softroce/run.sh; run by the guest's init with /bin/sh"
  while IFS= read -r name; do
    printf 'export %s=%s\n' "$name" "$(q "${!name}")"
  done < <(compgen -e | grep '^RDMASOCK_' || true)
  for kv in "${ENVS[@]+"${ENVS[@]}"}"; do printf 'export %s=%s\n' "${kv%%=*}" "$(q "${kv#*=}")"; done
  printf 'export SOFTROCE_GUEST=1 SOFTROCE_JOB=%s\n' "$(q "$JOB")"
  printf 'cd %s || exit 126\n' "$(q "$CWD")"
  printf 'exec timeout -k 10 %s' "$TIMEOUT"
  for a in "${WRAP[@]+"${WRAP[@]}"}" "$@"; do printf ' %s' "$(q "$a")"; done
  echo
} > "$JOB/job.sh"

HARD=$((TIMEOUT + ${SOFTROCE_BOOT_MARGIN:-180}))
FILTER='/^SeaBIOS /d; /^Booting from ROM/d'
[ "$QUIET" = 1 ] && FILTER="$FILTER; /^rs-guest: /d; /^\[ *[0-9.]*\] /d"
T0=$(date +%s%N)
# QEMU's stdout is the guest's serial console: CMD's output plus "rs-guest:" markers.  It is
# kept in the job directory and shown live without the firmware's escape sequences.
(
  timeout -k 5 "$HARD" "$QEMU" -accel "${SOFTROCE_ACCEL:-tcg,thread=multi}" -cpu max -m "$MEM" -smp "$SMP" \
    -nographic -no-reboot -nic none -kernel "$KERNEL" -initrd "$INITRD" \
    -append "console=ttyS0 loglevel=3 edd=off panic=-1 rs.work=$REPO rs.job=$JOB" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$REPO,mount_tag=work,security_model=none,multidevs=remap" < /dev/null 2>&1 &
  echo $! > "$JOB/qemu.pid"
  wait $!
  echo $? > "$JOB/qemu.rc"
) | tee "$JOB/console" | sed -u -e 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g; s/\r//g' -e "$FILTER" &
wait $!
QRC=$(cat "$JOB/qemu.rc" 2>/dev/null)
WALL_MS=$(( ($(date +%s%N) - T0) / 1000000 ))
if [ ! -f "$JOB/rc" ]; then
  if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then why="killed after the hard timeout of $HARD s"; else why="qemu exit status $QRC"; fi
  echo "softroce: the guest did not finish ($why); console log: $JOB/console" >&2
  KEEP=1
  exit 125
fi
RC=$(cat "$JOB/rc")
printf 'softroce: rc=%s, guest ready at %ss, command done at %ss (guest uptime), %d.%03d s wall\n' \
  "$RC" "$(cat "$JOB/ready-uptime" 2>/dev/null)" "$(cat "$JOB/uptime" 2>/dev/null)" $((WALL_MS / 1000)) $((WALL_MS % 1000)) >&2
exit "$RC"
