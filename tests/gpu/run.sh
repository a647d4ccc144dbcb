#!/usr/bin/env bash
# The GPU check, for a lent device machine (one H200; CUDA toolkit, driver, PyTorch; no -dev
# packages, no network). Prepare it here with tools/gpu-bundle.sh, then on the device machine,
# from the repository root, with `.gpu-bundle` carried:
#
#   tests/gpu/run.sh [OUT_DIR]        (default: $OUT, else /tmp/dstrain-gpu-out)
#
# Steps in order of value, each logged to its own log, each under its own time limit, and all of
# them within 360 s (the device's 15 minutes also pay for its start, the transfers and a rerun); a
# step with no time left is skipped — counted as failed, unless it is one of the optional
# measurements at the end:
#   env      the GPU, driver and libraries; every library the binaries need resolves;
#            dstrain-report (versions, CPU, GPUs, topology advice for configs/h200.yaml)
#   kernels  dstrain-gpu-check --bench: every CUDA op against the CPU backend at the shapes of
#            every preset (fp32 to 1e-5; the 16-bit tolerances in tools/gpu/gpu_check.cpp),
#            determinism, the caching pool; GEMM and attention TFLOP/s on random inputs
#   dump     --dump-grads on CUDA against the CPU backend's, computed when the bundle was made:
#            tiny (fp32; fp32 with the LM head in chunks of 7 rows; bf16: the rows attention) and
#            tiny with 16-wide RoPE at S = 100 (d_qk 32, d_v 16: bf16 takes the tiled attention;
#            fp32 too) — fp32 to 1e-4, bf16 to 5e-2 of each tensor's largest value
#   nccl     dstrain-nccl-check: the NCCL communicator's operations on device buffers (one rank)
#   train    50 steps of `small` on CUDA: the first five losses within 1e-3 (relative) of the
#            CPU backend's (computed when the bundle was made), the loss falls by 0.5; a trace of
#            steps 10-11 (train.trace.json)
#   bench    tokens/s, TFLOP/s and MFU against 989 dense bf16 TFLOP/s for `medium` (bf16,
#            8 x 2048), peak memory, and the step's time per kernel op from CUDA events
#            (monitor.op_breakdown: two events an op and a wait at each step's end, so the
#            step's tokens/s are a little low if the host is what limits them)
#   h200     the same for configs/h200.yaml (4 x 2048)                                (optional)
#   hf       Hugging Face transformers on medium's model and batch (tools/gpu/hf_baseline.py)
#                                                                                     (optional)
#   sdpa     cuDNN's fused attention and PyTorch's other SDPA kernels at MLA's shapes, fwd + bwd,
#            beside the kernels step's timing of dstrain's own (tools/gpu/sdpa_baseline.py)
#                                                                                     (optional)
# Exit status 0 when every step passed. What comes back: the device machine returns at most 8
# files from $OUT and the last 12,000 characters of output, so OUT_DIR holds two files — the
# archive gpu-check.tar.gz (every log, the report, the dumps' comparisons, the trace, the metrics)
# and summary.txt — and the output ends with the summary (under 6,000 characters): a line per
# step with its verdict, time and figures, and the first error lines of a failed step.
# Hygiene: each step runs in a process group of its own under `timeout -k` (SIGTERM, then SIGKILL
# 10 s later), and whatever it left — a process, a process on the GPU, a checkpoint directory —
# is removed before the next step (said in the summary). dstrain's commands see the bundle's
# libraries (LD_LIBRARY_PATH is set only for them, by wrappers on PATH); PyTorch's steps see the
# machine's own environment.
# DSTRAIN_GPU_REHEARSAL=1 (tools/gpu-rehearse.sh, in a clean root without a GPU) runs the same
# steps on the CPU backend — the checker against a second CPU backend, the benchmark as a dry
# run — so that everything but the CUDA execution itself is known to work before a GPU is lent.
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${1:-${OUT:-/tmp/dstrain-gpu-out}}
mkdir -p "$final"
out=$(mktemp -d /tmp/dstrain-gpu-logs.XXXXXX)  # the logs, archived into $final at the end
bundle=.gpu-bundle/dstrain-gpu.tar.gz
[ -f "$bundle" ] || { echo "no $bundle: run tools/gpu-bundle.sh here first, and carry .gpu-bundle" >&2; exit 2; }
root=${DSTRAIN_GPU_ROOT:-/tmp/dstrain-gpu-root}
rm -rf "$root" && mkdir -p "$root"
tar -C "$root" -xzf "$bundle" || { echo "cannot unpack $bundle" >&2; exit 2; }
B=$root/dstrain-gpu
[ -x "$B/bin/dstrain" ] || { echo "$bundle holds no bin/dstrain" >&2; exit 2; }

