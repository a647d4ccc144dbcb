#!/usr/bin/env bash
# Enforces the dependency direction of DESIGN §1 / STYLE §3.2 on includes:
#   kernels knows nothing of engine/; config and plan never see MPI, NCCL, comm or the model;
#   model never sees comm, parallel, runtime, MPI or NCCL; comm never sees plan or the model.
# With a build directory argument it also checks that the pure libraries reference no MPI
# symbol. Exits non-zero and names each offending line.
set -u
cd "$(dirname "$0")/.."
status=0

forbid() {  # forbid DIR PATTERN WHY
  local dir=$1 pattern=$2 why=$3
  [ -d "$dir" ] || return 0
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
forbid engine/parallel/zero 'engine/(model|comm|runtime)/|mpi\.h|nccl\.h|dstrain/kernels' 'model, comm, kernels, MPI or NCCL (pure math)'

if [ $# -ge 1 ]; then
  for lib in dstrain_common dstrain_config dstrain_plan dstrain_model dstrain_kernels_cpu; do
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
