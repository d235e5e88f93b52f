#!/bin/bash
# One short CPU measurement: Envoy utime+stime for N msgs via relay module (19000) vs plain router (19001).
cd /tmp/dm-spike; PY=/work/main/.venv/bin/python
EP=$(cat envoy.pid); HZ=$(getconf CLK_TCK)
ticks() { awk '{print $14+$15}' /proc/$EP/stat; }
for port in 19001 19000 19001 19000; do
  $PY client.py 127.0.0.1:$port 50 0 1 >/dev/null   # warm connection
  t0=$(ticks); s0=$(date +%s.%N)
  out=$($PY client.py 127.0.0.1:$port 5000 0 4 | tail -1)
  t1=$(ticks); s1=$(date +%s.%N)
  echo "port=$port $out envoy_cpu_ms=$(( (t1-t0)*1000/HZ )) wall=$(echo "$s1-$s0"|bc) us_per_msg=$(echo "scale=2; ($t1-$t0)*1000000/$HZ/20000"|bc)"
done
