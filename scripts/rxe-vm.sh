#!/usr/bin/env bash
# rxe-vm.sh — run one command in a throw-away QEMU guest with a Soft-RoCE (rdma_rxe) device.
#
# Copied unchanged (below this header) from the project's shared tooling, tools/run-in-rxe-vm.sh
# next to the repository (see tools/RXE-VM.md there for timings and gotchas), so that a clean
# clone — as CI has — can test the verbs transport on real verbs. Keep the two in step.
#
# run-in-rxe-vm.sh — run a command inside a throw-away QEMU guest that has a
# real (software) RDMA device: SoftRoCE / rdma_rxe on a stock Debian kernel.
#
# Why: the host kernel may lack CONFIG_INFINIBAND, so libibverbs cannot open any
# device there.  The guest runs Debian's own linux-image (which ships rdma_rxe,
# ib_core, ib_uverbs, rdma_ucm as modules) and sees the HOST's filesystem, so
# host-built binaries and host-installed libraries (libibverbs, the rxe
# provider, perftest, your cargo test binaries...) run in the guest unchanged.
#
# Everything comes from Debian packages.  Installed on the host if missing:
# qemu-system-x86, kmod, cpio, xz-utils, iproute2 (the `rdma` tool),
# libibverbs1 + ibverbs-providers (+ ibverbs-utils).  Only downloaded
# (`apt-get download` + `dpkg -x` into the cache, never installed):
# linux-image-<ver>-amd64 and busybox-static.
#
# Usage:
#   run-in-rxe-vm.sh [options] [--] COMMAND [ARGS...]
# Options:
#   -s, --share DIR   expose host folder DIR read-WRITE in the guest, at the same
#                     path (repeatable).  Writes land on the host immediately.
#   -t, --timeout S   kill the guest after S seconds (default 900); exit 124.
#   -m, --mem MB      guest memory (default 2048)
#   -c, --cpus N      guest vCPUs (default 2)
#   -n, --netdev D    netdev under rxe0: "dummy" (default: dummy0 holding
#                     192.0.2.1/24, a documentation range) or "lo" (127.0.0.1;
#                     raw verbs work, but rdma_cm route resolution fails with
#                     ENODEV).  The guest has no NIC (-nic none): no packet can
#                     leave the guest either way; rxe loops local traffic back.
#   --mtu N           MTU of dummy0 (default 1500 -> RoCE active_mtu 1024;
#                     9000 -> 4096.  lo always gives 4096)
#   --no-overlay      host / is mounted plain read-only (default: read-only host
#                     / under a tmpfs overlay, so writes outside --share folders
#                     succeed but are thrown away with the guest)
#   --clean-env       pass only PATH/HOME/LANG/TERM (default: the whole host
#                     environment is exported into the guest command)
#   -v, --verbose     print step timings and, on failure, the guest console log
# Environment:
#   RXE_VM_CACHE      cache dir for the kernel .deb and initramfs
#                     (default /tmp/rxe-vm-cache)
#   RXE_VM_KERNEL_PKG Debian kernel package (default: what linux-image-amd64
#                     depends on, e.g. linux-image-6.1.0-57-amd64)
#   RXE_VM_ACCEL      auto (default) | tcg | kvm.  auto uses KVM only when the
#                     host has real VT-x/AMD-V KVM (kvm_intel/kvm_amd); on a
#                     PVM-nested host (kvm_pvm) a stock kernel runs ~1000x slower
#                     than under plain TCG emulation and then crashes, so TCG.
#   RXE_VM_NO_INSTALL=1  never call apt-get (fail if something is missing)
#
# Inside the guest: the command runs as root, in the host's current directory,
# in a chroot of the host's /, with fresh /proc /sys /dev /tmp /run (so host
# files under /tmp are NOT visible unless shared with -s), one RDMA device
# "rxe0" (RoCEv2, port 1; GID index 1 = ::ffff:192.0.2.1, or ::ffff:127.0.0.1
# with --netdev lo), /dev/infiniband/uverbs0 and /dev/infiniband/rdma_cm.
# The command's stdout/stderr stream to this script's stdout/stderr; this
# script exits with the command's exit code (124 on timeout, 125 when the guest
# failed before/after running the command).
set -euo pipefail

