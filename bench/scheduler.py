"""Scheduler overhead: schedule() + postprocess() per decode step at 256 sequences of ~1k tokens.

The stand-in model samples a fixed token, so the figure is pure scheduling cost: what every real
forward pass pays on top of its compute.

    python -m bench.scheduler [--seqs 256] [--context 1000] [--steps 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import emit
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import StopConditions


def run(num_seqs: int, context: int, steps: int, block_size: int) -> dict[str, float]:
    rng = random.Random(0)
    blocks = int(num_seqs * ((context + steps + 100) // block_size + 2) * 1.05)
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=blocks,
            block_size=block_size,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(8192, num_seqs),
        )
    )
    for i in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(context)]
        sched.add_sequence(f"r{i}", prompt, StopConditions(max_tokens=steps + 100, ignore_eos=True))
    # Prefill everything first (not timed): the figure of interest is the steady decode step.
    while sched.num_waiting or any(s.num_output_tokens == 0 for s in sched.running):
        out = sched.schedule()
        sched.postprocess([(s.seq_id, 7) for s in out.scheduled if s.sample])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.postprocess([(s.seq_id, 7) for s in out.scheduled if s.sample])
        times.append(time.perf_counter() - t0)
        assert len(out.scheduled) == num_seqs
    return {
        "seqs": num_seqs,
        "context": context,
        "steps": steps,
        "us_per_step_median": round(statistics.median(times) * 1e6, 1),
        "us_per_step_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
        "us_per_seq": round(statistics.median(times) * 1e6 / num_seqs, 2),
        "target_us_per_step": 500,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    emit("scheduler", run(a.seqs, a.context, a.steps, a.block_size))


if __name__ == "__main__":
    main()
