#!/usr/bin/env bash
# Run the GPU test suite and the benchmarks on a CUDA machine, in one call, without network.
#
#   scripts/device.sh OUTDIR [all|tests|bench|bench:NAME[,NAME...]] [--quick] [-- PYTEST_ARGS...]
#
# bench:NAME,... runs only those benchmarks (quant, producers, gemm, attention, layer), e.g. bench:layer,gemm.
#
# Writes under OUTDIR: gpu-tests.xml (junit), gpu-tests.log, bench.log, results.tar.gz
# (benchmark/results JSON + PNG). Installs nothing: it runs from the source tree with the
# machine's python3 (torch, triton, numpy, safetensors, pytest, rich, tqdm, matplotlib).
#
# On an H200 the whole gpu suite takes ~12 minutes (Triton compilation dominates) and the full
# benchmark sweeps longer; where one call is limited to 10 minutes, split it, e.g.
#   scripts/device.sh $OUT tests -- test/kernels/test_quant.py test/kernels/test_norm.py ...
#   scripts/device.sh $OUT bench --quick
# The tree travels without its own git metadata (what git reports there can be an older commit):
# pass FP8CHAIN_COMMIT=<hash> so results name the commit they measured.
set -uo pipefail
out=${1:?usage: scripts/device.sh OUTDIR [all|tests|bench|bench:NAME[,NAME...]] [--quick] [-- PYTEST_ARGS...]}
shift
what=${1:-all}
[ $# -gt 0 ] && shift
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; shift; fi
[ "${1:-}" = "--" ] && shift
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
export PYTHONPATH="$root/python:$root/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
[ -z "${FP8CHAIN_COMMIT:-}" ] && echo "note: FP8CHAIN_COMMIT is not set; results name whatever commit git reports here" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/device.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
  python3 -m pytest -q -m gpu --durations=30 --junitxml="$out/gpu-tests.xml" -p no:cacheprovider "${@:-test}" \
    2>&1 | tee "$out/gpu-tests.log" | tail -n 40
  status=${PIPESTATUS[0]}
fi
benches=""
case "$what" in
  all|bench) benches=all ;;
  bench:*) benches=${what#bench:}; benches=${benches//,/ } ;;
esac
if [ -n "$benches" ]; then
  for name in $benches; do
    python3 -m fp8chain bench "$name" $quick --results-dir benchmark/results 2>&1 | tee -a "$out/bench.log" | tail -n 80
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  done
  tar czf "$out/results.tar.gz" benchmark/results
fi
exit $status
