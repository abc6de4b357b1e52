#!/bin/bash
R=$OUT/r; mkdir -p $R
python3 -m pip install --no-build-isolation --no-deps -e . > $R/install.log 2>&1
for i in 1 2 3 4; do for side in A B; do
  cp .ab/exec_$side.py offload_shim/_execute.py
  t0=$(date +%s); torchrun --nproc_per_node 1 benchmarks/bench_staging.py --quick --only async --out $R/$side$i > $R/$side$i.log 2>&1; echo "$side$i rc=$? $(( $(date +%s) - t0 ))s" >> $R/steps.log
done; done
cp .ab/exec_B.py offload_shim/_execute.py
python3 -m pytest -o addopts="" -m gpu -q -rfE tests/test_one_gpu.py -k "async" > $R/tests_B.log 2>&1; echo "tests_B rc=$?" >> $R/steps.log
cd $OUT && tar czf r.tgz r