# ---------------------------------------------------------------- arguments
SHARES=() TIMEOUT=900 MEM=2048 CPUS=2 NETDEV=dummy MTU=1500 OVERLAY=1 CLEAN_ENV=0 VERBOSE=0
while [ $# -gt 0 ]; do
  case "$1" in
    -s|--share)   SHARES+=("$(realpath -e "$2")"); shift 2 ;;
    -t|--timeout) TIMEOUT=$2; shift 2 ;;
    -m|--mem)     MEM=$2; shift 2 ;;
    -c|--cpus)    CPUS=$2; shift 2 ;;
    -n|--netdev)  NETDEV=$2; shift 2 ;;
    --mtu)        MTU=$2; shift 2 ;;
    --no-overlay) OVERLAY=0; shift ;;
    --clean-env)  CLEAN_ENV=1; shift ;;
    -v|--verbose) VERBOSE=1; shift ;;
    -h|--help)    sed -n '2,/^set -euo/p' "$0" | sed 's/^# \{0,1\}//;$d'; exit 0 ;;
    --) shift; break ;;
    -*) echo "run-in-rxe-vm: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [options] [--] COMMAND [ARGS...]  (-h for help)" >&2; exit 2; }
case "$NETDEV" in lo|dummy) ;; *) echo "run-in-rxe-vm: --netdev must be lo or dummy" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "run-in-rxe-vm: needs root (apt-get, and 9p export of /)" >&2; exit 2; }

CACHE=${RXE_VM_CACHE:-/tmp/rxe-vm-cache}
mkdir -p "$CACHE"
T0=$(date +%s.%N)
say()  { echo "run-in-rxe-vm: $*" >&2; }
tick() { [ "$VERBOSE" = 1 ] && say "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "[%6.1fs]", b-a}') $*" || true; }

# -------------------------------------------- 1. host packages (Debian only)
# command -> package that provides it
declare -A NEED=(
  [qemu-system-x86_64]=qemu-system-x86 [modprobe]=kmod [cpio]=cpio
  [rdma]=iproute2 [xz]=xz-utils [ibv_devices]=ibverbs-utils
)
LIBPKGS=(libibverbs1 ibverbs-providers)   # libibverbs.so.1 + librxe provider
apt_ready=0
apt_install() {
  [ "${RXE_VM_NO_INSTALL:-0}" = 1 ] && { say "missing packages: $* (RXE_VM_NO_INSTALL=1)"; exit 125; }
  if [ $apt_ready = 0 ]; then
    # an install can fail on stale/absent lists: update once, then retry
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2 && return 0
    apt-get update >&2; apt_ready=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2
}
(
  flock 9
  missing=()
  for c in "${!NEED[@]}"; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/sbin/$c" ] || [ -x "/usr/sbin/$c" ] || missing+=("${NEED[$c]}")
  done
  for p in "${LIBPKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"
) 9>"$CACHE/.lock"
tick "host packages ok"