# Probed before anything of the bundle is on any path: PyTorch and transformers as installed.
have_torch=0 have_hf=0
python3 -c "import torch" 2>/dev/null && have_torch=1
python3 -c "import torch, transformers" 2>/dev/null && have_hf=1

# The CUDA libraries come from the machine: the toolkit's, else the pip wheels PyTorch brought.
cuda_dirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; r = nvidia.__path__[0]; print(" ".join(os.path.join(r, d, "lib") for d in os.listdir(r)))' 2>/dev/null); do
  [ -d "$d" ] && cuda_dirs="$cuda_dirs:$d"
done
# dstrain's executables through wrappers that give them (and only them) the bundle's libraries
# and Open MPI: python3 and PyTorch keep the machine's own.
wrap=$root/wrap
mkdir -p "$wrap"
for f in "$B"/bin/*; do
  cat >"$wrap/$(basename "$f")" <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$B/lib$cuda_dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$B/ompi" OMPI_MCA_ess_singleton_isolated=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$f" "\$@"
WRAP
  chmod +x "$wrap/$(basename "$f")"
done
export PATH="$wrap:$PATH"
export DSTRAIN_GPU_LIBS="$B/lib$cuda_dirs"  # (for ldd in the env step)
status=0
failed=""
dev=cuda
[ "${DSTRAIN_GPU_REHEARSAL:-0}" = 1 ] && dev=cpu
export dev

# The processes on the GPU (none without one).
gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | grep -E '^[0-9]+$' || true; }
# The summary: a line per step (and what failed steps said first).
summary=$out/summary.txt
: >"$summary"
note() { echo "$*" >>"$summary"; }

# step NAME SECONDS COMMAND...: runs it with a time limit (never past the whole check's 360 s) in
# a process group of its own, logs to NAME.log. A step skipped for want of time fails the check,
# unless OPTIONAL=1 (a measurement taken only if time is left). The step's figures are the lines
# of its log that start with "figure:" or match FIGURES (a grep -E pattern), at most FIGMAX (6).
deadline=${DSTRAIN_GPU_DEADLINE:-360}
step() {
  local name=$1 secs=$2
  shift 2
  local left=$((deadline - SECONDS))
  # An optional measurement starts only with its whole limit left: cut short, it would say nothing.
  if [ $left -lt 20 ] || { [ "${OPTIONAL:-0}" = 1 ] && [ $left -lt $secs ]; }; then
    echo "== $name: skipped, the check's time is spent"
    note "$name: SKIPPED (no time left)"
    if [ "${OPTIONAL:-0}" != 1 ]; then failed="$failed $name(no-time)"; status=1; fi
    return
  fi
  [ $secs -gt $left ] && secs=$left
  echo "== $name (limit ${secs} s)"
  local t0=$SECONDS
  setsid timeout -k 10 "$secs" bash -o pipefail -c "$*" >"$out/$name.log" 2>&1 &
  local pid=$!
  wait $pid
  local rc=$?
  # What the step left behind: its process group, anything on the GPU, its run directories.
  local left_over=""
  # (a process of the group may still be exiting: two seconds before it counts as left behind)
  local tries=0
  while kill -0 -- -$pid 2>/dev/null && [ $tries -lt 20 ]; do sleep 0.1; tries=$((tries + 1)); done
  if kill -0 -- -$pid 2>/dev/null; then
    left_over="$left_over processes($(ps -o comm= -g $pid 2>/dev/null | sort -u | tr '\n' ' '))"
    kill -KILL -- -$pid 2>/dev/null
  fi
  local g
  for g in $(gpu_pids); do kill -KILL "$g" 2>/dev/null && left_over="$left_over gpu-process:$g"; done
  for g in /tmp/dstrain-gpu-$name /tmp/dstrain-gpu-$name-*; do
    [ -e "$g" ] || continue
    if find "$g" -name '*.h5*' | grep -q .; then left_over="$left_over checkpoint"; fi
    rm -rf "$g"
  done
  local took=$((SECONDS - t0)) verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
  # EXPECT_TIMEOUT=1: a step meant to be stopped by its limit, which must leave nothing behind.
  if [ "${EXPECT_TIMEOUT:-0}" = 1 ]; then
    if [ "$verdict" = "TIMED OUT" ] && [ -z "$left_over" ]; then
      verdict="ok (stopped by its time limit, as meant; nothing left behind)" rc=0
    elif [ "$verdict" = "TIMED OUT" ]; then
      rc=1
    else
      verdict="FAILED (meant to run into its time limit: exit $rc)" rc=1
    fi
  fi
  # An optional measurement that fails or runs out of time is reported, not counted against the check.
  if [ "${OPTIONAL:-0}" = 1 ] && [ $rc -ne 0 ]; then verdict="$verdict (optional)" rc=0; fi
  echo "== $name: $verdict after $took s${left_over:+; removed:$left_over}"
  note "$name: $verdict in $took s${left_over:+ (removed:$left_over)}"
  # ("figure:" lines first: a step puts its verdict's figures there so that FIGMAX never cuts them)
  { grep -E "^figure: " "$out/$name.log" | sed 's/^figure: //'
    [ -n "${FIGURES:-}" ] && grep -E "$FIGURES" "$out/$name.log" | grep -v "^figure: "; } |
    cut -c1-240 | head -"${FIGMAX:-6}" | sed 's/^/    /' >>"$summary"
  if [ $rc -ne 0 ]; then
    status=1; failed="$failed $name"
    grep -iE "error|fail|mismatch|differ|not found|assert|abort|what\(\)" "$out/$name.log" | cut -c1-240 | head -5 |
      sed 's/^/    ! /' >>"$summary"
  fi
}

FIGURES="^dstrain revision|^NVIDIA|^name,|unresolved|GEMM peak" step env 20 '
  echo "dstrain revision $(cat '"$B"'/REVISION)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  # (the cuDNN attention plugin is optional: without libcudnn the cudnn path is skipped, not failed)
  missing=$(for f in '"$B"'/bin/* '"$B"'/lib/libdstrain_*.so; do
              case $f in */libdstrain_cudnn.so) continue ;; esac
              LD_LIBRARY_PATH=$DSTRAIN_GPU_LIBS ldd "$f"; done | grep "not found" | sort -u)
  if [ -n "$missing" ]; then echo "unresolved libraries:"; echo "$missing"; exit 1; fi
  if [ -f '"$B"'/lib/libdstrain_cudnn.so ]; then
    c=$(LD_LIBRARY_PATH=$DSTRAIN_GPU_LIBS ldd '"$B"'/lib/libdstrain_cudnn.so | grep "not found" | tr -s " \t" " ")
    echo "figure: cuDNN attention plugin: ${c:-every library resolves}"
  fi
  for f in '"$B"'/bin/* '"$B"'/lib/libdstrain_*.so; do LD_LIBRARY_PATH=$DSTRAIN_GPU_LIBS ldd "$f" | grep -E "cudart|cublas|nccl|cudnn"; done | sort -u
  dstrain-report configs/h200.yaml > '"$out"'/report.txt; rc=$?
  grep -E "NCCL|CUDA runtime|cuBLASLt|cuDNN|GEMM peak|GPU [0-9]|advice" '"$out"'/report.txt
  exit $rc'

# The rehearsal also proves that a step its limit stops leaves no process and no checkpoint.
if [ $dev = cpu ]; then
  EXPECT_TIMEOUT=1 step timeout_probe 12 '
    dstrain configs/small.yaml --resume none --set train_steps=100000 --set steps_per_print=1 --set data.eval_interval=0 \
      --set checkpoint.save_at_end=false --set checkpoint.dir=/tmp/dstrain-gpu-timeout_probe'
fi

if [ $dev = cuda ]; then
  FIGMAX=16 FIGURES="TFLOP/s|^FAIL|^skip" step kernels 90 '
    dstrain-gpu-check --bench | tee '"$out"'/kernels.txt; rc=${PIPESTATUS[0]}
    echo "figure: $(grep -E "checks passed|^FAIL [^ ]" '"$out"'/kernels.txt | tail -1)"; exit $rc'
else  # no GPU: the libraries load and the check says so (77), and the checker passes CPU against CPU
  step kernels 90 'dstrain-gpu-check; rc=$?; [ $rc -eq 77 ] || exit 1; dstrain-gpu-check --against-cpu | tail -3'
fi

# tiny16: tiny with 16-wide RoPE (d_qk 32, d_v 16) at S = 100 — the tiled attention in 16 bits,
# a partial tile at the end of each sequence.
tiny16="--set model.qk_rope_head_dim=16 --set seq_length=100"
FIGURES="tensors compared" step dump 50 '
  set -e
  d() { dstrain configs/tiny.yaml --resume none --set device=$dev "$@" | tail -1; }
  d --dump-grads '"$out"'/tiny_fp32.h5
  dstrain-ckpt compare-dumps '"$B"'/expected/tiny_fp32.h5 '"$out"'/tiny_fp32.h5 1e-4
  # the LM head in chunks of 7 rows (offset rows in the cross-entropy kernels) against the same
  DSTRAIN_LOSS_CHUNK_TOKENS=7 d --dump-grads '"$out"'/tiny_fp32_chunks.h5
  dstrain-ckpt compare-dumps '"$B"'/expected/tiny_fp32.h5 '"$out"'/tiny_fp32_chunks.h5 1e-4
  d --set bf16.enabled=true --dump-grads '"$out"'/tiny_bf16.h5
  dstrain-ckpt compare-dumps '"$B"'/expected/tiny_bf16.h5 '"$out"'/tiny_bf16.h5 5e-2
  d '"$tiny16"' --set bf16.enabled=true --dump-grads '"$out"'/tiny16_bf16.h5
  dstrain-ckpt compare-dumps '"$B"'/expected/tiny16_bf16.h5 '"$out"'/tiny16_bf16.h5 5e-2
  d '"$tiny16"' --dump-grads '"$out"'/tiny16_fp32.h5
  dstrain-ckpt compare-dumps '"$B"'/expected/tiny16_fp32.h5 '"$out"'/tiny16_fp32.h5 1e-4'

if [ $dev = cuda ]; then
  step nccl 25 'dstrain-nccl-check'
else
  step nccl 25 'dstrain-nccl-check; [ $? -eq 77 ]'
fi

# (50 steps on the GPU; 20 in the rehearsal, where the CPU trains small at a few thousand tokens/s)
train_steps=50
[ $dev = cpu ] && train_steps=20
FIGURES="^loss at|^first losses" step train 60 '
  set -e
  rm -rf /tmp/dstrain-gpu-train
  dstrain configs/small.yaml --set device=$dev --resume none --set train_steps='$train_steps' --set steps_per_print=1 \
    --set data.eval_interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir=/tmp/dstrain-gpu-train \
    --set monitor.metrics_file='"$out"'/train.jsonl --set monitor.tensorboard=null \
    --set monitor.trace='"$out"'/train.trace.json --set monitor.trace_steps=[10,11] | grep -E "step (1|10|20|30|40|50)/"
  losses() { grep -o "\"loss\":[-0-9.e+]*" "$1" | cut -d: -f2; }  # (no head: SIGPIPE under pipefail)
  first=$(losses '"$out"'/train.jsonl | sed -n 1p); last=$(losses '"$out"'/train.jsonl | tail -1)
  echo "loss at the first step: $first, at step '$train_steps': $last"
  # The first five steps against the CPU backend.
  paste <(losses '"$B"'/expected/small_losses.jsonl | sed -n 1,5p) <(losses '"$out"'/train.jsonl | sed -n 1,5p) |
    awk "{ d = \$2 - \$1; if (d < 0) d = -d; r = d / (\$1 < 0 ? -\$1 : \$1); if (r > w) w = r; n++;
           printf \"step %d: cpu %s, %s %s\\n\", n, \$1, \"'$dev'\", \$2 }
         END { printf \"first losses: %d steps, largest relative difference %.2e (tolerance 1e-3)\\n\", n, w;
               exit !(n == 5 && w <= 1e-3) }"
  awk -v a="$first" -v b="$last" "BEGIN { exit !(b < a - 0.5) }"'

dry=""
[ $dev = cpu ] && dry="--dry-run"
FIGURES="step 6/|peak|memory per rank|op time per step" step bench 60 '
  rm -rf /tmp/dstrain-gpu-bench
  dstrain configs/medium.yaml '"$dry"' --set device=$dev --resume none --set bf16.enabled=true --set train_steps=6 \
    --set train_batch_size=8 --set train_micro_batch_size_per_gpu=8 --set seq_length=2048 \
    --set steps_per_print=1 --set data.eval_interval=0 --set checkpoint.save_at_end=false \
    --set checkpoint.dir=/tmp/dstrain-gpu-bench --set monitor.peak_tflops=989 --set monitor.tensorboard=null \
    --set monitor.op_breakdown=true \
    | grep -E "step [0-9]+/|memory|backend|peak|micro-batch|tokens|op breakdown|op time per step|^  [a-z_0-9]+ +[0-9]" | tail -70'

# The preset that fills one H200 (DeepSeek-V2-Lite shapes, 8 layers), with whatever time is left.
FIGURES="step 4/|peak|memory per rank|op time per step" OPTIONAL=1 step h200 60 '
  rm -rf /tmp/dstrain-gpu-h200
  dstrain configs/h200.yaml '"$dry"' --set device=$dev --resume none --set train_steps=4 --set steps_per_print=1 \
    --set data.eval_interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir=/tmp/dstrain-gpu-h200 \
    --set monitor.peak_tflops=989 --set monitor.op_breakdown=true \
    --set monitor.tensorboard=null | grep -E "step [0-9]+/|memory|backend|peak|tokens|op breakdown|op time per step|^  [a-z_0-9]+ +[0-9]" | tail -70'

if [ $dev = cuda ] && [ $have_hf = 1 ]; then
  FIGURES="tokens/s|TFLOP" OPTIONAL=1 step hf 45 'python3 tools/gpu/hf_baseline.py configs/medium.yaml --batch 8 --seq 2048 --steps 6'
fi

# cuDNN's fused attention (and PyTorch's other SDPA kernels) at the shapes the kernels step timed
# dstrain's own attention on (tools/gpu/sdpa_baseline.py), if time is left.
if [ $dev = cuda ] && [ $have_torch = 1 ]; then
  FIGURES="ms|TFLOP" OPTIONAL=1 step sdpa 30 'set -e; python3 tools/gpu/sdpa_baseline.py
    python3 tools/gpu/sdpa_baseline.py --batch 8 --heads 12 --dqk 96 --dv 64  # medium'
fi

if [ -n "$failed" ]; then verdict="GPU check: failed:$failed"; else verdict="GPU check: every step passed"; fi
# One archive of everything, and the summary beside it: cut to 5,800 characters, the verdict
# always last (the summary must fit the 12,000 characters of output that come back).
tar -C "$out" -czf "$final/gpu-check.tar.gz" . 2>/dev/null || echo "cannot write $final/gpu-check.tar.gz" >&2
{ head -c 5800 "$summary"; [ "$(wc -c <"$summary")" -gt 5800 ] && echo " [summary cut]"; echo "$verdict"; } >"$final/summary.txt"
rm -rf "$out"
echo "==== summary (also $final/summary.txt; every log in $final/gpu-check.tar.gz)"
cat "$final/summary.txt"
exit $status
