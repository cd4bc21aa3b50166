"""Uploaded and generated files (text) in Redis: create (capped, tenant-counted), read in chunks,
delete, list newest first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis

from pagedserve.batchstore.models import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_MAX_FILE_BYTES,
    FILE_CHUNK_LINES,
    LIST_SCAN_WINDOW,
    MAX_TTL_S,
    FileObject,
    _new_id,
)
from pagedserve.keys import DEFAULT_PREFIX, Keys
from pagedserve.redis_url import is_cluster
from pagedserve.tenants import DEFAULT_TENANT, QuotaExceeded, TenantBook

log = logging.getLogger("pagedserve.batches")


class FileStore:
    """Uploaded and generated files (text) in Redis, listed newest first, each with a TTL."""

    def __init__(
        self,
        r: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
        ttl_s: int = DEFAULT_FILE_TTL_S,
        *,
        keys: Keys | None = None,
    ):
        self.r = r
        self.keys = keys or Keys(prefix, cluster=is_cluster(r))
        #: A cluster: the listing (another slot) is written after the file's own transaction.
        self.cluster = self.keys.cluster
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s

    def key(self, file_id: str) -> str:
        return self.keys.file(file_id)

    def _new(self, size: int, filename: str, purpose: str, ttl_s: int | None) -> FileObject:
        if purpose not in ("batch", "batch_output"):
            raise ValueError(f"unsupported purpose {purpose!r}")
        now = int(self.r.time()[0])
        return FileObject(
            id=_new_id("file"),
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=purpose,
            expires_at=now + (self.ttl_s if ttl_s is None else ttl_s),
        )

    def _register(self, pipe: redis.client.Pipeline, f: FileObject, tenant: str | None) -> None:
        """Queue the meta (and owner), the listing entry and the TTL of ``f`` on ``pipe``, then
        run it (on a cluster the listing entry follows the file's own transaction: a file is
        listed once it exists)."""
        key = self.key(f.id)
        pipe.hset(key, "meta", f.model_dump_json())
        if tenant is not None:
            pipe.hset(key, "tenant", tenant)
        pipe.expireat(key, f.expires_at or 0)
        pipe.expireat(self.keys.file_chunks(f.id), f.expires_at or 0)
        seq = self.r.incr(self.keys.files_seq)
        if not self.cluster:
            pipe.zadd(self.keys.files, {f.id: seq})
        pipe.execute()
        if self.cluster:
            self.r.zadd(self.keys.files, {f.id: seq})

    def create(
        self,
        content: bytes | str,
        filename: str,
        purpose: str = "batch",
        *,
        expires_after_s: int | None = None,
        tenant: str | None = None,
        tenant_max_bytes: int = 0,
    ) -> FileObject:
        """Store an uploaded file (at most ``max_bytes``); with ``tenant``, it is the file's owner
        (its own ``tenant`` field) and the file counts against the tenant's ``tenant_max_bytes``
        (0: no limit): over it, the file is removed again and
        :class:`~pagedserve.tenants.QuotaExceeded` raised."""
        data = content.encode() if isinstance(content, str) else content
        if len(data) > self.max_bytes:
            raise ValueError(f"file is {len(data)} bytes; the limit is {self.max_bytes}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"file is not UTF-8 text: {e}") from e
        obj = self._new(len(data), filename, purpose, expires_after_s)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key(obj.id), "content", text)
        self._register(pipe, obj, tenant)
        if tenant is not None:
            self._count_bytes(obj, tenant, tenant_max_bytes)
        return obj

    def create_from_list(
        self,
        lines_key: str,
        filename: str,
        purpose: str,
        *,
        expires_after_s: int | None = None,
        tenant: str | None = None,
    ) -> FileObject | None:
        """A generated file made of the lines of the Redis list ``lines_key`` (one per line),
        copied in chunks of :data:`FILE_CHUNK_LINES` (no size cap); ``None`` for an empty list.
        With ``tenant`` the file is that tenant's and its bytes count among the tenant's, never
        refused (a batch's results are not lost to the limit)."""
        n = self.r.llen(lines_key)
        if n == 0:
            return None
        file_id = _new_id("file")
        chunks = self.keys.file_chunks(file_id)
        size = 0
        for start in range(0, n, FILE_CHUNK_LINES):
            part = self.r.lrange(lines_key, start, start + FILE_CHUNK_LINES - 1)
            text = "".join(x + "\n" for x in part)
            size += len(text.encode())
            self.r.rpush(chunks, text)
            self.r.expire(chunks, MAX_TTL_S)  # bounded even if this process dies midway
        obj = self._new(size, filename, purpose, expires_after_s).model_copy(update={"id": file_id})
        pipe = self.r.pipeline(transaction=True)
        self._register(pipe, obj, tenant)
        if tenant is not None:
            self._count_bytes(obj, tenant, 0)
        return obj

    def _count_bytes(self, obj: FileObject, tenant: str, limit: int) -> None:
        """Count a file just written among its tenant's bytes (after it exists: the count drops
        entries whose file is gone); over ``limit`` (0: none) it is deleted again."""
        ok, total = TenantBook(self.r, self.keys).admit_file(
            tenant, self.key(""), obj.id, obj.bytes, limit
        )
        if not ok:
            self.delete(obj.id)
            raise QuotaExceeded("file bytes", int(total) + obj.bytes, limit)

    def owner(self, file_id: str) -> tuple[bool, str | None]:
        """(whether the file exists, its tenant) in one round trip."""
        meta, tenant = self.r.hmget(self.key(file_id), "meta", "tenant")
        return meta is not None, tenant

    def get(self, file_id: str) -> FileObject | None:
        meta = self.r.hget(self.key(file_id), "meta")
        return FileObject.model_validate_json(meta) if meta else None

    def iter_content(self, file_id: str) -> Iterator[str] | None:
        """The file's text in pieces (``None`` for an unknown file): streams a large file."""
        key = self.key(file_id)
        text, meta = self.r.hmget(key, "content", "meta")
        if meta is None:
            return None
        if text is not None:
            return iter([text])
        return self._chunks(file_id)

    def _chunks(self, file_id: str) -> Iterator[str]:
        key, i = self.keys.file_chunks(file_id), 0
        while True:
            part = self.r.lrange(key, i, i + 15)
            if not part:
                return
            yield from part
            i += len(part)

    def content(self, file_id: str) -> str | None:
        pieces = self.iter_content(file_id)
        return None if pieces is None else "".join(pieces)

    def delete(self, file_id: str) -> bool:
        """Delete a file; ``False`` if there was none."""
        if self.cluster:  # the file's keys share a slot; the listing is another
            deleted = self.r.delete(self.key(file_id), self.keys.file_chunks(file_id))
            self.r.zrem(self.keys.files, file_id)
            return bool(deleted)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(file_id), self.keys.file_chunks(file_id))
        pipe.zrem(self.keys.files, file_id)
        deleted, _ = pipe.execute()
        return bool(deleted)

    def _after_rank(self, after: str, tenant: str | None) -> int:
        """Where the page after ``after`` starts; ``KeyError`` for an id not listed (or, with
        ``tenant``, another tenant's: its id is not revealed)."""
        rank = self.r.zrevrank(self.keys.files, after)
        meta, owner = self.r.hmget(self.key(after), "meta", "tenant")
        foreign = tenant is not None and meta is not None and (owner or DEFAULT_TENANT) != tenant
        if rank is None or foreign:
            raise KeyError(f"file {after} not found")
        return rank + 1

    def list(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 20,
        *,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """OpenAI's list shape, newest first; ``after`` is the last id of the previous page.
        Entries of expired files are dropped from the listing as they are met. With ``tenant``,
        only that tenant's files (one without a ``tenant`` field is the default tenant's)."""
        limit = max(1, min(limit, 10_000))
        start = 0 if after is None else self._after_rank(after, tenant)
        window = 2 * limit if tenant is None else max(2 * limit, LIST_SCAN_WINDOW)
        page: list[FileObject] = []
        more = False
        while not more:
            ids = self.r.zrevrange(self.keys.files, start, start + window)
            if not ids:
                break
            pipe = self.r.pipeline(transaction=False)
            for fid in ids:
                pipe.hmget(self.key(fid), "meta", "tenant")
            gone = []
            for fid, (meta, owner) in zip(ids, pipe.execute(), strict=True):
                if meta is None:
                    gone.append(fid)
                    continue
                if more or (tenant is not None and (owner or DEFAULT_TENANT) != tenant):
                    continue
                f = FileObject.model_validate_json(meta)
                if purpose is not None and f.purpose != purpose:
                    continue
                if len(page) == limit:
                    more = True
                else:
                    page.append(f)
            if gone:
                self.r.zrem(self.keys.files, *gone)
            start += len(ids) - len(gone)
        return {
            "object": "list",
            "data": [f.model_dump(mode="json") for f in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": more,
        }
