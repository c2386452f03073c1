#!/usr/bin/env bash
# `N=512 T=1000 bash benchmarks/cold_scoring_job_gpu.sh` (PYTHONPATH=.): a cold start-up (empty Triton cache: compile workers start the forkserver) then a scoring job through `nv generate`,
# and no process of it left afterwards
N=${N:-256}; T=${T:-500}
d=$(mktemp -d)
python3 - "$d" "$N" "$T" <<'PY'
import json, random, sys
from pathlib import Path
from nvcli.models.presets import preset_dir
d, n, t = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
preset_dir("qwen3-0.6b", d / "m")
r = random.Random(0)
with open(d / "in.jsonl", "w") as f:
    for i in range(n):
        ids = [r.randrange(1000, 100000) for _ in range(t)]
        line = {"id": i, "prompt_token_ids": ids, "prompt_logprobs": 5, "max_tokens": 1} if i % 2 else \
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}}
        f.write(json.dumps(line) + "\n")
PY
model=$d/m/qwen3-0.6b
export TRITON_CACHE_DIR=$d/triton
t0=$SECONDS
python3 -m nvcli generate $d/in.jsonl -o $d/out.jsonl --model $model --load-format dummy --quiet 2> $d/err.log
echo "nv generate exit $? in $((SECONDS - t0)) s; lines in $(wc -l < $d/in.jsonl), out $(wc -l < $d/out.jsonl), errors $(grep -c '"error":{' $d/out.jsonl)"
tail -3 $d/err.log
sleep 1; echo "python processes left: $(pgrep -fc 'multiprocessing|nvcli' || true)"
