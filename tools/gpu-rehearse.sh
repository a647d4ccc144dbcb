#!/usr/bin/env bash
# Rehearses the GPU check (tests/gpu/run.sh) in a clean root, so that it runs on the first try
# on a device machine, which can install nothing: a minimal Debian made by debootstrap (no -dev
# packages, none of dstrain's libraries, no Open MPI, no orted), with only the CUDA toolkit's
# libraries mounted at /usr/local/cuda as on the device machine, and the repository's files plus
# .gpu-bundle copied in. Inside, run.sh runs in rehearsal mode (DSTRAIN_GPU_REHEARSAL=1): every
# step on the CPU backend, the kernel check exiting 77 for want of a GPU. A library the bundle
# lacks, an Open MPI plugin that does not load, a config override that no longer parses, a
# comparison or a parse of the metrics that fails — each shows here. The root is kept in
# $DSTRAIN_REHEARSAL_ROOT (default /var/tmp/dstrain-rehearsal-root) for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-bundle/dstrain-gpu.tar.gz ] || { echo "no bundle: run tools/gpu-bundle.sh" >&2; exit 2; }
root=${DSTRAIN_REHEARSAL_ROOT:-/var/tmp/dstrain-rehearsal-root}
if [ ! -x "$root/bin/bash" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
  echo "debootstrap: a minimal Debian 12 in $root (once)"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
fi
work=$root/work
rm -rf "$work" && mkdir -p "$work"
# What travels to the device machine: tracked and untracked-not-ignored files, and the carried bundle.
git ls-files -z -co --exclude-standard | xargs -0 -I{} cp --parents {} "$work/"
cp --parents -r .gpu-bundle "$work/"
mkdir -p "$root/usr/local/cuda" "$root/proc" "$root/dev" "$root/sys"
mountpoint -q "$root/usr/local/cuda" || mount --bind -o ro /usr/local/cuda "$root/usr/local/cuda"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
mountpoint -q "$root/sys" || mount -t sysfs sys "$root/sys"
trap 'umount "$root/usr/local/cuda" "$root/proc" "$root/dev" "$root/sys" 2>/dev/null || true' EXIT
rc=0
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root DSTRAIN_GPU_REHEARSAL=1 \
  /bin/bash -c "cd /work && tests/gpu/run.sh /tmp/rehearsal-out" || rc=$?
# What the device tool brings back: at most 8 files of at most 16 MiB from $OUT, and the last
# 12,000 characters of output, which must hold the whole summary (6,000 at most).
o=$root/tmp/rehearsal-out
files=$(find "$o" -type f | wc -l)
big=$(find "$o" -type f -size +16M | wc -l)
chars=$(wc -c <"$o/summary.txt" 2>/dev/null || echo 99999)
echo "rehearsal: $files files in the output ($big over 16 MiB), summary $chars characters"
[ "$files" -le 8 ] && [ "$big" -eq 0 ] && [ "$chars" -le 6000 ] || { echo "rehearsal: the output would not come back whole"; rc=1; }
grep -q "^timeout_probe: ok (stopped by its time limit, as meant; nothing left behind)" "$o/summary.txt" ||
  { echo "rehearsal: the timed-out step left something behind, or did not run into its limit"; rc=1; }
echo "rehearsal: exit $rc (the archive is $o/gpu-check.tar.gz)"
exit $rc
