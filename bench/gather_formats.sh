#!/usr/bin/env bash
# What a block format on the wire buys and costs (issue 38, item 6): examples/train on TCP
# processes (--backend tcp: loopback sockets, one process per rank) once per all-gather
# format, --gather-dtype f32 (the baseline), bf16, fp8 (E4M3 blocks of 128), fp8e5m2 (E5M2
# blocks of 128), mxfp8, int8 (int8 blocks of 128), fp8tensor and fp8e5m2tensor (E4M3 or E5M2
# with one scale per parameter, agreed through an all-gather of each rank's amaxes: codes
# only on the wire), the runs interleaved (f32, bf16, ..., f32, bf16, ...) so the
# machine's load falls on every format alike. For each format it prints:
#   - the bytes of one step's all-gathers on rank 0 (the example's comm: line) and their
#     ratio to f32's (goal: at most 0.27 for fp8, fp8e5m2, mxfp8 and int8, scales included;
#     the per-tensor formats' codes 0.25 and their amaxes, 4 bytes per parameter and rank);
#   - the median wall time of a run and its ratio to f32's (the processes, their setup and
#     STEPS steps, of which the unsharded reference each rank also trains is the same for
#     every format);
#   - the final loss after STEPS steps and its deviation from f32's, relative (goal: within
#     1% for int8 and mxfp8 after 300 steps).
# Every run must end with the example's `final:` line, or the script fails.
#
# Usage: bench/gather_formats.sh [TRAIN_BINARY] [RUNS]   (default: bazel-bin/examples/train, 3)
# Or: bazel run -c opt //bench:gather_formats [-- RUNS]
# Model and job (environment): NPROC=4 STEPS=300 BLOCKS=8 DIM=256 HIDDEN=1024
# FORMATS="f32 bf16 fp8 fp8e5m2 mxfp8 int8 fp8tensor fp8e5m2tensor"
set -uo pipefail

[[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] && set -- "" "$1"  # RUNS alone
train=${1:-bazel-bin/examples/train}
if [[ -z ${1:-} && (-n ${RUNFILES_DIR:-} || -d "$0.runfiles") ]]; then  # bazel run: the train next to it
  train="${RUNFILES_DIR:-$0.runfiles}/fsdp/examples/train"
fi
runs=${2:-3}
nproc=${NPROC:-4} steps=${STEPS:-300}
read -r -a formats <<<"${FORMATS:-f32 bf16 fp8 fp8e5m2 mxfp8 int8 fp8tensor fp8e5m2tensor}"
model=(--blocks "${BLOCKS:-8}" --dim "${DIM:-256}" --hidden "${HIDDEN:-1024}")
[[ -x $train ]] || { echo "bench/gather_formats.sh: no train binary at '$train' (bazel build -c opt //examples:train)" >&2; exit 2; }
[[ $runs =~ ^[1-9][0-9]?$ ]] || { echo "bench/gather_formats.sh: RUNS must be 1..99, got '$runs'" >&2; exit 2; }
[[ ${formats[0]:-} == f32 ]] || { echo "bench/gather_formats.sh: FORMATS must start with f32 (the baseline)" >&2; exit 2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-gather-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# one FORMAT RUN: one training run; its output in $tmp/FORMAT.RUN.log, its wall seconds
# appended to $tmp/FORMAT.times.
one() {
  local format=$1 run=$2 start end
  start=$(date +%s.%N)
  timeout 900 "$train" "${model[@]}" --backend tcp --nproc "$nproc" --steps "$steps" --gather-dtype "$format" \
    >"$tmp/$format.$run.log" 2>&1
  local rc=$?
  end=$(date +%s.%N)
  if ((rc != 0)) || [[ -z $(final_loss "$tmp/$format.$run.log") ]]; then
    echo "bench/gather_formats.sh: --gather-dtype $format (run $run) failed (exit status $rc):" >&2
    tail -5 "$tmp/$format.$run.log" >&2
    exit 1
  fi
  echo "$end - $start" | bc -l >>"$tmp/$format.times"
}

median() { sort -g "$1" | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# The all-gather bytes of rank 0's last step: "[rank 0] comm: ... (all_gather 19 x, 547904 B; ...".
gather_bytes() { sed -n 's/^\[rank 0\] comm: .*(all_gather [0-9]* x, \([0-9]*\) B;.*/\1/p' "$1" | tail -n 1; }
final_loss() { sed -n 's/^\[rank 0\] final: loss=\([^ ]*\) .*/\1/p' "$1"; }

echo "examples/train ${model[*]} --backend tcp --nproc $nproc --steps $steps; $runs runs per format, interleaved"
for ((r = 1; r <= runs; ++r)); do
  for f in "${formats[@]}"; do one "$f" "$r"; done
done

base_bytes=$(gather_bytes "$tmp/f32.1.log") base_time=$(median "$tmp/f32.times") base_loss=$(final_loss "$tmp/f32.1.log")
printf '%-13s %14s %8s %10s %8s %12s %10s\n' format "gather B/step" ratio "median s" ratio "final loss" "vs f32"
for f in "${formats[@]}"; do
  bytes=$(gather_bytes "$tmp/$f.1.log") time=$(median "$tmp/$f.times") loss=$(final_loss "$tmp/$f.1.log")
  for ((r = 2; r <= runs; ++r)); do  # TCP's all-reduces sum in a fixed order: every run trains the same
    [[ $(final_loss "$tmp/$f.$r.log") == "$loss" ]] ||
      { echo "bench/gather_formats.sh: --gather-dtype $f: run $r ended at another loss than run 1" >&2; exit 1; }
  done
  printf '%-13s %14s %8.3f %10.2f %8.3f %12s %+9.2f%%\n' "$f" "$bytes" "$(echo "$bytes / $base_bytes" | bc -l)" "$time" \
    "$(echo "$time / $base_time" | bc -l)" "$loss" "$(echo "100 * ($loss - $base_loss) / $base_loss" | bc -l)"
done
