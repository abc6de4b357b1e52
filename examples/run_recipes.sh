#!/usr/bin/env bash
# The framework recipes of examples/recipes/, each run without the shim and with OFFLOAD_SHIM=1 (NPROC accelerators):
#   bash examples/run_recipes.sh OUTDIR [NPROC]          # NPROC: 2 by default; 1 works too
# Writes two files: OUTDIR/recipes.log (versions, then every run's output between "=== run NAME" lines) and
# OUTDIR/recipes.json (per run: command, exit code, expected and actual outcome, whether they match, torch's error
# and where in the recipe it was raised, the figures of the recipe's RESULT line; the Gloo-against-shim time ratios).
# Expected: without the shim, rl_weight_sync and the metric recipes (accelerate_metrics, lightning_sync_dist,
# torchmetrics_cpu, broadcast_size) fail with torch's "No backend type associated with device type cpu" (or NCCL's
# "Tensors must be CUDA and dense");
# accelerate_fsdp2, lightning_fsdp2 and dcp_fsdp2 fail with it on 2 ranks or more and pass on one (DTensor runs no
# collective on a one-rank mesh); accelerate_launch_env and rl_weight_sync --backend cpu:gloo,cuda:nccl pass over
# Gloo, timed. With OFFLOAD_SHIM=1 every run passes. Installs nothing: offload_shim must be installed (its
# torch.backends entry point is what OFFLOAD_SHIM=1 switches on). ONLY="dcp_fsdp2 ..." runs some recipes;
# RECIPE_TIMEOUT (seconds, default 300) bounds each run. Exits 1 if some run's outcome was not the expected one.
set -u -o pipefail
out=${1:?usage: bash examples/run_recipes.sh OUTDIR [NPROC]}
nproc=${2:-2}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
runs=$(mktemp -d)
log="$out/recipes.log"
export PYTHONUNBUFFERED=1
dtensor=$([ "$nproc" -ge 2 ] && echo fail || echo ok)  # DTensor's collectives: none on a one-rank mesh

{
  echo "run_recipes.sh, $(date -u), commit $(git rev-parse --short HEAD 2>/dev/null), NPROC $nproc"
  python3 - <<'PY'
import importlib.metadata as m
for name in ("torch", "accelerate", "transformers", "lightning", "torchmetrics", "wrapt", "offload_shim"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "not installed")
print("torch.backends entry points:", [e.value for e in m.entry_points(group="torch.backends")])
import torch
print("cuda", torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
} > "$log" 2>&1

run() {  # NAME EXPECT(ok|fail) SCRIPT [VAR=VALUE...] -- [SCRIPT ARGS...]
  local name=$1 expect=$2 script=$3; shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  case " ${ONLY:-$script} " in *" $script "*) ;; *) return ;; esac
  local command="${envs[*]} torchrun --nproc_per_node $nproc examples/recipes/$script.py $*"
  echo "=== run $name: $command" >> "$log"
  local start=$SECONDS
  local output="$runs/${name//\//.}.out"
  env "${envs[@]}" timeout "${RECIPE_TIMEOUT:-300}" \
    torchrun --nproc_per_node "$nproc" "examples/recipes/$script.py" "$@" > "$output" 2>&1
  local rc=$?
  cat "$output" >> "$log"
  echo "=== run $name: exit $rc after $((SECONDS - start)) s (expected: $expect)" >> "$log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$script" "$expect" "$rc" "$((SECONDS - start))" "$command" \
    >> "$runs/index.tsv"
  echo "$name: exit $rc (expected: $expect)"
}

run accelerate_fsdp2/no-shim "$dtensor" accelerate_fsdp2 OFFLOAD_SHIM=0 --
run accelerate_fsdp2/shim ok accelerate_fsdp2 OFFLOAD_SHIM=1 --
run accelerate_launch_env/gloo ok accelerate_launch_env OFFLOAD_SHIM=0 --
run accelerate_launch_env/shim ok accelerate_launch_env OFFLOAD_SHIM=1 --
run lightning_fsdp2/no-shim "$dtensor" lightning_fsdp2 OFFLOAD_SHIM=0 --
run lightning_fsdp2/shim ok lightning_fsdp2 OFFLOAD_SHIM=1 --
run dcp_fsdp2/no-shim "$dtensor" dcp_fsdp2 OFFLOAD_SHIM=0 --
run dcp_fsdp2/shim ok dcp_fsdp2 OFFLOAD_SHIM=1 --
run rl_weight_sync/no-shim fail rl_weight_sync OFFLOAD_SHIM=0 --
run rl_weight_sync/shim ok rl_weight_sync OFFLOAD_SHIM=1 --
run rl_weight_sync/gloo ok rl_weight_sync OFFLOAD_SHIM=0 -- --backend cpu:gloo,cuda:nccl
run rl_weight_sync/gloo-shim ok rl_weight_sync OFFLOAD_SHIM=1 -- --backend cpu:gloo,cuda:nccl
for recipe in accelerate_metrics lightning_sync_dist torchmetrics_cpu broadcast_size; do  # metrics and logging
  run $recipe/no-shim fail $recipe OFFLOAD_SHIM=0 --
  run $recipe/shim ok $recipe OFFLOAD_SHIM=1 --
