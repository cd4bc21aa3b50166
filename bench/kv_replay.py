"""Block-allocator A/B without a model: ``bench.kv_layout``'s waves and chats replayed on the
bare scheduler, over several seeds, once per allocator policy; prints one JSON line.

``bench.kv_layout`` runs one seed through the real engine and takes minutes; the layout and the
prefix-cache hits depend only on the scheduler's decisions (lengths, arrivals, which blocks each
table gets), not on the values the model writes. So this runs ``bench.kv_layout``'s own
``run_waves`` and ``chat_hit_rates`` on :class:`SchedulerOnly`, a
:class:`~scheduler.scheduler.Scheduler` behind the few engine calls they make, sampling random
tokens: a second or two per seed (seed 0 is ``bench.kv_layout``'s workload). Per policy
(``--policies``: ``windows``, the default, and ``front``, ``kv_windows=False``: a new table
starts at the free queue's front) and pool size (``--blocks``): the adjacency of the running
tables per wave, the chats' prefix-hit share per turn, prefixes moved (block copies) and
evicted, and preemptions: the means over ``--seeds`` seeds (the same seeds for every policy),
with each seed's last-wave adjacency and last-turn hits.

Usage: ``python -m bench.kv_replay [--blocks 1320,2640,8192] [--seeds 6] [--waves 5]
[--requests 96] [--chats 96] [--turns 4]`` (1320 blocks: ``bench.kv_layout``'s default pool on
the bench model, full most of the time; 8192: the 2 GiB ``bench.throughput`` gives it).
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from bench.common import emit
from bench.kv_layout import chat_hit_rates, run_waves
from pagedserve.params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import StopConditions
from worker.outputs import CompletionOutput, RequestOutput

VOCAB = 4096
MAX_MODEL_LEN = 1024  # bench.kv_layout's engine's
POLICIES = {"windows": True, "front": False}


class SchedulerOnly:
    """The engine calls ``bench.kv_layout``'s workloads make, on a bare scheduler: each step
    samples a random token for every sequence that samples."""

    max_model_len = MAX_MODEL_LEN

    def __init__(self, config: SchedulerConfig, seed: int) -> None:
        self.scheduler = Scheduler(config)
        self.rng = random.Random(seed)

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, stream: bool = False
    ) -> None:
        assert params.max_tokens is not None and params.ignore_eos  # what the workloads ask
        stop = StopConditions(max_tokens=params.max_tokens, ignore_eos=True)
        self.scheduler.add_sequence(request_id, prompt, stop, max_model_len=MAX_MODEL_LEN)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """The step's finished requests (each a single sequence), with their tokens."""
        out = self.scheduler.schedule()
        sampled = [(s.seq_id, self.rng.randint(1, VOCAB - 1)) for s in out.scheduled if s.sample]
        return [
            RequestOutput(
                u.seq.request_id, u.seq.token_ids[: u.seq.prompt_len],
                [CompletionOutput(0, u.seq.output_token_ids, "", u.finish_reason.value)],
                finished=True,
            )
            for u in self.scheduler.postprocess(sampled)
            if u.finish_reason is not None
        ]  # fmt: skip


def replay(blocks: int, windows: bool, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One seed's waves and chats on a fresh scheduler."""
    engine = SchedulerOnly(SchedulerConfig(num_blocks=blocks, kv_windows=windows), seed)
    waves, _ = run_waves(engine, args.waves, args.requests, VOCAB, seed=seed)
    hits = chat_hit_rates(engine, args.chats, args.turns, VOCAB, seed=seed)
    sched = engine.scheduler
    return {
        "waves": waves, "hits": hits, "prefixes_moved": sched.pool.stats.moved_blocks,
        "evictions": sched.pool.evictions, "preemptions": sched.stats.num_preemptions,
    }  # fmt: skip


def mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the seeds, and each seed's last-wave adjacency and last-turn hits."""
    return {
        "adjacent_by_wave": [mean([r["waves"][w]["adjacent"] for r in runs])
                             for w in range(len(runs[0]["waves"]))],
        "chat_hit_rate_by_turn": [mean([r["hits"][t] for r in runs])
                                  for t in range(len(runs[0]["hits"]))],
        "last_wave_adjacent_by_seed": [r["waves"][-1]["adjacent"] for r in runs],
        "last_turn_hits_by_seed": [r["hits"][-1] for r in runs],
        **{k: mean([r[k] for r in runs]) for k in ("prefixes_moved", "evictions", "preemptions")},
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
