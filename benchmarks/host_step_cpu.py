"""The host's work per decode step, without a device: scheduling, step-input building, the block-table copy into a
staging buffer, and postprocess with the stop checks. 1,024 lines of a 1,024-token instruction + 64 own tokens through
256 slots, outputs randint(64, 448) (shared_prefix_gpu.py's stream job), every sampled token 7.

    .venv/bin/python benchmarks/host_step_cpu.py

With the shared-prefix kernel a 256-row GPU step takes about 4.4 ms, and the host's work for it (this, plus the
sampler's values and the launches) once came close enough that such jobs were host-bound (RESULTS session 41)."""
from __future__ import annotations

import random
import time

import numpy as np

from nvcli.engine.block_manager import BlockManager
from nvcli.engine.model_runner import build_step_input, fill_tables
from nvcli.engine.scheduler import Scheduler
from nvcli.engine.sequence import Sequence
from nvcli.sampling_params import SamplingParams

BS = 16
rng = random.Random(0)
bm = BlockManager(60000, BS)
sched = Scheduler(bm, 256, 16384, 4096, True)
instr = [rng.randrange(10, 1000) for _ in range(1024)]


def new_seq():
    return Sequence(instr + [rng.randrange(10, 1000) for _ in range(64)],
                    SamplingParams(max_tokens=rng.randint(64, 448), ignore_eos=True), BS)


for _ in range(1024):
    sched.add(new_seq())
tables = np.zeros((512, 300), np.int32)
t_sched = t_build = t_fill = t_post = 0.0
steps = 0
decode_steps = 0
prev_rows = None
while sched.has_unfinished():
    t0 = time.perf_counter()
    batch = sched.schedule()
    t1 = time.perf_counter()
    step = build_step_input(batch, BS, prev_rows)
    t2 = time.perf_counter()
    if batch.is_decode_only:
        fill_tables(tables, step.block_tables)
    t3 = time.perf_counter()
    produced = sched.postprocess(batch, [7] * len(batch.seqs))
    for s, index in produced:
        sched.check_stop(s, eos_token_ids=set(), index=index)
    t4 = time.perf_counter()
    prev_rows = {s.seq_id: i for i, s in enumerate(batch.seqs)}
    steps += 1
    if batch.is_decode_only:
        decode_steps += 1
        t_sched += t1 - t0
        t_build += t2 - t1
        t_fill += t3 - t2
        t_post += t4 - t3
print(f"{steps} steps, {decode_steps} decode-only; per decode step, us: schedule {1e6 * t_sched / decode_steps:.0f}, "
      f"build {1e6 * t_build / decode_steps:.0f}, fill tables {1e6 * t_fill / decode_steps:.0f}, "
      f"postprocess+check_stop {1e6 * t_post / decode_steps:.0f}")