# ------------------------------------- 2. guest kernel + busybox (cached)
# Both .debs are only unpacked (dpkg -x) into the cache, never installed, so
# the host's own packages (e.g. a dynamic busybox) are left alone.
fetch_deb() { # PKG DESTDIR: apt-get download + dpkg -x (update lists on failure)
  [ "${RXE_VM_NO_INSTALL:-0}" = 1 ] && { echo "run-in-rxe-vm: $1 not cached (RXE_VM_NO_INSTALL=1)" >&2; return 1; }
  rm -rf "$CACHE/dl" "$2.tmp"; mkdir -p "$CACHE/dl" "$2.tmp"
  # apt-get download as root warns that _apt cannot write here; harmless
  (cd "$CACHE/dl" && apt-get download "$1" >&2 2>/dev/null) ||
    { apt-get update >&2; (cd "$CACHE/dl" && apt-get download "$1" >&2); }
  dpkg -x "$CACHE"/dl/"$1"_*.deb "$2.tmp"; rm -rf "$CACHE/dl"
}
KDIR=$CACHE/kernel
(
  flock 9
  [ -x "$CACHE/busybox/bin/busybox" ] || {
    fetch_deb busybox-static "$CACHE/busybox"; rm -rf "$CACHE/busybox"; mv "$CACHE/busybox.tmp" "$CACHE/busybox"; }
  want=${RXE_VM_KERNEL_PKG:-}
  have=$(cat "$KDIR/.pkg" 2>/dev/null || true)
  if [ -n "$have" ] && { [ -z "$want" ] || [ "$want" = "$have" ]; }; then exit 0; fi
  if [ -z "$want" ]; then
    want=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
    if [ -z "$want" ]; then apt-get update >&2
      want=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}'); fi
  fi
  [ -n "$want" ] || { echo "run-in-rxe-vm: cannot resolve a linux-image package" >&2; exit 1; }
  fetch_deb "$want" "$KDIR"
  ver=$(ls "$KDIR.tmp/lib/modules")
  # the .deb has no modules.dep (its postinst makes it): build one for modprobe
  depmod -b "$KDIR.tmp" "$ver"
  echo "$want" > "$KDIR.tmp/.pkg"; rm -rf "$KDIR"; mv "$KDIR.tmp" "$KDIR"
) 9>"$CACHE/.lock"
KVER=$(ls "$KDIR/lib/modules")
VMLINUZ=$KDIR/boot/vmlinuz-$KVER
# Boot speed: under TCG the bzImage's real-mode setup + in-guest xz
# decompression cost ~4 s.  QEMU can instead boot the uncompressed ELF vmlinux
# straight into its PVH entry point (CONFIG_PVH=y in Debian's config), so
# decompress it once on the host (xz --single-stream ignores the bzImage tail).
(
  flock 9
  [ -e "$KDIR/vmlinux" ] || [ -e "$KDIR/.no-vmlinux" ] || {
    set +o pipefail   # tail gets SIGPIPE once xz has read its one stream
    if grep -q '^CONFIG_PVH=y' "$KDIR/boot/config-$KVER"; then
      for off in $(LC_ALL=C grep -obUaP '\xFD7zXZ\x00' "$VMLINUZ" | cut -d: -f1); do
        tail -c +$((off + 1)) "$VMLINUZ" | xz -dc --single-stream > "$KDIR/vmlinux.tmp" 2>/dev/null &&
          [ "$(head -c4 "$KDIR/vmlinux.tmp" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] &&
          mv "$KDIR/vmlinux.tmp" "$KDIR/vmlinux" && break
      done
      rm -f "$KDIR/vmlinux.tmp"
    fi
    [ -e "$KDIR/vmlinux" ] || touch "$KDIR/.no-vmlinux"   # fall back to bzImage
  }
) 9>"$CACHE/.lock"
[ -e "$KDIR/vmlinux" ] && BOOTIMG=$KDIR/vmlinux || BOOTIMG=$VMLINUZ
tick "kernel $KVER ready ($(basename "$BOOTIMG"))"

# ------------------------------------------------ 3. base initramfs (cached)
# busybox + the modules below (with all dependencies, in load order) + /init.
# crc32_generic: rxe computes its ICRC with the "crc32" crypto shash; without
#   the module `rdma link add` fails with ENOENT ("rdma_rxe: failed to add").
# dummy: only for --netdev dummy; overlay: the writable-but-discarded root.
MODS=(crc32_generic rdma_rxe ib_uverbs rdma_ucm 9p 9pnet_virtio virtio_pci
      virtio_console dummy overlay)
read -r -d '' GUEST_INIT <<'INIT_EOF' || true
#!/bin/busybox sh
# PID 1 of the guest.  Console (ttyS0) output goes to the host's log file only.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
up() { cut -d' ' -f1 /proc/uptime; }
fail() { echo "rxe-vm-init: FATAL: $*"; echo 125 > /ctl/rc 2>/dev/null; sync; poweroff -f; }
for m in $(cat /modules.order); do insmod /lib/modules/$m || echo "insmod $m failed"; done
MS=msize=262144
mkdir -p /ctl /hostro /newroot /ovl
mount -t 9p -o trans=virtio,version=9p2000.L,$MS rxectl /ctl || fail "mount ctl"
. /ctl/vm.conf   # sets OVERLAY NETDEV MTU SHARES ("tag:path" list)
# host / read-only; cache=loose is safe because nothing changes it meanwhile
mount -t 9p -o trans=virtio,version=9p2000.L,$MS,ro,cache=loose hostroot /hostro || fail "mount host /"
if [ "$OVERLAY" = 1 ] && mount -t tmpfs -o mode=755 ovl /ovl && mkdir -p /ovl/u /ovl/w &&
   mount -t overlay -o lowerdir=/hostro,upperdir=/ovl/u,workdir=/ovl/w overlay /newroot; then :
else mount --bind /hostro /newroot || fail "bind root"; fi
R=/newroot
mount -t proc proc $R/proc; mount -t sysfs sys $R/sys; mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm; mount -t devpts devpts $R/dev/pts; mount -t tmpfs shm $R/dev/shm
mount -t tmpfs -o mode=1777 tmp $R/tmp; mount -t tmpfs -o mode=755 run $R/run
for s in $SHARES; do tag=${s%%:*}; p=${s#*:}
  mkdir -p "$R$p" 2>/dev/null
  # cache=mmap: uncached (host sees writes at once) but shared mmap works
  mount -t 9p -o trans=virtio,version=9p2000.L,$MS,cache=mmap "$tag" "$R$p" || fail "mount share $p"
done
hostname rxe-vm; ip link set lo up
if [ "$NETDEV" = dummy ]; then ND=dummy0; ip link add dummy0 type dummy 2>/dev/null
  ip link set dummy0 mtu $MTU; ip addr add 192.0.2.1/24 dev dummy0; ip link set dummy0 up
else ND=lo; fi
chroot $R rdma link add rxe0 type rxe netdev $ND || fail "rdma link add rxe0 ($ND)"
echo "rxe-vm-init: rxe0 on $ND ready at $(up)s"
OUT=/dev/console ERR=/dev/console
for p in /sys/class/virtio-ports/*; do
  case "$(cat $p/name 2>/dev/null)" in rxe.out) OUT=/dev/${p##*/};; rxe.err) ERR=/dev/${p##*/};; esac
done
cp /ctl/cmd.sh $R/run/rxe-vm-cmd.sh
chroot $R /bin/bash /run/rxe-vm-cmd.sh </dev/null >$OUT 2>$ERR
rc=$?
echo "rxe-vm-init: command exited $rc at $(up)s"
sync; echo $rc > /ctl/rc; sync
for s in $SHARES; do umount "$R${s#*:}" 2>/dev/null; done
umount /ctl
poweroff -f
INIT_EOF
IKEY=$(printf '%s\n%s\n%s\n' "$KVER" "${MODS[*]}" "$GUEST_INIT" | sha256sum | cut -c1-16)
INITRD=$CACHE/initrd-$IKEY.cpio.gz
(
  flock 9
  [ -s "$INITRD" ] && exit 0
  W=$(mktemp -d "$CACHE/ird.XXXXXX")
  mkdir -p "$W"/{bin,lib/modules,proc,sys,dev}
  cp "$CACHE/busybox/bin/busybox" "$W/bin/busybox"   # static: no libs needed
  for m in "${MODS[@]}"; do modprobe -d "$KDIR" -S "$KVER" --show-depends "$m"; done |
    awk '$1=="insmod"{print $2}' | awk '!seen[$0]++' > "$W/mods.txt"
  while read -r f; do cp "$f" "$W/lib/modules/"; basename "$f"; done < "$W/mods.txt" > "$W/modules.order"
  rm "$W/mods.txt"
  printf '%s\n' "$GUEST_INIT" > "$W/init"; chmod 755 "$W/init"
  (cd "$W" && find . | cpio -o -H newc --quiet | gzip -1) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"; rm -rf "$W"
) 9>"$CACHE/.lock"
tick "initramfs $INITRD ready"

# ---------------------------------------------------- 4. per-run control dir
RUN=$(mktemp -d /tmp/rxe-vm-run.XXXXXX)
QPID=
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
  [ -n "${CAT1:-}" ] && kill "$CAT1" 2>/dev/null || true
  [ -n "${CAT2:-}" ] && kill "$CAT2" 2>/dev/null || true
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
{
  tags=""
  for i in "${!SHARES[@]}"; do tags+="share$i:${SHARES[$i]} "; done
  printf 'OVERLAY=%s\nNETDEV=%s\nMTU=%s\nSHARES="%s"\n' "$OVERLAY" "$NETDEV" "$MTU" "$tags"
} > "$RUN/vm.conf"
{
  echo '# generated by run-in-rxe-vm.sh'
  if [ "$CLEAN_ENV" = 1 ]; then
    for v in PATH HOME LANG TERM; do [ -n "${!v:-}" ] && printf 'export %s=%q\n' "$v" "${!v}"; done
  else
    # whole host environment, minus what must describe the guest itself
    for v in $(compgen -e); do
      case $v in PWD|OLDPWD|SHLVL|HOSTNAME|_|TMPDIR|XDG_RUNTIME_DIR|SSH_*) continue ;; esac
      printf 'export %s=%q\n' "$v" "${!v}"
    done
  fi
  printf 'cd %q 2>/dev/null || { echo "run-in-rxe-vm: %q is not visible in the guest (share it with -s); running in /" >&2; cd /; }\n' "$PWD" "$PWD"
  printf 'exec'; printf ' %q' "$@"; echo
} > "$RUN/cmd.sh"
mkfifo "$RUN/out" "$RUN/err"
cat "$RUN/out" & CAT1=$!
cat "$RUN/err" >&2 & CAT2=$!

