#!/usr/bin/env bash
# One-command GPU proof, for a machine with a GPU, the CUDA toolkit and NCCL but no Bazel.
#
#   tools/gpu_proof.sh            # build, run the tests with FSDP_REQUIRE_GPU=1, run the benches
#   tools/gpu_proof.sh --build-only
#
# Builds the CUDA and NCCL test binaries, tools/gpu_proof/gpu_bench.cpp and the CUDA example
# engine (examples/cuda_train.cpp) with g++ straight from the headers, runs each test with
# FSDP_REQUIRE_GPU=1 (so a machine without a visible GPU fails instead of skipping), then
# the benches (CudaDevice copy/cast throughput, NcclComm all_gather/reduce_scatter bandwidth
# over sizes), then the example (its loss against the host reference engine, its step time
# with fsdp against without at world size 1, the library's host time per unit per step, and
# the same with the step captured into a CUDA graph: cuda_train --cuda-graph),
# then splits the library's host time per unit and step by CUDA and NCCL function (the
# example under tools/gpu_proof/api_timer.so, an LD_PRELOAD timer), then the libtorch
# adapter's example on CUDA tensors where a CUDA libtorch is found (below), and ends with
#   gpu proof: N passed, M failed
# counting doctest test cases (a binary that does not build counts as one failure).
# Exit status 0 only when nothing failed.
#
# Where things are found (first match wins):
#   CUDA:    $CUDA_HOME, the toolkit of the nvcc on PATH, /usr/local/cuda
#   NCCL:    $NCCL_HOME, Python's nvidia.nccl package (pip nvidia-nccl-cu*), the CUDA dir
#   doctest: $DOCTEST_INCLUDE, /usr/include, /usr/local/include, tools/gpu_proof/include
#            (a directory holding doctest/doctest.h)
#   Boost:   /usr/include or /usr/local/include; without it the NCCL test's two-process
#            case (which needs two GPUs anyway) is compiled out.
#   libtorch: $TORCH_HOME (a libtorch with include/ and lib/), or the one inside Python's
#            torch package (pip install torch: its headers and libraries are in the wheel),
#            if that one was built with CUDA; with CLI11 (CLI/CLI.hpp in /usr/include,
#            /usr/local/include or tools/gpu_proof/include) it builds examples/torch_train with -DFSDP_TORCH_CUDA and
#            runs it with --device cuda (the libtorch adapter on CUDA tensors, one rank,
#            against unsharded libtorch on the same GPU). Without either, those runs are skipped,
#            and said so.
# Output: build logs and binaries in ${GPU_PROOF_OUT:-/tmp/fsdp_gpu_proof}. Each test binary
# may run ${GPU_PROOF_TEST_TIMEOUT:-600} seconds.
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_PROOF_OUT:-/tmp/fsdp_gpu_proof}
mkdir -p "$OUT"
BUILD_ONLY=0
[ "${1:-}" = "--build-only" ] && BUILD_ONLY=1

die() { echo "gpu proof: $*" >&2; echo "gpu proof: 0 passed, 1 failed"; exit 1; }

# ---- locate the toolchain --------------------------------------------------------------
lib_dir_of() {  # the lib dir under $1 that holds a file matching $2 (lib64, lib, lib/x86_64-linux-gnu)
  for d in "$1/lib64" "$1/lib" "$1/lib/x86_64-linux-gnu" "$1/targets/x86_64-linux/lib"; do
    compgen -G "$d/$2" >/dev/null && { echo "$d"; return 0; }
  done
  return 1
}

CUDA=""
for c in "${CUDA_HOME:-}" "$(command -v nvcc >/dev/null 2>&1 && dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda; do
  [ -n "$c" ] && [ -f "$c/include/cuda_runtime.h" ] && { CUDA=$c; break; }
done
[ -n "$CUDA" ] || die "no CUDA toolkit found (cuda_runtime.h): set CUDA_HOME, or put nvcc on PATH"
CUDA_LIB=$(lib_dir_of "$CUDA" 'libcudart.so*') || die "no libcudart under $CUDA"
NVRTC_LIB=$(lib_dir_of "$CUDA" 'libnvrtc.so*') || die "no libnvrtc under $CUDA (CudaDevice compiles its kernels with NVRTC)"
CUBLAS_LIB=$(lib_dir_of "$CUDA" 'libcublas.so*') || die "no libcublas under $CUDA (the CUDA example's GEMMs)"

