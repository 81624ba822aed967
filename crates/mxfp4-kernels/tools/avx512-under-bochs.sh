#!/usr/bin/env bash
# Runs this crate's test binaries on an emulated AVX-512 CPU (Bochs 2.7, Skylake-X model:
# avx512f/dq/cd/bw/vl, so the `avx512` exact tier; no avx512bf16, so not the BF16/VNNI tiers)
# on a machine without AVX-512. QEMU's TCG has no AVX-512; Bochs does, but only as a whole
# PC, so this boots Debian's cloud kernel with a busybox initramfs that runs the tests and
# powers off. About 2 minutes to boot, then roughly 100x native time.
#
# Usage (from the workspace root, Debian bookworm, as root for apt):
#   crates/mxfp4-kernels/tools/avx512-under-bochs.sh [WORKDIR] [TEST FILTER...]
# e.g. crates/mxfp4-kernels/tools/avx512-under-bochs.sh /tmp/bochs floats:: x86::
# Exit status 0 when every run test passed. Needs: bochs bochsbios vgabios isolinux
# syslinux-common xorriso busybox-static (apt), one linux-image-*-cloud-amd64 .deb.
set -euo pipefail
work=${1:-/tmp/avx512-bochs}
shift || true
filters=("$@")
mkdir -p "$work"
work=$(cd "$work" && pwd)
target=${CARGO_TARGET_DIR:-target}

apt-get install -y -q --no-install-recommends bochs bochs-term bochsbios vgabios isolinux \
    syslinux-common xorriso busybox-static >/dev/null
if ! ls "$work"/linux-image-*.deb >/dev/null 2>&1; then
    kernel=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
    (cd "$work" && apt-get download "$kernel" >/dev/null)
fi

# Static test binaries (the initramfs has no libc).
RUSTFLAGS="-C target-feature=+crt-static" cargo test -p mxfp4-kernels --no-run \
    --target x86_64-unknown-linux-gnu --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' >"$work/bins"
[ -s "$work/bins" ] || { echo "no test binaries built (target dir $target)" >&2; exit 1; }

rm -rf "$work/rd" "$work/iso" "$work/k"
mkdir -p "$work"/rd/{bin,proc,sys,dev,t} "$work/iso/isolinux" "$work/k"
cp /usr/bin/busybox "$work/rd/bin/"
for a in sh mount poweroff cat grep sort tr echo sleep; do ln -s busybox "$work/rd/bin/$a"; done
i=0
while read -r bin; do
    strip -o "$work/rd/t/bin$i" "$bin"
    i=$((i + 1))
done <"$work/bins"
{
    echo '#!/bin/sh'
    echo 'mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev'
    echo 'echo "=== cpu: $(grep -o -E "avx512[a-z_0-9]*" /proc/cpuinfo | sort -u | tr "\n" " ")"'
    echo 'export RUST_TEST_THREADS=1'
    for ((j = 0; j < i; j++)); do
        echo "/t/bin$j ${filters[*]:-} 2>&1"
    done
    echo 'echo "=== avx512-under-bochs done"; sleep 8; poweroff -f'
} >"$work/rd/init"
chmod +x "$work/rd/init"
(cd "$work/rd" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1 >"$work/iso/initrd.gz")
dpkg-deb -x "$(ls "$work"/linux-image-*.deb | head -1)" "$work/k"
cp "$work"/k/boot/vmlinuz-* "$work/iso/vmlinuz"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$work/iso/isolinux/"
# clearcpuid: Bochs 2.7 reports the compacted XSAVE size wrongly (2688 for 2432), and Linux
# then disables XSAVE and with it AVX-512; without XSAVES/XSAVEC it uses the standard format.
cat >"$work/iso/isolinux/isolinux.cfg" <<'EOF'
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  APPEND initrd=/initrd.gz console=ttyS0,115200 loglevel=4 mitigations=off panic=-1 tsc=reliable clearcpuid=xsaves,xsavec
EOF
rm -f "$work/boot.iso"
xorriso -as mkisofs -quiet -o "$work/boot.iso" -b isolinux/isolinux.bin -c isolinux/boot.cat \
    -no-emul-boot -boot-load-size 4 -boot-info-table "$work/iso" 2>/dev/null
cat >"$work/bochsrc" <<EOF
megs: 1024
cpu: model=corei7_skylake_x, count=1, ips=400000000, reset_on_triple_fault=0
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/bochs/VGABIOS-lgpl-latest
ata0-master: type=cdrom, path=$work/boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$work/serial.txt
display_library: term
log: $work/bochs.log
clock: sync=none, time0=local
EOF
printf 'c\n' >"$work/dbg.rc"
rm -f "$work/serial.txt" "$work/stdin"
mkfifo "$work/stdin"
sleep 100000 >"$work/stdin" &
keeper=$!
# Debian's Bochs is a debugger build with a terminal display: it needs a tty (script) and a
# command file that continues; it does not exit at guest power-off, so it is killed below
# (the processes whose command line names this run's bochsrc).
(cd "$work" && TERM=xterm script -qfc "bochs -q -f $work/bochsrc -rc $work/dbg.rc" /dev/null \
    >"$work/bochs.out" 2>&1 <"$work/stdin") &
runner=$!
while ! grep -q "=== avx512-under-bochs done" "$work/serial.txt" 2>/dev/null; do
    if ! kill -0 "$runner" 2>/dev/null; then
        echo "bochs exited early; see $work/bochs.log" >&2
        break
    fi
    sleep 10
done
for pid in $(pgrep -f -- "-f $work/bochsrc" || true); do kill -9 "$pid" 2>/dev/null || true; done
kill "$keeper" 2>/dev/null || true
wait "$runner" 2>/dev/null || true
sed -n '/=== cpu:/,$p' "$work/serial.txt"
grep -q "=== cpu: .*avx512f" "$work/serial.txt" || { echo "guest has no avx512f" >&2; exit 1; }
! grep -q -E "test result: FAILED|panicked|error: test failed" "$work/serial.txt"