done

python3 - "$runs" "$out/recipes.json" "$nproc" <<'PY' 2>&1 | tee -a "$log"
import json, os, re, sys

runs_dir, path, nproc = sys.argv[1], sys.argv[2], int(sys.argv[3])
ERRORS = ("No backend type associated with device type cpu", "Tensors must be CUDA and dense")
index = os.path.join(runs_dir, "index.tsv")
runs = []
for line in open(index).read().splitlines() if os.path.exists(index) else []:
    name, recipe, expect, rc, seconds, command = line.split("\t")
    text = open(os.path.join(runs_dir, name.replace("/", ".") + ".out"), errors="replace").read()
    lines = text.splitlines()
    result = {}
    for entry in [l for l in lines if l.startswith("RESULT ")][-1:]:
        for token in entry.split()[1:]:
            key, _, value = token.partition("=")
            for kind in (int, float, str):
                try:
                    result[key] = kind(value)
                    break
                except ValueError:
                    pass
    errors = [re.sub(r"^\[rank\d+\]: ", "", l) 
              for l in lines if re.match(r"^(\[rank\d+\]: )?\w+(Error|Exception): ", l)]
    frames = [i for i, l in enumerate(lines) if re.search(r'File ".*examples/recipes/\w+\.py", line \d+, in ', l)]
    failed_at = None
    if frames:
        i = frames[-1]
        where = re.search(r"(examples/recipes/\w+\.py)\", line (\d+)", lines[i])
        code = re.sub(r"^\[rank\d+\]: ", "", lines[i + 1]).strip() if i + 1 < len(lines) else ""
        failed_at = f"{where.group(1)}:{where.group(2)}: {code}"
    rc = int(rc)
    outcome = "ok" if rc == 0 and result.get("status") == "ok" else ("fail" if any(e in text for e in ERRORS) else "other")
    runs.append({
        "name": name, "recipe": recipe, "command": command, "nproc": nproc, "exit_code": rc,
        "seconds": int(seconds), "expected": expect, "outcome": outcome, "matched": outcome == expect,
        "error": errors[0] if errors else None, "failed_at": failed_at if rc else None, "result": result,
    })

by_name = {r["name"]: r["result"] for r in runs}
def ratio(slow, fast, key):
    a, b = by_name.get(slow, {}).get(key), by_name.get(fast, {}).get(key)
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None
launch = ("accelerate_launch_env/gloo", "accelerate_launch_env/shim")
comparisons = {  # time over Gloo without the shim / time with it
    "accelerate_launch_env full_tensor": ratio(*launch, "full_tensor_s_min"),
    "accelerate_launch_env step": ratio(*launch, "step_s_median"),
    "accelerate_launch_env get_state_dict": ratio(*launch, "state_dict_s"),
    "rl_weight_sync sync, shim on nccl": ratio("rl_weight_sync/gloo", "rl_weight_sync/shim", "sync_ms_min"),
    "rl_weight_sync sync, shim on cpu:gloo,cuda:nccl": ratio("rl_weight_sync/gloo", "rl_weight_sync/gloo-shim", "sync_ms_min"),
}
matched = bool(runs) and all(r["matched"] for r in runs)
report = {"nproc": nproc, "all_matched": matched, "runs": runs, "gloo_over_shim_time": comparisons}
json.dump(report, open(path, "w"), indent=1)
for r in runs:
    verdict = "ok" if r["matched"] else "MISMATCH"
    print(f"{r['name']:28s} expected {r['expected']:4s} got {r['outcome']:5s} {verdict}")
print("time over Gloo / with the shim:", {k: v for k, v in comparisons.items() if v is not None})
sys.exit(0 if matched else 1)
PY
status=${PIPESTATUS[0]}
rm -rf "$runs"
exit $status
