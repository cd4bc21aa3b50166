"""How contiguous the engine's block tables stay, what that layout costs the CPU decode kernel,
and what the prefix cache keeps for multi-turn chats: prints one JSON line.

The block allocator decides where each sequence's K/V lies in the pool. A decode kernel reads a
table of consecutive blocks faster than a scattered one (the hardware prefetchers restart at
every block; ``bench.kernels``' ``inorder_over_scattered``), and the prefix cache's LRU order
decides which finished conversations' blocks survive to their next turn. A change to the
allocator moves both, so this benchmark measures both, on the real engine:

* ``waves``: the ``mixed`` workload run ``--waves`` times through one engine on a small pool
  (``--pool-mib``), so that the pool turns over; every 8 steps, the running tables' consecutive
  entries are counted as ``adjacent`` (the next block), ``descending`` (the previous one) or
  ``scattered``. The first wave is a fresh pool; the last ones the steady state of a worker.
  ``prefixes_moved``: cached prefixes moved so far to let a table take its next block
  (``BlockPool.take``), each a block copy.
* ``decode``: the C decode kernel, per head shape (``--shapes``), over the tables of the last
  wave's busiest sampled step (``engine``), the same rows laid out in consecutive blocks
  (``in_order``) and at random (``random``), from DRAM (``bench.kernels.cold_gbps``), beside a
  plain read of as many contiguous bytes (``read``).
* ``chat_hit_rate``: ``--chats`` conversations on the same engine and pool, each turn's prompt
  the previous prompt, its completion and a new message: the share of prompt tokens the prefix
  cache served, per turn.

Usage: ``python -m bench.kv_layout [--model DIR|FILE.gguf] [--waves 5] [--requests 96]
[--pool-mib 330] [--shapes 9/3/64,8/4/64] [--chats 96] [--turns 4] [--repeats 9]`` (without
``--model`` the bench checkpoint is built into a temporary directory).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from bench.common import emit
from bench.kernels import BLOCK_SIZE, HeadShape, cold_gbps
from bench.throughput import build_llama, make_mixed, params_of, random_ids
from pagedserve.params import SamplingParams

Tables = list[tuple[list[int], int]]  # (block table, tokens in it) per running sequence


def adjacency(tables: list[list[int]]) -> Counter[str]:
    """Consecutive table entries by how the second block lies from the first."""
    got: Counter[str] = Counter()
    for table in tables:
        for a, b in pairwise(table):
            got["adjacent" if b == a + 1 else "descending" if b == a - 1 else "scattered"] += 1
    return got


def shares(counts: Counter[str]) -> dict[str, float]:
    total = sum(counts.values()) or 1
    keys = ("adjacent", "descending", "scattered")
    return {k: round(counts[k] / total, 3) for k in keys} | {"pairs": sum(counts.values())}


def run_waves(
    engine: Any, waves: int, requests: int, vocab: int, seed: int = 0
) -> tuple[list[dict], Tables]:
    """The ``mixed`` workload ``waves`` times (wave ``w`` from seed ``1000 * seed + w``); each
    wave's adjacency, and the last wave's busiest sampled tables."""
    sched, steps, out = engine.scheduler, 0, []
    busiest: Tables = []
    for wave in range(waves):
        wl = make_mixed(requests, vocab, seed=1000 * seed + wave)
        for i, (prompt, params) in enumerate(zip(wl.prompts, params_of(wl), strict=True)):
            engine.add_request(f"w{wave}-{i}", prompt, params, stream=False)
        counts: Counter[str] = Counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps % 8:
                continue
            counts += adjacency([s.block_table for s in sched.running])
            if wave == waves - 1 and len(sched.running) > len(busiest):
                busiest = [(list(s.block_table), s.num_computed) for s in sched.running]
        moved = getattr(sched.pool.stats, "moved_blocks", 0)  # (a tree without the moves: 0)
        out.append(shares(counts) | {"prefixes_moved": moved})
    return out, busiest


def layouts(tables: Tables, num_blocks: int, seed: int = 0) -> dict[str, Tables]:
    """The engine's tables, and the same rows in consecutive blocks and in random ones."""
    rows = [(t, n) for t, n in tables if n > 0]
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    in_order: Tables = []
    scattered: Tables = []
    used = 0
    for _, n in rows:
        k = -(-n // BLOCK_SIZE)
        in_order.append((list(range(used, used + k)), n))
        scattered.append((perm[used : used + k], n))
        used += k
    return {"engine": rows, "in_order": in_order, "random": scattered}


def time_decode(sets: dict[str, Tables], num_blocks: int, shape: HeadShape, repeats: int) -> dict:
    """GB/s of the C decode kernel over each layout (same rows and lengths), from DRAM."""
    from kernels import native
    from kernels.native import DecodeRows

    kernel = native.load()
    if kernel is None:
        return {"shape": f"{shape.heads}/{shape.kv_heads}/{shape.head_dim}", "native": False}
    H, KV, D = shape.heads, shape.kv_heads, shape.head_dim
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((num_blocks, BLOCK_SIZE, KV, D), generator=gen)
    v_cache = torch.randn((num_blocks, BLOCK_SIZE, KV, D), generator=gen)
    lens = [n for _, n in sets["engine"]]
    n_rows, width = len(lens), max(len(t) for t, _ in sets["engine"])
    rows = DecodeRows.whole(torch.tensor(lens))
    query = torch.randn(n_rows, H, D, generator=gen)
    out, lse = torch.empty_like(query), torch.empty(n_rows, H)
    fns = {}
    for name, rows_of in sets.items():
        tables = torch.zeros(n_rows, width, dtype=torch.int32)
        for i, (t, _) in enumerate(rows_of):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        fns[name] = lambda t=tables: kernel.decode(
            query, k_cache, v_cache, t, rows, D**-0.5, None, out, lse
        )
    kv_bytes = 2 * sum(lens) * KV * D * 4
    src = torch.randn(kv_bytes // 4)
    fns["read"] = src.sum
    gbps = cold_gbps(fns, kv_bytes, repeats)
    return {
        "shape": f"{H}/{KV}/{D}",
        "rows": n_rows,
        "kv_mb": round(kv_bytes / 1e6, 1),
        "gbps": {k: round(v, 2) for k, v in gbps.items()},
        "engine_over_random": round(gbps["engine"] / gbps["random"], 3),
        "in_order_over_engine": round(gbps["in_order"] / gbps["engine"], 3),
        "engine_fraction_of_read": round(gbps["engine"] / gbps["read"], 3),
    }


def chat_hit_rates(engine: Any, chats: int, turns: int, vocab: int, seed: int = 0) -> list[float]:
    """Per turn, the share of the conversations' prompt tokens served from the prefix cache."""
    rng = random.Random(seed)
    convs = [random_ids(rng, rng.randint(16, 200), vocab) for _ in range(chats)]
    limit = engine.max_model_len - 128  # room for the next message and completion
    stats, got = engine.scheduler.pool.stats, []
    for turn in range(turns):
        queried, hit = stats.queried_tokens, stats.hit_tokens
        for i, prompt in enumerate(convs):
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randint(16, 96), ignore_eos=True
            )
            engine.add_request(f"t{turn}-c{i}", prompt, params, stream=False)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        for i, prompt in enumerate(convs):
            nxt = prompt + done[f"t{turn}-c{i}"] + random_ids(rng, rng.randint(8, 48), vocab)
            convs[i] = nxt if len(nxt) < limit else random_ids(rng, rng.randint(16, 200), vocab)
        got.append(round((stats.hit_tokens - hit) / max(1, stats.queried_tokens - queried), 4))
    return got


def make_engine(model: Path, args: argparse.Namespace) -> Any:
    from worker.llm import LLM

    llm = LLM(
        model,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=args.pool_mib << 20,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    return llm.engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir or .gguf file")
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--requests", type=int, default=96, help="mixed requests per wave")
    ap.add_argument("--pool-mib", type=int, default=330, help="KV pool (small: it turns over)")
    ap.add_argument("--shapes", default="9/3/64,8/4/64", help="decode head shapes to time")
    ap.add_argument("--chats", type=int, default=96)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_llama(Path(tmp) / "llama-bench", "bench")
        engine = make_engine(model, args)
        vocab = min(engine.tokenizer.vocab_size, 4096)
        waves, tables = run_waves(engine, args.waves, args.requests, vocab)
        num_blocks = engine.scheduler.pool.num_blocks
        del engine  # its pool: the chats get a fresh engine of their own
        sets = layouts(tables, num_blocks)
        shapes = [HeadShape.parse(x) for x in args.shapes.split(",") if x]
        decode = [time_decode(sets, num_blocks, s, args.repeats) for s in shapes]
        chats = chat_hit_rates(make_engine(model, args), args.chats, args.turns, vocab)
    emit("kv_layout", {
        "model": str(args.model or "bench preset (built)"),
        "pool_blocks": num_blocks,
        "waves": waves,
        "decode": decode,
        "chat_hit_rate": chats,
    })  # fmt: skip


if __name__ == "__main__":
    main()
