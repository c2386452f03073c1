#!/usr/bin/env bash
# Nsight Compute on one decode-attention launch per variant at B=256 x 800 tokens (benchmarks/decode_variants.py
# --once), from the repo root with the project on PYTHONPATH:
#   bash benchmarks/ncu_decode.sh ["LABEL,LABEL"]        (labels: decode_variants.py VARIANTS)
#   bash benchmarks/ncu_decode.sh layouts              (the fp8 page layouts of decode_variants.py --layouts)
#   bash benchmarks/ncu_decode.sh rope                 (the fp8 default kernel without and with the rotary step)
# Collects speed of light, memory workload, occupancy, scheduler statistics and the warp-stall breakdown
# (cycles per issued instruction spent in each stall reason); prints one column per variant. CSVs go to $OUT.
set -u
OUT=${OUT:-/tmp}
variants=${1:-"bf16 per-token,fp8 runs V tile"}
if [ "$variants" = rope ]; then
  args=(--order-rope --once)
  variants="no rotary,rotary (engine)"
elif [ "$variants" = layouts ]; then
  args=(--layouts --once)
  variants="16-token pages,32-token pages,32-token pages V dims-major,32-token pages V dims-major K heads-major"
else
  args=(--once --variants "$variants")
fi
run() { timeout 240 ncu --clock-control none -k regex:_decode_split "$@" \
          python3 benchmarks/decode_variants.py "${args[@]}"; }
run --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
  --csv --page details > "$OUT/ncu_details.csv" 2> "$OUT/ncu_details.err"; echo "ncu details exit $?"
run --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  --csv --page raw > "$OUT/ncu_stalls.csv" 2> "$OUT/ncu_stalls.err"; echo "ncu stalls exit $?"
VARIANTS="$variants" python3 - "$OUT/ncu_details.csv" "$OUT/ncu_stalls.csv" <<'PY'
import csv, io, os, sys
labels = os.environ["VARIANTS"].split(",")
src = open("benchmarks/decode_variants.py").read()  # the variants launch in VARIANTS order, not the one given
if src.find(f'("{labels[0]}"') >= 0:
    labels.sort(key=lambda label: src.find(f'("{label}"'))
def rows(path):
    text = open(path).read()
    start = text.find('"ID"')
    return list(csv.reader(io.StringIO(text[start:]))) if start >= 0 else []
details = rows(sys.argv[1])
if details:
    head = details[0]
    col = {n: head.index(n) for n in ("ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value")}
    table = {}
    for r in details[1:]:
        key = (r[col["Section Name"]], r[col["Metric Name"]], r[col["Metric Unit"]])
        table.setdefault(key, {})[int(r[col["ID"]])] = r[col["Metric Value"]]
    for (sec, name, unit), vals in table.items():
        print(f"{sec[:22]:22s} {name[:44]:44s} {unit[:10]:10s} " + " | ".join(vals.get(i, "-") for i in sorted(vals)))
stalls = rows(sys.argv[2])
if stalls:
    head, data = stalls[0], stalls[2:]  # second row: units
    picked = []
    for j, name in enumerate(head):
        if name.startswith("smsp__average_warps_issue_stalled_"):
            vals = [float(r[j].replace(",", "")) for r in data]
            picked.append((sum(vals), name.removeprefix("smsp__average_warps_issue_stalled_").split("_per_issue")[0], vals))
    print("\nstall reason (warp cycles per issued instruction): " + " | ".join(labels))
    for _, name, vals in sorted(picked, reverse=True)[:14]:
        print(f"  {name:28s} " + " | ".join(f"{v:6.2f}" for v in vals))
PY
