"""Block-allocator A/B without a model: ``bench.kv_layout``'s waves and chats replayed on the
bare scheduler, over several seeds, once per allocator policy; prints one JSON line.

``bench.kv_layout`` runs one seed through the real engine and takes minutes; the layout and the
prefix-cache hits depend only on the scheduler's decisions (lengths, arrivals, which blocks each
table gets), not on the values the model writes, so this replays the same workloads on a
:class:`~scheduler.scheduler.Scheduler` alone with random sampled tokens, in a second or two per
seed. Per policy (``--policies``: ``windows``, the default, and ``front``, ``kv_windows=False``:
a new table starts at the free queue's front) and pool size (``--blocks``): the adjacency of the
running tables per wave (``bench.kv_layout.adjacency``), the chats' prefix-hit share per turn,
prefixes moved (block copies) and evicted, and preemptions: the means over ``--seeds`` seeds
(the same seeds for every policy), with each seed's last-wave adjacency and last-turn hits.

Usage: ``python -m bench.kv_replay [--blocks 1320,2640,8192] [--seeds 6] [--waves 5]
[--requests 96] [--chats 96] [--turns 4]`` (1320 blocks: ``bench.kv_layout``'s default pool on
the bench model, full most of the time; 8192: the 2 GiB ``bench.throughput`` gives it).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.common import emit
from bench.kv_layout import adjacency, shares
from bench.throughput import make_mixed, random_ids
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, StopConditions

VOCAB = 4096
MAX_MODEL_LEN = 1024
POLICIES = {"windows": True, "front": False}


@dataclass
class Replay:
    """One seed's replay: the scheduler, its sampled-token source, and what it counted."""

    sched: Scheduler
    rng: random.Random
    steps: int = 0
    waves: list[dict[str, float]] = field(default_factory=list)
    chat_hits: list[float] = field(default_factory=list)

    def step(self) -> None:
        out = self.sched.schedule()
        self.sched.postprocess(
            [(s.seq_id, self.rng.randint(1, VOCAB - 1)) for s in out.scheduled if s.sample]
        )
        self.steps += 1

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Sequence:
        stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
        return self.sched.add_sequence(rid, prompt, stop, max_model_len=MAX_MODEL_LEN)


def run_waves(rp: Replay, waves: int, requests: int, seed: int) -> None:
    """``bench.kv_layout``'s waves: the ``mixed`` workload, adjacency every 8 steps."""
    for wave in range(waves):
        wl = make_mixed(requests, VOCAB, seed=1000 * seed + wave)
        for i, (prompt, n) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True)):
            rp.add(f"w{wave}-{i}", prompt, n)
        counts: Counter[str] = Counter()
        while rp.sched.has_work():
            rp.step()
            if rp.steps % 8 == 0:
                counts += adjacency([s.block_table for s in rp.sched.running])
        rp.waves.append(shares(counts))


def run_chats(rp: Replay, chats: int, turns: int, seed: int) -> None:
    """``bench.kv_layout``'s chats: each turn's prompt is the last prompt, its completion and a
    new message; the share of prompt tokens the prefix cache served, per turn."""
    rng = random.Random(seed)
    convs = [random_ids(rng, rng.randint(16, 200), VOCAB) for _ in range(chats)]
    stats = rp.sched.pool.stats
    for turn in range(turns):
        queried, hit = stats.queried_tokens, stats.hit_tokens
        seqs = [rp.add(f"t{turn}-c{i}", p, rng.randint(16, 96)) for i, p in enumerate(convs)]
        while rp.sched.has_work():
            rp.step()
        for i, seq in enumerate(seqs):
            nxt = seq.token_ids + random_ids(rng, rng.randint(8, 48), VOCAB)
            fits = len(nxt) < MAX_MODEL_LEN - 128
            convs[i] = nxt if fits else random_ids(rng, rng.randint(16, 200), VOCAB)
        rp.chat_hits.append((stats.hit_tokens - hit) / max(1, stats.queried_tokens - queried))


def replay(blocks: int, windows: bool, seed: int, args: argparse.Namespace) -> Replay:
    config = SchedulerConfig(num_blocks=blocks, kv_windows=windows)
    rp = Replay(Scheduler(config), random.Random(seed))
    run_waves(rp, args.waves, args.requests, seed)
    run_chats(rp, args.chats, args.turns, seed)
    return rp


def mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4)


def summary(runs: list[Replay]) -> dict[str, Any]:
    """Means over the seeds, and each seed's last-wave adjacency and last-turn hits."""
    pools = [rp.sched.pool for rp in runs]
    return {
        "adjacent_by_wave": [mean([rp.waves[w]["adjacent"] for rp in runs])
                             for w in range(len(runs[0].waves))],
        "chat_hit_rate_by_turn": [mean([rp.chat_hits[t] for rp in runs])
                                  for t in range(len(runs[0].chat_hits))],
        "last_wave_adjacent_by_seed": [rp.waves[-1]["adjacent"] for rp in runs],
        "last_turn_hits_by_seed": [round(rp.chat_hits[-1], 4) for rp in runs],
        "prefixes_moved": mean([p.stats.moved_blocks for p in pools]),
        "evictions": mean([p.evictions for p in pools]),
        "preemptions": mean([rp.sched.stats.num_preemptions for rp in runs]),
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--blocks", default="1320,2640,8192", help="pool sizes, comma-separated")
    ap.add_argument("--policies", default="windows,front", help="windows | front")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--chats", type=int, default=96)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        ap.error(f"--policies: unknown {sorted(unknown)} (choose from {sorted(POLICIES)})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        for policy in args.policies.split(","):
            runs = [replay(blocks, POLICIES[policy], s, args) for s in range(args.seeds)]
            results.append({"blocks": blocks, "policy": policy, **summary(runs)})
    emit("kv_replay", {"block_size": 16, "seeds": args.seeds, "results": results})


if __name__ == "__main__":
    main()
