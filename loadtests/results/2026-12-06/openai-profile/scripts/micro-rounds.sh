#!/bin/bash
# Interleaved rounds of micro.py and micro_engine.py in each tree named (before head after ...).
for i in 1 2 3 4 5; do
  for t in "$@"; do
    cd /tmp/wt-$t || continue
    PYTHONPATH=/tmp/wt-$t/services:/tmp/wt-$t timeout 300 .venv/bin/python /tmp/prof/micro.py 600 32 2>&1 | grep "µs/token" | sed "s/^/$t /"
    PYTHONPATH=/tmp/wt-$t/services:/tmp/wt-$t timeout 300 .venv/bin/python /tmp/prof/micro_engine.py 600 2>&1 | grep "µs/token" | sed "s/^/$t /"
  done
done
