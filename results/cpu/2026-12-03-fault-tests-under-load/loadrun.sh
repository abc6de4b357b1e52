#!/bin/bash
# 20 runs of the short-timeout fault tests with two busy processes beside them (a 2-core machine fully loaded)
cd /work/main
out=results/cpu/2026-12-03-fault-tests-under-load
python3 -c "while True: pass" & b1=$!
python3 -c "while True: pass" & b2=$!
: > $out/runs.log
for i in $(seq 1 20); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -o addopts="" -p no:cacheprovider -W ignore tests/test_faults_cpu.py -k "async_error_surfaces or failed_handle_stays" > /tmp/loadrun_$i.log 2>&1
  echo "run $i rc=$? $(( $(date +%s) - start ))s $(tail -1 /tmp/loadrun_$i.log)" >> $out/runs.log
done
kill $b1 $b2
echo done >> $out/runs.log
