"""Peer runners for ``bench.throughput``: each runs one system in its own fresh process.

Every script reads a job file (JSON: model, prompts, max_tokens, threads, options) and writes one
result file (JSON). ``vllm_peer.py`` is standalone (stdlib + vLLM) so another interpreter can
run it.
"""
