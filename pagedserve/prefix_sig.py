"""Prefix signatures: which queued jobs will share a cached prompt prefix, known without the model.

A job's signature is computed at enqueue (client side, no tokenizer, no model) and stored with its
job record and its stream entry. Jobs with one signature form a *group*: a worker that has the
group's prefix cached serves the next ones at cache speed (``worker.admission``).

What the signature covers:

- ``messages``: the leading system messages (role and content): the system prompt plus the chat
  template's framing of it, which is what the model's prefix cache shares. Without a leading system
  message, the first message's leading text as below.
- prompt text: a hash chain over the leading text in chunks of :data:`TEXT_GRANULE` characters (a
  few tokens each, roughly a KV block), up to :data:`MAX_TEXT_CHARS` and never the whole prompt
  (the last chunk stays out, so that two prompts that differ only in their tail still match).
- prompt token ids: the same over :data:`TOKEN_GRANULE` ids (one 16-token KV block per chunk), up to
  :data:`MAX_TOKENS`.

Two prompts that share the covered leading part get one signature even if they differ later: they
still share at least that much cache, so grouping them is right. Prompts shorter than one chunk get
no signature (``None``): they are served in arrival order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from pagedserve.schemas import JobRequest

TEXT_GRANULE = 64
MAX_TEXT_CHARS = 1024
TOKEN_GRANULE = 16
MAX_TOKENS = 256
#: Hex digits of a signature (64 bits: distinct prefixes colliding is not a practical concern, and
#: a collision would only group two prefixes, never change an output).
SIG_HEX = 16


@dataclass(frozen=True)
class PrefixSignature:
    """A job's prefix group: ``sig`` (hex) and how much of the prompt it covers."""

    sig: str
    kind: str  # "system" | "text" | "tokens"
    units: int  # characters (system, text) or token ids (tokens) covered


def _chain(parts: list[bytes], salt: str) -> str:
    """Hash chain over ``parts``: each link digests the previous one and the next part."""
    h = hashlib.blake2b(salt.encode(), digest_size=SIG_HEX // 2).digest()
    for p in parts:
        h = hashlib.blake2b(h + p, digest_size=SIG_HEX // 2).digest()
    return h.hex()


def _leading(n: int, granule: int, cap: int) -> int:
    """How many leading units to cover: whole granules, at most ``cap``, never all ``n``."""
    return min(cap, (n - 1) // granule * granule)


def _text_sig(text: str, salt: str) -> PrefixSignature | None:
    n = _leading(len(text), TEXT_GRANULE, MAX_TEXT_CHARS)
    if n <= 0:
        return None
    parts = [text[i : i + TEXT_GRANULE].encode() for i in range(0, n, TEXT_GRANULE)]
    return PrefixSignature(_chain(parts, "text:" + salt), "text", n)


def _token_sig(ids: list[int], salt: str) -> PrefixSignature | None:
    n = _leading(len(ids), TOKEN_GRANULE, MAX_TOKENS)
    if n <= 0:
        return None
    parts = [
        ",".join(map(str, ids[i : i + TOKEN_GRANULE])).encode() for i in range(0, n, TOKEN_GRANULE)
    ]
    return PrefixSignature(_chain(parts, "tokens:" + salt), "tokens", n)


def prefix_signature(request: JobRequest) -> PrefixSignature | None:
    """The request's prefix signature, or ``None`` when it has no prefix worth grouping by.

    The served model is part of the hash (``request.model``): one prefix under two models is two
    caches.
    """
    salt = request.model or ""
    if request.messages:
        system = []
        for m in request.messages:
            if m.role != "system":
                break
            system.append([m.role, m.content])
        if system and len(system) < len(request.messages):
            blob = json.dumps(system, ensure_ascii=False).encode()
            units = sum(len(c) for _, c in system)
            return PrefixSignature(_chain([blob], "system:" + salt), "system", units)
        return _text_sig(request.messages[0].content, "chat:" + salt)
    if isinstance(request.prompt, str):
        return _text_sig(request.prompt, salt)
    if isinstance(request.prompt, list):
        return _token_sig(request.prompt, salt)
    return None
