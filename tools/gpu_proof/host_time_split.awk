# Splits the library's host time per unit and step into CUDA / NCCL calls and the library's
# own code, from tools/gpu_proof/api_timer.so's report (its stderr) of a run of the CUDA
# example, for tools/gpu_proof.sh:
#   awk -v per=<units x timed steps> -v measured=<host us per unit step> -f host_time_split.awk LOG
# Only the calls made inside the example's calls into fsdp (region_calls, region_us) count.
# The timer's own cost per call, which api_timer measures (inside the timed interval, and
# outside it in the caller's time), is taken out of both shares and printed on its own. A
# report without that measurement (an older api_timer) takes out nothing.
/^api_timer: own cost per call / {
  split($6, a, "="); split($7, b, "=")
  inside = a[2]; outside = b[2]
  next
}
/^api_timer: / {
  split($7, c, "="); split($8, u, "=")
  if (c[2] > 0) {
    n = c[2] / per
    us = u[2] / per - n * inside / 1000
    printf "  %-26s %6.2f calls %7.2f us\n", $2, n, us
    total += us
    calls += n
  }
}
END {
  timer = calls * (inside + outside) / 1000
  printf "gpu proof: of the library host time per unit per step (%s us under the timer), %.2f us are CUDA and NCCL calls, %.2f us the library's own code, %.2f us the timer's own cost (%.1f calls at %.1f + %.1f ns, taken out of both)\n", measured, total, measured - total - timer, timer, calls, inside, outside
}
