#!/bin/bash
# build-image.sh - build a minimal Debian bookworm guest (kernel 6.1 with rdma_rxe
# module + rdma-core userland) as a raw ext4 image, plus vmlinuz/initrd for
# direct -kernel/-initrd boot.  Run as root on a Debian 12 host.
#
# Output (in $WORK, default $TMPDIR/anydoor-rxe-vm):
#   rxe-guest.img   raw ext4 root fs (boot it with -snapshot: stays pristine)
#   vmlinuz initrd.img   kernel + initramfs copied from the guest's /boot
set -euo pipefail

WORK=${WORK:?set WORK (scripts/rxe-vm/run-tests chooses one per recipe)}
SUITE=bookworm
# Mirror: first URIs: line of the host's deb822 sources (http://deb.debian.org/debian)
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)}
ROOTFS=$WORK/rootfs
IMG=$WORK/rxe-guest.img

# ibverbs-providers (librxe) and zstd are only *Recommends* -> must be listed,
# debootstrap never installs Recommends.
# + the shared libraries anydoor's binaries link (spdlog, fmt, libcrypto).
PKGS=linux-image-amd64,zstd,rdma-core,ibverbs-providers,ibverbs-utils,perftest,rdmacm-utils,iproute2,kmod,iputils-ping,procps,libspdlog1.10,libfmt9,libssl3

# --- host prerequisites ---------------------------------------------------
need=()
for p in debootstrap qemu-system-x86 qemu-utils e2fsprogs libibverbs-dev gcc; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}"
fi

mkdir -p "$WORK"

# --- 1. debootstrap (SKIP_DEBOOTSTRAP=1 reuses an existing $ROOTFS) ---------
t0=$(date +%s)
if [ "${SKIP_DEBOOTSTRAP:-0}" != 1 ]; then
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOTFS" "$MIRROR"
  t1=$(date +%s)
  echo "### debootstrap took $((t1 - t0)) s"
fi

# --- 2. configure guest ---------------------------------------------------
echo rxe-guest > "$ROOTFS/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 rxe-guest\n' > "$ROOTFS/etc/hosts"

# Small initramfs: only what is needed to mount a virtio-blk ext4 root.
sed -i 's/^MODULES=.*/MODULES=list/' "$ROOTFS/etc/initramfs-tools/initramfs.conf"
printf '%s\n' virtio_pci virtio_blk ext4 > "$ROOTFS/etc/initramfs-tools/modules"

# PID 1 of the guest (kernel cmdline init=/sbin/rxe-init). No systemd/udev:
# mounts the 9p share, runs the script named by rxescript= on the kernel
# cmdline, stores its exit code in the share, powers off.
cat > "$ROOTFS/sbin/rxe-init" <<'EOF'
#!/bin/bash
# Guest PID 1: run a script from the host share, write exit code, power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys  || mount -t sysfs sysfs /sys
mountpoint -q /dev  || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run /tmp
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run;       mount -t tmpfs tmpfs /tmp
mount -o remount,rw /
hostname rxe-guest
echo "rxe-init: up $(cut -d' ' -f1 /proc/uptime)s after kernel start"

SCRIPT=run.sh
for a in $(cat /proc/cmdline); do
  case "$a" in rxescript=*) SCRIPT=${a#rxescript=} ;; esac
done

rc=200
# no udev in the guest -> load drivers by hand (virtio_net gives eth0)
modprobe -a 9pnet_virtio 9p virtio_net
ip link set lo up
mkdir -p /mnt/share
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,access=any share /mnt/share; then
  if [ -x "/mnt/share/$SCRIPT" ] || [ -f "/mnt/share/$SCRIPT" ]; then
    cd /mnt/share
    # output goes to the serial console and to the share
    bash "/mnt/share/$SCRIPT" 2>&1 | tee /mnt/share/guest-output.log
    rc=${PIPESTATUS[0]}
    cd /
  else
    echo "rxe-init: /mnt/share/$SCRIPT not found"; rc=201
  fi
  echo "$rc" > /mnt/share/exitcode
  sync
  umount /mnt/share
else
  echo "rxe-init: mounting 9p share failed"; rc=202
fi
echo "rxe-init: script exit code $rc, powering off"
sync
echo o > /proc/sysrq-trigger    # immediate ACPI power off -> qemu exits
sleep 10
EOF
chmod 755 "$ROOTFS/sbin/rxe-init"

# --- 2b. Soft-iWARP: Debian's 6.1 kernel ships rdma_rxe but not siw
# (CONFIG_RDMA_SIW unset); build siw.ko out of tree against the guest
# kernel's headers from linux-source-6.1 (SKIP_SIW=1 leaves it out).
if [ "${SKIP_SIW:-0}" != 1 ]; then
  ts=$(date +%s)
  KVER=$(ls "$ROOTFS/lib/modules" | head -1)
  dpkg -s "linux-headers-$KVER" >/dev/null 2>&1 || \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "linux-headers-$KVER"
  SIW=$WORK/siw
  rm -rf "$SIW" && mkdir -p "$SIW/src"
  (cd "$SIW" && apt-get download linux-source-6.1 >/dev/null)
  dpkg-deb --fsys-tarfile "$SIW"/linux-source-6.1_*.deb | tar -xO ./usr/src/linux-source-6.1.tar.xz \
    | tar -xJ -C "$SIW/src" --strip-components=5 --wildcards 'linux-source-6.1/drivers/infiniband/sw/siw/*'
  make -C "/usr/src/linux-headers-$KVER" M="$SIW/src" CONFIG_RDMA_SIW=m modules -j"$(nproc)" >"$SIW/make.log" 2>&1 \
    || { tail -20 "$SIW/make.log"; echo "siw build failed"; exit 1; }
  mkdir -p "$ROOTFS/lib/modules/$KVER/extra"
  strip --strip-debug -o "$ROOTFS/lib/modules/$KVER/extra/siw.ko" "$SIW/src/siw.ko"
  chroot "$ROOTFS" depmod -a "$KVER"
  rm -rf "$SIW"
  echo "### siw.ko for $KVER took $(( $(date +%s) - ts )) s"
fi

chroot "$ROOTFS" update-initramfs -u -k all
rm -f "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*_Packages

cp -L "$ROOTFS/vmlinuz" "$WORK/vmlinuz"
cp -L "$ROOTFS/initrd.img" "$WORK/initrd.img"
# Also an uncompressed ELF vmlinux (has a PVH note) so qemu can boot it
# directly, skipping SeaBIOS real mode + in-guest xz decompression.
python3 - "$WORK/vmlinuz" "$WORK/vmlinux" <<'PY'
import lzma, sys
d = open(sys.argv[1], 'rb').read()
i = d.find(b'\xfd7zXZ\x00')          # Debian 6.1 bzImage payload is xz
open(sys.argv[2], 'wb').write(lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(d[i:]))
PY
chmod 644 "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/vmlinux"

# --- 3. raw ext4 image straight from the folder (no loop mount needed) -----
used_mb=$(du -sm "$ROOTFS" | cut -f1)
size_mb=$((used_mb + used_mb / 4 + 256))
rm -f "$IMG"
mkfs.ext4 -q -F -L rxeroot -E root_owner=0:0 -d "$ROOTFS" "$IMG" "${size_mb}M"
t2=$(date +%s)
echo "### total build took $((t2 - t0)) s"
echo "### rootfs $(du -sh "$ROOTFS" | cut -f1), image $IMG apparent ${size_mb}M, on disk $(du -sh "$IMG" | cut -f1)"
ls -la "$WORK/vmlinuz" "$WORK/vmlinux" "$WORK/initrd.img" "$IMG"
