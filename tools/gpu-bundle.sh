#!/usr/bin/env bash
# Prepares the GPU check (tests/gpu/run.sh) for a machine that can install nothing: the device
# machine has the CUDA toolkit, the driver and PyTorch, but none of Debian's -dev packages (so
# none of dstrain's libraries) and no network, and at most 64 MiB of working tree travels there.
# Builds dstrain here for sm_90a (preset `bundle`: CUDA backend, CPU kernels for x86-64-v3) and
# packs into .gpu-bundle/dstrain-gpu.tar.gz (git-ignored; name `.gpu-bundle` in the device
# tool's carry):
#   bin/       dstrain, dstrain-gpu-check, dstrain-nccl-check, dstrain-ckpt, dstrain-report (and the plugins
#              lib/libdstrain_cuda.so, lib/libdstrain_nccl.so)
#   lib/       every shared library they and Open MPI's plugins need, except glibc's, libstdc++ /
#              libgcc_s (the device machine's own are newer, and the CUDA libraries use them) and
#              the CUDA toolkit's (cudart, cuBLASLt, NCCL: the device machine's own, same major version)
#   ompi/      Open MPI's plugins, help files and defaults in the layout OPAL_PREFIX relocates
#   expected/  outputs computed here by the CPU backend (--dump-grads of tiny and of tiny with
#              16-wide RoPE, fp32 and bf16; the losses of 50 steps of small) for the CUDA runs to match
# Then rehearses the bundle (tools/gpu-rehearse.sh) unless DSTRAIN_GPU_REHEARSE=0.
set -euo pipefail
cd "$(dirname "$0")/.."
# Its own build (preset `bundle`, build-bundle/): the default build's CPU kernels are compiled
# for this machine (-march=native), and the device machine's CPU may lack what this one has
# (AVX-512 FP16, say) -- an illegal instruction there, found only on the GPU's clock.
cmake --preset bundle >/dev/null
cmake --build --preset bundle --target dstrain dstrain-gpu-check dstrain-nccl-check dstrain-ckpt dstrain-report
# AVX-512 (zmm / mask registers) and AMX only in the functions that check the CPU before they run
# (kernels/cpu/amx.cpp, docs/design.md §6.8); anywhere else fails the bundle here.
isa_users() { objdump -d --no-show-raw-insn "$1" | awk '/^[0-9a-f]+ <.*>:$/ {fn = $2} /%zmm|%k[0-7]|tmm[0-7]|ldtilecfg/ {print fn}' | sort -u; }
allowed=$(isa_users build-bundle/kernels/CMakeFiles/dstrain_kernels_cpu.dir/cpu/amx.cpp.o)
for f in bin/dstrain bin/dstrain-gpu-check bin/dstrain-nccl-check bin/dstrain-ckpt bin/dstrain-report \
         lib/libdstrain_cuda.so lib/libdstrain_nccl.so; do
  stray=$(comm -23 <(isa_users "build-bundle/$f") <(echo "$allowed"))
  if [ -n "$stray" ]; then
    echo "build-bundle/$f uses AVX-512 or AMX outside kernels/cpu/amx.cpp:" >&2
    echo "$stray" | head -20 >&2
    exit 1
  fi
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
b=$stage/dstrain-gpu
mkdir -p "$b/bin" "$b/lib" "$b/expected"
cp build-bundle/bin/dstrain build-bundle/bin/dstrain-gpu-check build-bundle/bin/dstrain-nccl-check build-bundle/bin/dstrain-ckpt \
   build-bundle/bin/dstrain-report "$b/bin/"
cp build-bundle/lib/libdstrain_cuda.so build-bundle/lib/libdstrain_nccl.so "$b/lib/"  # the plugins (dlopen'ed from bin/../lib)
if [ -f build-bundle/lib/libdstrain_cudnn.so ]; then cp build-bundle/lib/libdstrain_cudnn.so "$b/lib/"; fi  # (where cuDNN was found)

