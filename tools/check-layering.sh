#!/usr/bin/env bash
# Enforces the dependency direction of docs/design.md §1 on includes:
#   kernels knows nothing of engine/; config and plan never see MPI, NCCL, comm or the model;
#   model never sees comm, parallel, runtime, MPI or NCCL; comm never sees plan or the model;
#   io and data never see the model, parallelism, kernels (io: but the 16-bit conversions of
#   dstrain/kernels/half.h) or MPI; only the MPI implementation's own
#   headers include <mpi.h>.
# With a build directory argument it also checks that the pure libraries reference no MPI
# symbol. Exits non-zero and names each offending line.
set -u
cd "$(dirname "$0")/.."
status=0

forbid() {  # forbid DIR-OR-FILE PATTERN WHY
  local dir=$1 pattern=$2 why=$3
  [ -e "$dir" ] || { echo "layering: $dir does not exist (update tools/check-layering.sh)"; status=1; return 0; }
  local hits
  hits=$(grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]($pattern)" "$dir" \
           --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' || true)
  if [ -n "$hits" ]; then
    echo "layering: $dir must not include $why:"
    echo "$hits" | sed 's/^/  /'
    status=1
  fi
}

forbid kernels        'engine/'                                            'engine/ headers'
forbid engine/common  'engine/(config|plan|model|comm|parallel|runtime)/|mpi\.h|nccl\.h' 'higher layers, MPI or NCCL'
forbid engine/config  'engine/(plan|model|comm|parallel|runtime)/|mpi\.h|nccl\.h|dstrain/kernels' 'plan, model, comm, MPI or NCCL'
forbid engine/plan    'engine/(model|comm|parallel|runtime)/|mpi\.h|nccl\.h|dstrain/kernels' 'model, comm, kernels, MPI or NCCL'
forbid engine/model   'engine/(comm|parallel|runtime)/|mpi\.h|nccl\.h'     'comm, parallel, runtime, MPI or NCCL'
forbid engine/comm    'engine/(plan|model|parallel|runtime|config)/'       'plan, config, model, parallel or runtime'
forbid engine/parallel 'engine/runtime/'                                   'runtime'
for f in engine/parallel/zero/partition.h engine/parallel/zero/partition.cpp; do
  forbid $f 'engine/(model|comm|runtime|plan|config)/|mpi\.h|nccl\.h|dstrain/kernels' 'anything but common (pure math)'
done
# (io reads 16-bit tensors of other formats: it may use dstrain/kernels/half.h, the scalar conversions alone)
forbid engine/io      'engine/(config|plan|model|comm|parallel|runtime|data)/|mpi\.h|nccl\.h|dstrain/kernels/[^h]' 'config, plan, model, comm, parallel, runtime, data, kernels or MPI'
forbid engine/data    'engine/(plan|model|comm|parallel|runtime)/|mpi\.h|nccl\.h|dstrain/kernels' 'plan, model, comm, parallel, runtime, kernels or MPI'
forbid engine/runtime 'launcher/'                                          'the launcher'

# <mpi.h> stays behind engine/comm: no engine header includes it but the MPI implementation's.
hits=$(grep -rlE '^[[:space:]]*#[[:space:]]*include[[:space:]]*<mpi\.h>' engine --include='*.h' |
       grep -vE '^engine/comm/(mpi_check|mpi_communicator)\.h$' || true)
if [ -n "$hits" ]; then
  echo "layering: these engine headers include <mpi.h> (use engine/comm/process_groups.h or communicator.h):"
  echo "$hits" | sed 's/^/  /'
  status=1
fi

if [ $# -ge 1 ]; then
  for lib in dstrain_common dstrain_config dstrain_plan dstrain_model dstrain_kernels_cpu dstrain_io dstrain_data \
             dstrain_parallel_core; do
    a="$1/lib/lib$lib.a"
    [ -f "$a" ] || { echo "layering: $a not built"; status=1; continue; }
    if nm -u "$a" 2>/dev/null | grep -qE ' (P?MPI_|nccl)'; then
      echo "layering: $lib references MPI/NCCL symbols:"; nm -u "$a" | grep -E ' (P?MPI_|nccl)' | head | sed 's/^/  /'
      status=1
    fi
  done
fi

[ $status -eq 0 ] && echo "layering: ok"
exit $status
