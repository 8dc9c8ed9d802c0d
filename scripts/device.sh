#!/usr/bin/env bash
# Run the GPU test suite and the benchmarks on a CUDA machine, in one call, without network.
#
#   scripts/device.sh OUTDIR [all|tests|bench|bench:NAME[,NAME...]] [--quick] [--jobs N] [-- PYTEST_ARGS...]
#
# bench:NAME,... runs only those benchmarks (quant, producers, gemm, attention, layer), e.g. bench:layer,gemm.
# --jobs N runs the selected gpu tests in N pytest processes at once on the one GPU (the tests dealt
# in turn, each file's spread over the processes); PYTEST_ARGS that are not paths (options) go to
# every process and to the collection.
#
# Writes under OUTDIR: device.txt (the GPU, and `fp8chain info`: the torch and Triton the run
# imports), gpu-tests.xml (junit) and gpu-tests.log (gpu-tests-K.* per process with --jobs),
# bench.log, results.tar.gz (the JSON, PNG and markdown this run's benchmarks wrote under
# benchmark/results). Installs nothing: it runs from the source tree with the machine's python3
# (torch, triton, numpy, safetensors, pytest, rich, tqdm, matplotlib).
#
# On an H200 the whole gpu suite takes ~12 minutes in one process (Triton compilation dominates).
# On an H100 (2026-12-07, 16 CPU cores) `tests --jobs 12` took 98-188 s a process (662 tests, 55-56
# each) and 211 s for the whole call with `fp8chain verify` beside it. The full benchmark sweeps
# take longer: `fp8chain bench layer --rows 1 2 4 8 16 64 --prefill 0 --no-routed` (both shapes,
# the compiled peer compiled afresh per M) ran past 300 s on a fresh H100. Where one call is
# limited to 10 minutes, split the work, e.g.
#   scripts/device.sh $OUT tests --jobs 12
#   scripts/device.sh $OUT bench:layer,producers
# The tree travels without its own git metadata (what git reports there can be an older commit):
# pass FP8CHAIN_COMMIT=<hash> so results name the commit they measured. Under another Triton than
# the machine's: PYTHONPATH=<folder holding its triton package> scripts/device.sh ... (PYTHONPATH
# comes after the source tree and before site-packages; docs/benchmarks.md, "Triton 3.8").
set -uo pipefail
usage="usage: scripts/device.sh OUTDIR [all|tests|bench|bench:NAME[,NAME...]] [--quick] [--jobs N] [-- PYTEST_ARGS...]"
out=${1:?$usage}
shift
what=all  # the default mode, also where an option comes first (OUTDIR --quick)
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then what=$1; shift; fi
case "$what" in
  all|tests|bench|bench:?*) ;;
  *) echo "unknown mode '$what'" >&2; echo "$usage" >&2; exit 2 ;;
esac
quick=""
jobs=1
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="--quick"; shift ;;
    --jobs) jobs=${2:?$usage}; shift 2 ;;
    --) shift; break ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
case "$jobs" in ''|*[!0-9]*|0) echo "--jobs takes a positive integer, got '$jobs'" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
export PYTHONPATH="$root/python:$root/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
[ -z "${FP8CHAIN_COMMIT:-}" ] && echo "note: FP8CHAIN_COMMIT is not set; results name whatever commit git reports here" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/device.txt"
# the torch and Triton this run imports (PYTHONPATH may put another Triton first) and the launch
# choices that depend on them
python3 -m fp8chain info 2>&1 | tee -a "$out/device.txt"

# pytest -m gpu over the given files; exit status 5 (no test selected) counts as success.
run_gpu_tests() {
  local name=$1; shift
  python3 -m pytest -q -m gpu --durations=30 --junitxml="$out/$name.xml" -p no:cacheprovider "$@" \
    > "$out/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 5 ] && rc=0
  return "$rc"
}

if [ "$what" = all ] || [ "$what" = tests ]; then
  if [ "$jobs" -eq 1 ]; then
    run_gpu_tests gpu-tests "${@:-test}"
    status=$?
    tail -n 40 "$out/gpu-tests.log"
  else
    options=() paths=()
    for arg in "${@:-test}"; do
      if [ -e "$arg" ]; then paths+=("$arg"); else options+=("$arg"); fi
    done
    [ "${#paths[@]}" -eq 0 ] && paths=(test)
    # the selected tests, dealt one by one in turn: a file's tests spread over the processes, so
    # no file with many slow tests (test_gemm.py) holds one process past the others
    python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider "${options[@]}" "${paths[@]}" \
      > "$out/gpu-tests-collected.txt" 2>&1
    collected=$?
    # the ids come first, one a line, up to the first blank line (the summary and warnings follow)
    mapfile -t ids < <(sed '/^$/q' "$out/gpu-tests-collected.txt" | grep '::')
    if [ "$collected" -ne 0 ] && [ "$collected" -ne 5 ]; then
      echo "collecting the gpu tests failed (pytest exit $collected); running the ${#ids[@]} collected" >&2
      tail -n 20 "$out/gpu-tests-collected.txt" >&2
      status=1
    elif [ "${#ids[@]}" -eq 0 ]; then
      echo "no gpu test collected under: ${paths[*]}" >&2
      status=1
    fi
    pids=()
    for ((k = 0; k < jobs && k < ${#ids[@]}; k++)); do
      share=()
      for ((i = k; i < ${#ids[@]}; i += jobs)); do share+=("${ids[i]}"); done
      run_gpu_tests "gpu-tests-$k" "${options[@]}" "${share[@]}" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    for ((k = 0; k < jobs; k++)); do
      [ -f "$out/gpu-tests-$k.log" ] && { echo "== process $k"; tail -n 3 "$out/gpu-tests-$k.log"; }
    done
  fi
fi
benches=""
case "$what" in
  all|bench) benches=all ;;
  bench:*) benches=${what#bench:}; benches=${benches//,/ } ;;
esac
if [ -n "$benches" ]; then
  started="$out/.bench-started"
  touch "$started"
  for name in $benches; do
    python3 -m fp8chain bench "$name" $quick --results-dir benchmark/results 2>&1 | tee -a "$out/bench.log" | tail -n 80
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  done
  # only what this run wrote (the tree carries every earlier result too)
  find benchmark/results -type f -newer "$started" > "$out/.bench-written"
  if [ -s "$out/.bench-written" ]; then
    tar czf "$out/results.tar.gz" -T "$out/.bench-written"
  else
    echo "no benchmark wrote a result" >&2
    status=1
  fi
  rm -f "$started" "$out/.bench-written"
fi
exit $status