# Open MPI: Debian's prefix is /usr; OPAL_PREFIX=$b/ompi moves every install directory under it.
pkglib=$(ompi_info --path pkglibdir --parsable | sed 's/^path:pkglibdir://')
pkgdata=$(ompi_info --path pkgdatadir --parsable | sed 's/^path:pkgdatadir://')
sysconf=$(ompi_info --path sysconfdir --parsable | sed 's/^path:sysconfdir://')
for d in "$pkglib" "$pkgdata" "$sysconf"; do
  case $d in /usr/*|/etc*) ;; *) echo "unexpected Open MPI directory $d" >&2; exit 1 ;; esac
done
mkdir -p "$b/ompi/${pkglib#/usr/}" "$b/ompi/${pkgdata#/usr/}" "$b/ompi/etc/openmpi"
cp -a "$pkglib"/. "$b/ompi/${pkglib#/usr/}/"
cp -a "$pkgdata"/. "$b/ompi/${pkgdata#/usr/}/"
cp -a "$sysconf"/. "$b/ompi/etc/openmpi/" 2>/dev/null || true

# Shared libraries of the binaries and of the plugins, the system's and CUDA's left out.
skip='^(libc|libm|libdl|librt|libpthread|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl|libcudnn.*|linux-vdso)\.so'
{
  for f in "$b"/bin/* "$b"/lib/libdstrain_*.so "$b/ompi/${pkglib#/usr/}"/*.so; do ldd "$f" 2>/dev/null || true; done
} | awk '/=> \// {print $1, $3}' | sort -u | while read -r name path; do
  if [[ $name =~ $skip ]]; then continue; fi
  [ -e "$b/lib/$name" ] || cp -L "$path" "$b/lib/$name"
done

# Expected outputs, from the CPU backend: --dump-grads of tiny and of tiny16 (16-wide RoPE at
# S = 100, so that bf16 takes the tiled attention on the GPU) in fp32 and bf16, and the losses of
# the train step's 50 steps of small (the same run, on the CPU).
tiny16="--set model.qk_rope_head_dim=16 --set seq_length=100"
for p in fp32 bf16; do
  extra=""
  [ $p = bf16 ] && extra="--set bf16.enabled=true"
  # (--resume none: a checkpoint left in checkpoints/tiny here would otherwise be what is dumped)
  build-bundle/bin/dstrain configs/tiny.yaml --resume none --set device=cpu $extra --dump-grads "$b/expected/tiny_$p.h5" >/dev/null
  build-bundle/bin/dstrain configs/tiny.yaml --resume none --set device=cpu $extra $tiny16 \
    --dump-grads "$b/expected/tiny16_$p.h5" >/dev/null
done
build-bundle/bin/dstrain configs/small.yaml --set device=cpu --resume none --set train_steps=50 --set steps_per_print=1 \
  --set data.eval_interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir="$stage/small-ckpt" \
  --set monitor.metrics_file="$b/expected/small_losses.jsonl" --set monitor.tensorboard=null >/dev/null
rm -rf "$stage/small-ckpt"
git rev-parse --short HEAD >"$b/REVISION" 2>/dev/null || echo unknown >"$b/REVISION"
mkdir -p .gpu-bundle
rm -f .gpu-bundle/dstrain-gpu.tar.*
tar -C "$stage" -cf - dstrain-gpu | gzip -9 >.gpu-bundle/dstrain-gpu.tar.gz  # gzip: every machine unpacks it
echo "bundle: .gpu-bundle/dstrain-gpu.tar.gz, $(du -h .gpu-bundle/dstrain-gpu.tar.gz | cut -f1)" \
     "($(du -sh "$b" | cut -f1) unpacked, $(ls "$b/lib" | wc -l) libraries, revision $(cat "$b/REVISION"))"
if [ "${DSTRAIN_GPU_REHEARSE:-1}" != 0 ]; then tools/gpu-rehearse.sh; fi
