#!/usr/bin/env bash
# The staging benchmark of two trees alternated on one machine, the order turned each round (A, B, B, A, A, B, ...)
# so that neither side always runs first after the other, each run from its own tree through
# PYTHONPATH, with nothing installed (an editable install's finder comes before PYTHONPATH, so an installed tree
# would run on both sides); each run's log says which package it imported.
#   [ROUNDS=N] bash benchmarks/ab_staging.sh OTHER_TREE OUTDIR [SECTIONS]   # OTHER_TREE: e.g. git archive of an older
#   commit; ROUNDS: pairs of runs (default 2)
set -u -o pipefail
other=$(cd "$1" && pwd)
out=$2
sections=${3:-copy_limits,small,pageable,duplex}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for round in $(seq "${ROUNDS:-2}"); do
  order="other this"
  [ $((round % 2)) = 0 ] && order="this other"
  for side in $order; do
    tree=$here
    [ "$side" = other ] && tree=$other
    (
      cd "$tree" || exit 1
      export PYTHONPATH="$tree" PYTHONUNBUFFERED=1 BENCH_COMMIT="$side"
      python3 -c 'import offload_shim; print("imports", offload_shim.__file__)'
      torchrun --nproc_per_node 1 benchmarks/bench_staging.py --quick --only "$sections" --out "$out/$side$round"
    ) >> "$out/ab.log" 2>&1
  done
done