PY_NCCL=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if getattr(m, "__file__", None) else list(m.__path__)[0])' 2>/dev/null || true)
NCCL=""
for c in "${NCCL_HOME:-}" "$PY_NCCL" "$CUDA" /usr; do
  [ -n "$c" ] && [ -f "$c/include/nccl.h" ] && lib_dir_of "$c" 'libnccl.so*' >/dev/null && { NCCL=$c; break; }
done
[ -n "$NCCL" ] || die "no NCCL found (nccl.h + libnccl.so*): set NCCL_HOME, or pip install nvidia-nccl-cu13"
NCCL_LIB=$(lib_dir_of "$NCCL" 'libnccl.so*')
NCCL_VERSION=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$NCCL/include/nccl.h" | paste -sd. -)

DOCTEST=""
for c in "${DOCTEST_INCLUDE:-}" /usr/include /usr/local/include tools/gpu_proof/include; do
  [ -n "$c" ] && [ -f "$c/doctest/doctest.h" ] && { DOCTEST=$c; break; }
done
[ -n "$DOCTEST" ] || die "doctest/doctest.h not found. It is one header (MIT): install doctest-dev, or copy
  /usr/include/doctest/doctest.h from a machine that has it to tools/gpu_proof/include/doctest/doctest.h
  (or set DOCTEST_INCLUDE to the directory above doctest/)."

CXX=${CXX:-g++}
command -v "$CXX" >/dev/null || die "no C++ compiler ($CXX); set CXX to a C++20 compiler (g++ >= 11)"

# libfoo.so, or only libfoo.so.N as pip wheels ship: link the name that exists.
link_flag() {
  if [ -e "$1/lib$2.so" ]; then echo "-l$2"; else echo "-l:$(basename "$(ls "$1"/lib"$2".so.* | head -1)")"; fi
}
LIBS=(-L"$CUDA_LIB" -L"$NVRTC_LIB" -L"$NCCL_LIB" -L"$CUBLAS_LIB" -Wl,-rpath,"$CUDA_LIB" -Wl,-rpath,"$NVRTC_LIB"
      -Wl,-rpath,"$NCCL_LIB" -Wl,-rpath,"$CUBLAS_LIB" "$(link_flag "$NCCL_LIB" nccl)" "$(link_flag "$CUDA_LIB" cudart)"
      "$(link_flag "$NVRTC_LIB" nvrtc)" "$(link_flag "$CUBLAS_LIB" cublas)" -pthread -ldl)
INCLUDES=(-Iinclude -I. -I"$CUDA/include" -I"$NCCL/include" -I"$DOCTEST")
[ -d "$CUDA/include/cccl" ] && INCLUDES+=(-I"$CUDA/include/cccl")
CXXFLAGS=(-std=c++20 -O2 -g -Wall -Wextra)

echo "gpu proof: CUDA $CUDA (libs $CUDA_LIB), NCCL $NCCL_VERSION at $NCCL, doctest $DOCTEST, $($CXX --version | head -1)"
if [ -f /usr/include/boost/asio.hpp ] || [ -f /usr/local/include/boost/asio.hpp ]; then
  echo "gpu proof: Boost found: the NCCL test's two-process case is built (it runs with >= 2 GPUs)"
else
  echo "gpu proof: no Boost: the NCCL test's two-process case is compiled out"
fi

# ---- build (in parallel) ---------------------------------------------------------------
TESTS=(test/cuda/cuda_kernels_test.cpp test/cuda/zero_spans_test.cpp test/cuda/kernel_cache_test.cpp test/cuda/cuda_device_test.cpp test/cuda/cuda_sharded_test.cpp
       test/cuda/cuda_thread_comm_test.cpp
       test/nccl/nccl_comm_test.cpp test/nccl/nccl_streams_test.cpp test/examples_cuda/cuda_engine_test.cpp)
