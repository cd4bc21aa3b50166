"""KV-cache memory waste: paged blocks against contiguous max-length reservation.

Both allocators serve the same request stream (chat-like lengths: prompts 16-2048 and outputs
16-1024 tokens, skewed short) from the same memory, stepping one token per running sequence per
step. Waste is the share of reserved KV slots that hold no token, averaged over steps; concurrency
is the average number of sequences running at once.

    python -m bench.kv_waste [--requests 2000] [--memory-tokens 262144]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from bench.common import emit
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import StopConditions


@dataclass(slots=True)
class Request:
    prompt_len: int
    output_len: int


def skewed(rng: random.Random, lo: int, hi: int) -> int:
    """Log-uniform: most requests short, a long tail of long ones (like chat traffic)."""
    return round(lo * (hi / lo) ** rng.random())


def workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(skewed(rng, 16, 2048), skewed(rng, 16, 1024)) for _ in range(n)]


def simulate_paged(reqs: list[Request], memory_tokens: int, block_size: int) -> dict[str, float]:
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=memory_tokens // block_size,
            block_size=block_size,
            max_num_seqs=4096,
            # A budget large enough that admission is limited by memory alone, like the
            # contiguous allocator it is compared with.
            max_num_batched_tokens=1 << 20,
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(1)
    for i, r in enumerate(reqs):
        prompt = [rng.randrange(1, 30000) for _ in range(r.prompt_len)]
        sched.add_sequence(
            f"r{i}", prompt, StopConditions(max_tokens=r.output_len, ignore_eos=True)
        )
    waste = []
    running = []
    while sched.has_work():
        out = sched.schedule()
        occ = sched.occupancy()
        if occ.in_use:
            waste.append(occ.fragmentation_slots / (occ.in_use * block_size))
            running.append(sched.num_running)
        sched.postprocess([(s.seq_id, 0) for s in out.scheduled if s.sample])
    return {
        "waste_pct": 100 * sum(waste) / len(waste),
        "avg_concurrent": sum(running) / len(running),
        "steps": len(running),
        "preemptions": sched.stats.num_preemptions,
    }


def simulate_contiguous(reqs: list[Request], memory_tokens: int, max_len: int) -> dict[str, float]:
    """Each admitted sequence reserves ``max_len`` slots up front, as static-cache servers do."""
    seats = memory_tokens // max_len
    queue = [r for r in reqs if r.prompt_len + r.output_len <= max_len]
    running: list[list[int]] = []  # [tokens stored, tokens at finish]
    waste, concurrent = [], []
    qi = 0
    while qi < len(queue) or running:
        while len(running) < seats and qi < len(queue):
            r = queue[qi]
            running.append([r.prompt_len, r.prompt_len + r.output_len])
            qi += 1
        used = sum(s[0] for s in running)
        waste.append(1 - used / (len(running) * max_len))
        concurrent.append(len(running))
        for s in running:
            s[0] += 1
        running = [s for s in running if s[0] < s[1]]
    return {
        "waste_pct": 100 * sum(waste) / len(waste),
        "avg_concurrent": sum(concurrent) / len(concurrent),
        "max_concurrent": seats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--memory-tokens", type=int, default=1 << 18)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    reqs = workload(a.requests, a.seed)
    paged = simulate_paged(reqs, a.memory_tokens, a.block_size)
    c2k = simulate_contiguous(reqs, a.memory_tokens, 2048)
    c4k = simulate_contiguous(reqs, a.memory_tokens, 4096)
    emit(
        "kv_waste",
        {
            "requests": a.requests,
            "memory_tokens": a.memory_tokens,
            "block_size": a.block_size,
            "mean_prompt": round(sum(r.prompt_len for r in reqs) / len(reqs), 1),
            "mean_output": round(sum(r.output_len for r in reqs) / len(reqs), 1),
            "paged_waste_pct": round(paged["waste_pct"], 2),
            "contiguous_2048_waste_pct": round(c2k["waste_pct"], 2),
            "contiguous_4096_waste_pct": round(c4k["waste_pct"], 2),
            "paged_avg_concurrent": round(paged["avg_concurrent"], 1),
            "contiguous_2048_avg_concurrent": round(c2k["avg_concurrent"], 1),
            "contiguous_4096_avg_concurrent": round(c4k["avg_concurrent"], 1),
            "concurrency_ratio_vs_2048": round(paged["avg_concurrent"] / c2k["avg_concurrent"], 2),
            "concurrency_ratio_vs_4096": round(paged["avg_concurrent"] / c4k["avg_concurrent"], 2),
            "paged_preemptions": paged["preemptions"],
        },
    )


if __name__ == "__main__":
    main()