# --------------------------------------------------------------- 5. boot
ACCEL=${RXE_VM_ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
  ACCEL=tcg
  if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ] &&
     { [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; }; then ACCEL=kvm; fi
fi
if [ "$ACCEL" = kvm ]; then ACCEL_ARGS=(-accel kvm -cpu host)
else ACCEL_ARGS=(-accel tcg,thread=multi -cpu max); fi
VIRTFS=(-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$RUN,mount_tag=rxectl,security_model=none,multidevs=remap")
for i in "${!SHARES[@]}"; do
  VIRTFS+=(-virtfs "local,path=${SHARES[$i]},mount_tag=share$i,security_model=none,multidevs=remap")
done
tick "booting guest (accel=$ACCEL)"
set +e
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 "${ACCEL_ARGS[@]}" -m "$MEM" -smp "$CPUS" \
  -machine q35 -display none -no-reboot -nic none \
  -serial "file:$RUN/console.log" \
  -kernel "$BOOTIMG" -initrd "$INITRD" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init" \
  "${VIRTFS[@]}" \
  -device virtio-serial-pci \
  -chardev "file,id=cout,path=$RUN/out" -device virtserialport,chardev=cout,name=rxe.out \
  -chardev "file,id=cerr,path=$RUN/err" -device virtserialport,chardev=cerr,name=rxe.err \
  </dev/null >"$RUN/qemu.log" 2>&1 &
QPID=$!
wait "$QPID"; QRC=$?; QPID=
set -e
# if qemu died before opening the FIFOs, the cats still block in open():
# an O_RDWR open never blocks and releases them (EOF once we close it)
exec 3<>"$RUN/out" 4<>"$RUN/err"; exec 3>&- 4>&-
wait "$CAT1" "$CAT2" 2>/dev/null || true; CAT1= CAT2=
tick "guest exited (qemu rc=$QRC)"

if [ -s "$RUN/rc" ]; then
  RC=$(cat "$RUN/rc")
elif [ $QRC = 124 ] || [ $QRC = 137 ]; then
  say "timed out after ${TIMEOUT}s"; RC=124
else
  say "guest died before reporting an exit code (qemu rc=$QRC)"; RC=125
fi
if [ "$RC" = 125 ] || [ "$RC" = 124 ] || [ "$VERBOSE" = 1 ]; then
  if [ "$RC" != 0 ] || [ "$VERBOSE" = 1 ]; then
    say "---- qemu log ----"; cat "$RUN/qemu.log" >&2 || true
    say "---- guest console (tail) ----"; tail -n 40 "$RUN/console.log" >&2 || true
  fi
fi
exit "$RC"