build() {  # build <name> <sources...>
  local name=$1; shift
  if "$CXX" "${CXXFLAGS[@]}" "${INCLUDES[@]}" "$@" -o "$OUT/$name" "${LIBS[@]}" >"$OUT/$name.build.log" 2>&1; then
    echo ok >"$OUT/$name.build"
  else
    echo failed >"$OUT/$name.build"
  fi
}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
for t in "${TESTS[@]}"; do
  build "$(basename "$t" .cpp)" "$t" test/doctest_main.cpp &
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
done
build gpu_bench tools/gpu_proof/gpu_bench.cpp &
# The LD_PRELOAD timer of CUDA and NCCL calls (no libraries linked: it forwards to the program's).
( if "$CXX" -std=c++20 -O2 -shared -fPIC "${INCLUDES[@]}" tools/gpu_proof/api_timer.cpp -o "$OUT/api_timer.so" -ldl \
     >"$OUT/api_timer.build.log" 2>&1; then echo ok; else echo failed; fi >"$OUT/api_timer.build" ) &
build cuda_kernel_compile bench/cuda_kernel_compile.cpp &
build cuda_train examples/cuda_train.cpp &

# The libtorch adapter on CUDA: examples/torch_train against a CUDA libtorch.
TORCH=""; TORCH_WHY=""
if [ -n "${TORCH_HOME:-}" ]; then TORCH=$TORCH_HOME
else TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__) if torch.version.cuda else "")' 2>/dev/null || true)
fi
# The C++11 ABI libtorch was built with (its CMake config says; else Python's torch), and
# the CUDA it was built for, against the toolkit found above (two CUDA runtimes in one
# process are a warning, not a stop).
TORCH_ABI=$(sed -n 's/.*-D_GLIBCXX_USE_CXX11_ABI=\([01]\).*/\1/p' "$TORCH/share/cmake/Torch/TorchConfig.cmake" 2>/dev/null | head -1)
[ -n "$TORCH_ABI" ] || TORCH_ABI=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)
TORCH_CUDA=$(python3 -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
CLI11=""
for c in /usr/include /usr/local/include tools/gpu_proof/include; do [ -f "$c/CLI/CLI.hpp" ] && { CLI11=$c; break; }; done
if [ -z "$TORCH" ] || [ ! -f "$TORCH/include/torch/csrc/api/include/torch/torch.h" ]; then
  TORCH_WHY="no libtorch built with CUDA (set TORCH_HOME, or pip install torch with CUDA)"
elif ! compgen -G "$TORCH/lib/libtorch_cuda.so*" >/dev/null; then
  TORCH_WHY="the libtorch at $TORCH has no libtorch_cuda (a CPU-only build)"
elif [ -z "$CLI11" ]; then
  TORCH_WHY="no CLI11 (CLI/CLI.hpp: apt install libcli11-dev, or copy /usr/include/CLI to tools/gpu_proof/include/CLI), which examples/torch_train parses its flags with"
else
  echo "gpu proof: libtorch $TORCH (C++11 ABI $TORCH_ABI, CUDA ${TORCH_CUDA:-unknown}): building examples/torch_train with -DFSDP_TORCH_CUDA"
  toolkit_cuda=$(sed -n 's/^#define CUDART_VERSION  *\([0-9][0-9]*\).*/\1/p' "$CUDA/include/cuda_runtime_api.h" | head -1)
  if [ -n "$TORCH_CUDA" ] && [ -n "$toolkit_cuda" ] && [ "${TORCH_CUDA%%.*}" != "$((toolkit_cuda / 1000))" ]; then
    echo "gpu proof: WARNING: libtorch is built for CUDA $TORCH_CUDA, the toolkit at $CUDA is CUDA $((toolkit_cuda / 1000)): two CUDA runtimes in one process (set CUDA_HOME to a CUDA $TORCH_CUDA toolkit if the runs fail)"
  fi
  ( if "$CXX" -std=c++20 -O2 -DFSDP_TORCH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$TORCH_ABI" -Iinclude -I. -I"$CLI11" \
       -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include" -I"$CUDA/include" -I"$NCCL/include" \
       examples/torch_train.cpp -o "$OUT/torch_train" -L"$TORCH/lib" -Wl,-rpath,"$TORCH/lib" \
       -Wl,--no-as-needed -ltorch_cuda -ltorch -Wl,--as-needed -ltorch_cpu -lc10_cuda -lc10 "${LIBS[@]}" \
       >"$OUT/torch_train.build.log" 2>&1; then echo ok; else echo failed; fi >"$OUT/torch_train.build" ) &
fi
wait
[ -n "$TORCH_WHY" ] && echo "gpu proof: the libtorch adapter's CUDA runs are skipped: $TORCH_WHY"

passed=0; failed=0; skipped=0
for t in "${TESTS[@]}" gpu_bench cuda_kernel_compile cuda_train; do
  name=$(basename "$t" .cpp)
  if [ "$(cat "$OUT/$name.build" 2>/dev/null)" != ok ]; then
    echo "BUILD FAILED: $name (log: $OUT/$name.build.log)"; tail -20 "$OUT/$name.build.log" | sed 's/^/    /'
    failed=$((failed + 1))
  else
    echo "built: $OUT/$name"
  fi
done
if [ -f "$OUT/torch_train.build" ]; then
  if [ "$(cat "$OUT/torch_train.build")" = ok ]; then echo "built: $OUT/torch_train"; else
    echo "BUILD FAILED: torch_train (log: $OUT/torch_train.build.log)"; tail -20 "$OUT/torch_train.build.log" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
fi
if [ "$BUILD_ONLY" = 1 ]; then echo "gpu proof: built only; $failed build failures"; exit $((failed > 0)); fi

# ---- tests ------------------------------------------------------------------------------
echo
echo "== tests (FSDP_REQUIRE_GPU=1) =="
for t in "${TESTS[@]}"; do
  name=$(basename "$t" .cpp)
  [ -x "$OUT/$name" ] && [ "$(cat "$OUT/$name.build")" = ok ] || continue
  FSDP_REQUIRE_GPU=1 timeout "${GPU_PROOF_TEST_TIMEOUT:-600}" "$OUT/$name" --no-version >"$OUT/$name.log" 2>&1
  rc=$?
  summary=$(grep -E '^\[doctest\] test cases:' "$OUT/$name.log" | tail -1)
  p=$(echo "$summary" | sed -n 's/.*| *\([0-9]*\) passed.*/\1/p')
  f=$(echo "$summary" | sed -n 's/.*| *\([0-9]*\) failed.*/\1/p')
  s=$(echo "$summary" | sed -n 's/.*| *\([0-9]*\) skipped.*/\1/p')
  p=${p:-0}; f=${f:-0}; s=${s:-0}
  [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1  # crashed or timed out before its summary
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
  printf '%-22s rc=%-3s %3s passed %3s failed %3s skipped\n' "$name" "$rc" "$p" "$f" "$s"
  if [ "$rc" -ne 0 ]; then
    if grep -q 'FSDP_REQUIRE_GPU=1: a GPU is visible' "$OUT/$name.log" && grep -q 'ERROR: CHECK( fsdp::cuda_device_count() > 0 )' "$OUT/$name.log"; then
      echo "    no GPU visible: FSDP_REQUIRE_GPU=1 failed this binary; its GPU cases were skipped"
    fi
    grep -E 'ERROR|error:|fatal' "$OUT/$name.log" | head -8 | sed 's/^/    /'
    echo "    full log: $OUT/$name.log"
  fi
done

# ---- benches ----------------------------------------------------------------------------
echo
echo "== benches =="
if [ -x "$OUT/gpu_bench" ] && [ "$(cat "$OUT/gpu_bench.build")" = ok ]; then
  timeout 600 "$OUT/gpu_bench" 2>&1 | tee "$OUT/gpu_bench.log"
  brc=${PIPESTATUS[0]}
  if [ "$brc" -eq 2 ]; then echo "benches not run: no GPU visible"
  elif [ "$brc" -ne 0 ]; then echo "bench FAILED (rc=$brc)"; failed=$((failed + 1)); fi
fi
if [ -x "$OUT/cuda_kernel_compile" ] && [ "$(cat "$OUT/cuda_kernel_compile.build")" = ok ]; then
  echo "-- kernel first-use cost (NVRTC compile vs on-disk cache) --"
  timeout 300 "$OUT/cuda_kernel_compile" --runs 5 2>&1 | tee "$OUT/cuda_kernel_compile.log"
  [ "${PIPESTATUS[0]}" -ne 0 ] && { echo "kernel compile bench FAILED"; failed=$((failed + 1)); }
fi

# ---- the CUDA example engine ------------------------------------------------------------
# Small model: every mode must match the host reference engine ("parity: ok"). --bench: a
# model big enough for GEMMs to dominate, with and without fsdp, for the step-time ratio.
echo
echo "== CUDA example (examples/cuda_train) =="
summary_field() {  # summary_field <log> <key>: a key=value of its `summary:` line
  sed -n "s/^summary: .* $2=\([^ ]*\).*/\1/p" "$1" | tail -1
}
example_ran=0
if [ -x "$OUT/cuda_train" ] && [ "$(cat "$OUT/cuda_train.build")" = ok ]; then
  example_ran=1
  for run in "fsdp_bf16:" "fsdp_f32:--precision f32" "fsdp_offload:--offload" "no_fsdp_bf16:--no-fsdp" \
             "graph_bf16:--cuda-graph" "graph_f32:--cuda-graph --precision f32" \
             "bench_fsdp:--bench" "bench_no_fsdp:--bench --no-fsdp" "bench_graph:--bench --cuda-graph"; do
    name=${run%%:*}; flags=${run#*:}
    # shellcheck disable=SC2086  # flags is a list
    FSDP_REQUIRE_GPU=1 timeout 600 "$OUT/cuda_train" $flags >"$OUT/cuda_train.$name.log" 2>&1
    rc=$?
    if grep -q 'FSDP_REQUIRE_GPU=1 but no CUDA GPU' "$OUT/cuda_train.$name.log"; then
      echo "CUDA example not run: no GPU visible (FSDP_REQUIRE_GPU=1 failed it)"; failed=$((failed + 1)); example_ran=0; break
    fi
    if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    printf '%-14s rc=%-3s %s\n' "$name" "$rc" "$(grep -E '^(parity|step time):' "$OUT/cuda_train.$name.log" | paste -sd';' -)"
    [ "$rc" -ne 0 ] && { grep -E 'error|FAILED' "$OUT/cuda_train.$name.log" | head -5 | sed 's/^/    /'; echo "    full log: $OUT/cuda_train.$name.log"; }
  done
fi

echo
if [ "$example_ran" = 1 ]; then
  for name in fsdp_bf16 fsdp_f32 fsdp_offload no_fsdp_bf16 graph_bf16 graph_f32; do
    log="$OUT/cuda_train.$name.log"
    echo "gpu proof: example loss vs host reference ($name): parity $(summary_field "$log" parity), largest relative difference $(summary_field "$log" max_rel_diff) (tolerance $(summary_field "$log" tolerance)), final loss $(summary_field "$log" final_loss)"
  done
  fsdp_ms=$(summary_field "$OUT/cuda_train.bench_fsdp.log" step_ms)
  plain_ms=$(summary_field "$OUT/cuda_train.bench_no_fsdp.log" step_ms)
  if [ -n "$fsdp_ms" ] && [ -n "$plain_ms" ]; then
    echo "gpu proof: example step time at world size 1 (bf16, --bench): fsdp $fsdp_ms ms / no fsdp $plain_ms ms = $(awk -v a="$fsdp_ms" -v b="$plain_ms" 'BEGIN { printf "%.3f", a / b }')x (goal <= 1.03x)"
  fi
  for name in bench_fsdp fsdp_bf16 fsdp_offload; do
    us=$(summary_field "$OUT/cuda_train.$name.log" host_us_per_unit_step)
    [ -n "$us" ] && echo "gpu proof: library host time per unit per step ($name): $us us (goal <= 20 us; hooks and zero_grad, CUDA and NCCL calls included)"
  done
  # A captured step (fsdp::CapturedStep): the host time is zero_grad and the replay's launch.
  for name in bench_graph graph_bf16 graph_f32; do
    us=$(summary_field "$OUT/cuda_train.$name.log" host_us_per_unit_step)
    [ -n "$us" ] && echo "gpu proof: library host time per unit per step with a CUDA graph ($name): $us us (goal <= 5 us; zero_grad and cudaGraphLaunch included)"
  done
  graph_ms=$(summary_field "$OUT/cuda_train.bench_graph.log" step_ms)
  if [ -n "$graph_ms" ] && [ -n "$plain_ms" ]; then
    echo "gpu proof: example step time with a CUDA graph (bf16, --bench --cuda-graph): $graph_ms ms / no fsdp $plain_ms ms = $(awk -v a="$graph_ms" -v b="$plain_ms" 'BEGIN { printf "%.3f", a / b }')x"
  fi
fi
# Where the library's host time goes: the example (small model, then --bench) under
# tools/gpu_proof/api_timer.so, which counts the CUDA and NCCL calls made inside the
# example's calls into fsdp in its timed steps; per unit and step, by function.
if [ "$example_ran" = 1 ] && [ "$(cat "$OUT/api_timer.build" 2>/dev/null)" = ok ]; then
  for run in "small:--no-reference --steps 102 --warmup 2" "bench:--bench --steps 25 --warmup 5"; do
    name=${run%%:*}; flags=${run#*:}
    # shellcheck disable=SC2086  # flags is a list
    LD_PRELOAD="$OUT/api_timer.so" timeout 300 "$OUT/cuda_train" $flags >"$OUT/api.$name.out" 2>"$OUT/api.$name.log"
    units=$(sed -n 's/.*(\([0-9]*\) units.*/\1/p' "$OUT/api.$name.out" | tail -1)
    timed=$(sed -n 's/^step time: .*mean of \([0-9]*\) steps.*/\1/p' "$OUT/api.$name.out" | tail -1)
    measured=$(summary_field "$OUT/api.$name.out" host_us_per_unit_step)
    echo
    echo "== library host time per unit per step in CUDA / NCCL calls ($name: $units units, $timed timed steps) =="
    awk -v per="$(( ${units:-1} * ${timed:-1} ))" -v measured="${measured:-0}" -f tools/gpu_proof/host_time_split.awk \
      "$OUT/api.$name.log"
  done
fi

# ---- the libtorch adapter on CUDA tensors -----------------------------------------------
# examples/torch_train --device cuda: one rank on GPU 0 (a one-rank NcclComm, fsdp's work on
# a stream of torch's pool), against unsharded libtorch on the same GPU. fp32 runs:
# the losses within 1e-4 and the parameters within 1e-4; bf16: the loss within 1% (as the
# CPU test, test/torch/torch_train_test.sh, asks on CPU at 2e-6 and 1e-5).
echo
echo "== libtorch adapter on CUDA (examples/torch_train --device cuda) =="
torch_field() { grep '^final: ' "$1" | tail -n 1 | tr ' ' '\n' | sed -n "s/^$2=//p"; }
if [ -n "$TORCH_WHY" ]; then
  echo "not run: $TORCH_WHY"; skipped=$((skipped + 1))
elif [ "$(cat "$OUT/torch_train.build" 2>/dev/null)" != ok ]; then
  echo "not run: the build failed (counted above)"
else
  for run in "full_shard:" "shard_grad_op:--strategy SHARD_GRAD_OP" "no_shard:--strategy NO_SHARD" \
             "offload:--offload" "sgd_accumulate:--optimizer sgd --accumulate 3" "bf16:--precision bf16" \
             "bf16_offload:--precision bf16 --offload"; do
    name=${run%%:*}; flags=${run#*:}
    # shellcheck disable=SC2086  # flags is a list
    timeout 600 "$OUT/torch_train" --device cuda $flags >"$OUT/torch_train.$name.log" 2>&1
    rc=$?
    l=$(torch_field "$OUT/torch_train.$name.log" loss); u=$(torch_field "$OUT/torch_train.$name.log" unsharded_loss)
    d=$(torch_field "$OUT/torch_train.$name.log" max_param_diff)
    case $name in bf16*) tol="l - u <= 0.01 * u && u - l <= 0.01 * u" ;; *) tol="l - u <= 1e-4 && u - l <= 1e-4 && d < 1e-4" ;; esac
    if [ "$rc" -eq 0 ] && [ -n "$l" ] && [ -n "$u" ] && awk -v l="$l" -v u="$u" -v d="${d:-1}" "BEGIN { exit !($tol) }"; then
      passed=$((passed + 1)); verdict=ok
    else
      failed=$((failed + 1)); verdict=FAILED
    fi
    printf '%-15s rc=%-3s %-6s %s\n' "$name" "$rc" "$verdict" "$(grep '^final: ' "$OUT/torch_train.$name.log" | tail -n 1)"
    [ "$verdict" = ok ] || { tail -n 5 "$OUT/torch_train.$name.log" | sed 's/^/    /'; echo "    full log: $OUT/torch_train.$name.log"; }
  done
fi

# Skipped cases never count as passed. The NCCL tests' child-process entry points are always
# among them; the others are GPU cases the machine could not run (two-GPU ones on one GPU).
[ "$skipped" -gt 0 ] && echo "gpu proof: $skipped test cases skipped (the NCCL tests' child-process entry points, two-GPU cases on a one-GPU machine, no GPU, or no CUDA libtorch for the adapter's runs)"
echo "gpu proof: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
