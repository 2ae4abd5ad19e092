#!/usr/bin/env bash
# Plots bench/collectives --json output with gnuplot: bus bandwidth against bytes per rank
# (log-log), one line per backend, one panel per (op, world).
#
#   bazel run -c opt //bench:collectives -- --json > /tmp/collectives.jsonl
#   bench/plot_collectives.sh /tmp/collectives.jsonl [docs/img/collectives.svg]
# (or `-- --json-file /tmp/collectives.jsonl` to keep the tables on stdout as well).
#
# An output ending in .png is drawn with gnuplot's pngcairo terminal instead of svg.
#
# Reads stdin when the input is '-' or missing. Needs python3 (to split the JSON lines into
# gnuplot data files) and gnuplot (gnuplot-nox).
set -euo pipefail

in="${1:--}"
out="${2:-$(cd "$(dirname "$0")/.." && pwd)/docs/img/collectives.svg}"
for tool in python3 gnuplot; do
  command -v "$tool" >/dev/null || { echo "plot_collectives: $tool not found (tools/setup.sh installs it)" >&2; exit 2; }
done
tmp="$(mktemp -d "${TMPDIR:-/tmp}/plot_collectives.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# One file per (op, world, backend): "bytes busbw" sorted by size; panels.txt lists
# "op world [note]" in plot order, backends.txt the backends in a fixed order.
python3 - "$in" "$tmp" <<'PY'
import json, sys, collections
src, tmp = sys.argv[1], sys.argv[2]
lines = (sys.stdin if src == "-" else open(src)).read().splitlines()
series = collections.defaultdict(list)
oversubscribed = set()  # (op, world) panels whose ranks outnumbered the cores
for n, line in enumerate(lines, 1):
    if not line.strip():
        continue
    try:
        r = json.loads(line)
        series[(r["op"], int(r["world"]), r["backend"])].append((int(r["bytes_per_rank"]), float(r["busbw_GBps"])))
        if r.get("oversubscribed"):
            oversubscribed.add((r["op"], int(r["world"])))
    except (ValueError, KeyError) as e:
        sys.exit(f"plot_collectives: line {n} is not a collectives row ({e}): {line[:120]}")
if not series:
    sys.exit("plot_collectives: no rows in the input")
order = ["thread", "tcp", "tcp-socket", "gloo", "mpi"]
backends = sorted({b for _, _, b in series}, key=lambda b: (order.index(b) if b in order else len(order), b))
panels = sorted({(op, w) for op, w, _ in series}, key=lambda p: (p[0] != "all_gather", p[0], p[1]))
for (op, w, b), pts in series.items():
    with open(f"{tmp}/{op}_{w}_{b}.dat", "w") as f:
        f.writelines(f"{x} {y}\n" for x, y in sorted(pts))
open(f"{tmp}/panels.txt", "w").writelines(
    f"{op} {w}{' (more ranks than cores)' if (op, w) in oversubscribed else ''}\n" for op, w in panels)
open(f"{tmp}/backends.txt", "w").writelines(f"{b}\n" for b in backends)
sizes = [x for pts in series.values() for x, _ in pts]
open(f"{tmp}/xrange.txt", "w").write(f"{min(sizes)} {max(sizes)}\n")
PY

mapfile -t panels <"$tmp/panels.txt"
mapfile -t backends <"$tmp/backends.txt"
worlds=$(cut -d' ' -f2 "$tmp/panels.txt" | sort -un | wc -l)
ops=$(cut -d' ' -f1 "$tmp/panels.txt" | sort -u | wc -l)
read -r xmin xmax <"$tmp/xrange.txt"
declare -A color=([thread]="#7f7f7f" [tcp]="#d62728" [tcp-socket]="#ff9896" [gloo]="#1f77b4" [mpi]="#2ca02c")

{
  if [[ "$out" == *.png ]]; then
    echo "set terminal pngcairo size $((480 * worlds)),$((360 * ops)) font 'sans,10'"
  else
    echo "set terminal svg size $((480 * worlds)),$((360 * ops)) dynamic font 'sans,11' background '#ffffff'"
  fi
  echo "set termoption noenhanced"  # op names have underscores
  echo "set output '$out'"
  echo "set logscale xy 2"
  echo "set logscale y 10"
  echo "set format y '%g'"
  echo "set xtics ('1K' 1024, '4K' 4096, '16K' 16384, '64K' 65536, '256K' 262144, '1M' 1048576, '4M' 4194304, '16M' 16777216, '64M' 67108864, '256M' 268435456, '1G' 1073741824)"
  echo "set xrange [$xmin / 1.4 : $xmax * 1.4]"  # room for the end ticks
  echo "set xlabel 'bytes per rank'"
  echo "set ylabel 'bus bandwidth (GB/s)'"
  echo "set grid"
  echo "set key bottom right"
  echo "set multiplot layout $ops,$worlds title 'bench/collectives: f32, busbw = algbw (n-1)/n, higher is better'"
  for p in "${panels[@]}"; do
    read -r op world note <<<"$p"
    echo "set title '$op, $world ranks $note'"
    plot="plot"
    for b in "${backends[@]}"; do
      f="$tmp/${op}_${world}_${b}.dat"
      [[ -f "$f" ]] || continue
      plot+=" '$f' using 1:2 with linespoints lw 2 pt 7 ps 0.6 lc rgb '${color[$b]:-#9467bd}' title '$b',"
    done
    echo "${plot%,}"
  done
  echo "unset multiplot"
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
echo "plot_collectives: wrote $out (${#panels[@]} panels, backends: ${backends[*]})"
