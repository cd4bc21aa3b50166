"""The ``pagedserve`` command line (also ``python -m stack``); prints JSON.

``submit``, ``status``, ``cancel`` and ``batch`` talk to Redis only. ``make-model``, ``worker``,
``api``, ``up``, ``demo``, ``import-gguf`` and ``models`` hand their remaining arguments to
another module's ``main(argv)``, imported inside a loader function only when used, so that the
light subcommands never load torch or flask.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pagedserve import package_version, settings
from pagedserve.keys import PREFIX_ENV
from pagedserve.redis_url import CLUSTER_SCHEME
from pagedserve.redis_util import URL_ENV
from pagedserve.settings import add_options, build, opt

#: Environment variable through which ``--prefix`` reaches delegated subcommands.

#: A delegated subcommand's entry point: ``main(argv)``, returning an exit status (None: 0).
Entry = Callable[[list[str]], int | None]


def _make_model() -> Entry:
    from worker import make_model

    return make_model.main


def _worker() -> Entry:
    from worker import service

    return service.main


def _api() -> Entry:
    from api import server

    return server.main


def _up() -> Entry:
    from stack import supervisor

    return supervisor.main


def _demo() -> Entry:
    from stack import demo

    return demo.main


def _import_gguf() -> Entry:
    from worker import gguf

    return gguf.main


def _models() -> Entry:
    from worker import model_source

    return model_source.main


@dataclass(frozen=True)
class Delegate:
    """A subcommand that forwards everything after it to ``module``'s ``main``."""

    #: The module whose ``main`` runs (for help and errors; ``load`` imports it).
    module: str
    load: Callable[[], Entry]


#: Subcommands that forward everything after them to another module's ``main(argv)``.
DELEGATED = {
    "make-model": Delegate("worker.make_model", _make_model),
    "worker": Delegate("worker.service", _worker),
    "api": Delegate("api.server", _api),
    "up": Delegate("stack.supervisor", _up),
    "demo": Delegate("stack.demo", _demo),
    "import-gguf": Delegate("worker.gguf", _import_gguf),
    "models": Delegate("worker.model_source", _models),
}
_BY_MODULE = {d.module: d for d in DELEGATED.values()}


def _print(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Connection:
    """The global options: where the job store is and whose records this command writes."""

    redis_url: str = settings.redis_url_field()
    prefix: str = settings.prefix_field()
    tenant: str | None = field(
        default=None,
        metadata=opt(
            "tenant written on the jobs, files and batches this command creates (default: none,"
            " which the API reads as the 'default' tenant)"
        ),
    )


def _conn(args: argparse.Namespace) -> Connection:
    return build(Connection, args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pagedserve {package_version()}")
    add_options(ap, Connection)
    ap.add_argument(
        CLUSTER_FLAG,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="a Redis Cluster: the same as --redis redis+cluster://HOST:PORT,... (any subcommand)",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="the environment variables read, with defaults and current values")

    s = sub.add_parser("submit", help="queue one job; prints {id} (or the record with --wait)")
    s.add_argument("prompt", help="prompt text, or a JSON list of chat messages with --chat")
    s.add_argument("--chat", action="store_true", help="PROMPT is a JSON list of {role, content}")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    so = s.add_mutually_exclusive_group()  # structured outputs: at most one constraint
    so.add_argument("--json-schema", metavar="FILE", help="constrain to this JSON schema file")
    so.add_argument("--json-object", action="store_true", help="constrain to any JSON object")
    so.add_argument("--regex", help="constrain the text to match this regex")
    so.add_argument("--choice", action="append", help="constrain to one of these (repeatable)")
    so.add_argument("--grammar", metavar="FILE", help="constrain to this Lark or GBNF grammar")
    s.add_argument("--priority", choices=["interactive", "bulk"], default="interactive")
    s.add_argument("--idempotency-key", default=None)
    s.add_argument("--metadata", default=None, help="a JSON object stored with the job")
    s.add_argument("--model", default=None)
    s.add_argument("--wait", action="store_true", help="wait for the job and print its record")
    s.add_argument("--timeout", type=float, default=None, help="seconds to --wait")

    st = sub.add_parser("status", help="print a job's record ({id, status: not_found} if none)")
    st.add_argument("id")

    c = sub.add_parser("cancel", help="cancel a job; prints {id, status}")
    c.add_argument("id")

    _batch_parser(sub)
    cp = sub.add_parser("control-plane", help="run the Celery worker with embedded beat")
    cp.add_argument("--pool", choices=["solo", "threads"], default="solo")
    cp.add_argument("--loglevel", default="INFO")

    for name, delegate in DELEGATED.items():
        help_text = f"run {delegate.module}.main with the remaining arguments"
        sub.add_parser(name, help=help_text, add_help=False)
    return ap


def _batch_parser(sub: Any) -> None:
    b = sub.add_parser("batch", help="OpenAI-style batches (JSONL files)")
    bsub = b.add_subparsers(dest="batch_command", required=True)
    s = bsub.add_parser("submit", help="upload FILE.jsonl, create a batch and fan it out")
    s.add_argument("file")
    s.add_argument("--endpoint", default=None, help="default: the url of the first line")
    s.add_argument("--completion-window", default="24h")
    s.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    s.add_argument("--output", default=None, help="with --wait: write the output file here")
    s.add_argument("--poll", type=float, default=1.0, help="seconds between polls (--wait)")
    for name in ("status", "cancel"):
        bsub.add_parser(name, help=f"{name} a batch").add_argument("id")
    ls = bsub.add_parser("list", help="batches, newest first")
    ls.add_argument("--after", default=None)
    ls.add_argument("--limit", type=int, default=20)


def _client(args: argparse.Namespace) -> Any:
    from pagedserve.client import Client

    c = _conn(args)
    return Client(c.redis_url, prefix=c.prefix, tenant=c.tenant)


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """``SamplingParams.structured_outputs`` from the submit flags (files are read here)."""
    if args.json_schema:
        return {"json": json.loads(Path(args.json_schema).read_text())}
    if args.json_object:
        return {"json": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    if args.grammar:
        return {"grammar": Path(args.grammar).read_text()}
    return None


def _submit(args: argparse.Namespace) -> int:
    from pagedserve.client import build_request

    params = {
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "n": args.n,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    try:
        so = _structured_outputs(args)
        if so is not None:
            params["structured_outputs"] = so
        prompt = json.loads(args.prompt) if args.chat else args.prompt
        metadata = json.loads(args.metadata) if args.metadata else None
        req = build_request(
            prompt,
            params,
            priority=args.priority,
            idempotency_key=args.idempotency_key,
            metadata=metadata,
            model=args.model,
        )
    except (ValidationError, json.JSONDecodeError, OSError) as e:
        _print({"error": "invalid request", "detail": str(e)})
        return 2
    client = _client(args)
    job_id = client.submit_request(req)
    if not args.wait:
        _print({"id": job_id})
        return 0
    try:
        rec = client.wait(job_id, timeout=args.timeout)
    except TimeoutError as e:
        _print({"id": job_id, "error": str(e)})
        return 3
    _print(rec.model_dump(mode="json"))
    return 0 if rec.status == "succeeded" else 1


def _status(args: argparse.Namespace) -> int:
    rec = _client(args).get(args.id)
    if rec is None:
        _print({"id": args.id, "status": "not_found"})
        return 1
    _print(rec.model_dump(mode="json"))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    status = _client(args).cancel(args.id)
    _print({"id": args.id, "status": status.value})
    return 1 if status == "not_found" else 0


def _batch_store(args: argparse.Namespace) -> Any:
    from pagedserve.batches import BatchStore

    c = _conn(args)
    return BatchStore(c.redis_url, prefix=c.prefix)


def _celery(args: argparse.Namespace) -> Any:
    from pagedserve.celery_client import make_sender

    return make_sender(_conn(args).redis_url)


def _first_url(data: bytes) -> str:
    for text in data.decode("utf-8", errors="replace").splitlines():
        if text.strip():
            try:
                url = json.loads(text).get("url")
            except (json.JSONDecodeError, AttributeError):
                break
            if isinstance(url, str):
                return url
            break
    return "/v1/completions"


def _batch_submit(args: argparse.Namespace) -> int:
    bs = _batch_store(args)
    with open(args.file, "rb") as fh:
        data = fh.read()
    try:
        f = bs.files.create(data, os.path.basename(args.file), tenant=_conn(args).tenant)
        endpoint = args.endpoint or _first_url(data)
        b = bs.create(f.id, endpoint, args.completion_window, tenant=_conn(args).tenant)
    except (ValueError, KeyError) as e:
        _print({"error": str(e)})
        return 2
    _celery(args).send_task("batches.fan_out", [b.id])
    if not args.wait:
        _print(b.model_dump(mode="json"))
        return 0
    b = _wait_batch(bs, b.id, args.poll)
    if args.output and b.output_file_id:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(bs.files.content(b.output_file_id) or "")
    _print(b.model_dump(mode="json"))
    return 0 if b.status == "completed" else 1


def _wait_batch(bs: Any, batch_id: str, poll: float) -> Any:
    import time

    from tqdm import tqdm

    final = {"completed", "failed", "expired", "cancelled"}
    with tqdm(desc=batch_id, unit="req", file=sys.stderr) as bar:
        while True:
            b = bs.get(batch_id)
            c = b.request_counts
            bar.total = c.total or None
            bar.n = c.completed + c.failed
            bar.set_postfix(status=b.status, failed=c.failed)
            bar.refresh()
            if b.status in final:
                return b
            time.sleep(poll)


def _batch(args: argparse.Namespace) -> int:
    if args.batch_command == "submit":
        return _batch_submit(args)
    bs = _batch_store(args)
    if args.batch_command == "list":
        _print(bs.list(after=args.after, limit=args.limit, tenant=_conn(args).tenant))
        return 0
    if args.batch_command == "cancel":
        b = _celery(args).send_task("batches.cancel", [args.id]).get(timeout=60)
    else:
        got = bs.get(args.id)
        b = got.model_dump(mode="json") if got else None
    if b is None:
        _print({"id": args.id, "status": "not_found"})
        return 1
    _print(b)
    return 0


def _control_plane(args: argparse.Namespace) -> int:
    c = _conn(args)
    os.environ[URL_ENV] = c.redis_url
    os.environ[PREFIX_ENV] = c.prefix
    from stack.celery_app import app

    argv = ["worker", "-B", f"--pool={args.pool}", "--concurrency=1", f"--loglevel={args.loglevel}"]
    app.worker_main(argv)
    return 0


def _env(_args: argparse.Namespace) -> int:
    _print(settings.describe())
    return 0


def _split_delegated(argv: list[str]) -> tuple[dict[str, str], str, list[str]] | None:
    """``[global options] make-model|worker REST...`` -> (global options, module, REST)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("--redis", "--prefix") and i + 1 < len(argv):
            opts[tok[2:]] = argv[i + 1]
            i += 2
        elif tok.startswith(("--redis=", "--prefix=")):
            name, _, value = tok[2:].partition("=")
            opts[name] = value
            i += 1
        elif tok in DELEGATED:
            return opts, DELEGATED[tok].module, argv[i + 1 :]
        else:
            return None
    return None


#: ``--redis-cluster NODES`` anywhere on the line stands for ``--redis redis+cluster://NODES``.
CLUSTER_FLAG = "--redis-cluster"


def cluster_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``--redis-cluster NODES`` spelled ``--redis redis+cluster://NODES``
    (delegated subcommands, worker and api included, then read it as their ``--redis``)."""
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok == CLUSTER_FLAG:
            out += ["--redis", f"{CLUSTER_SCHEME}://{next(it, '')}"]
        elif tok.startswith(CLUSTER_FLAG + "="):
            out += ["--redis", f"{CLUSTER_SCHEME}://{tok.partition('=')[2]}"]
        else:
            out.append(tok)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = cluster_flag(sys.argv[1:] if argv is None else argv)
    delegated = _split_delegated(argv)
    if delegated is not None:
        opts, module_name, rest = delegated
        # The other module parses its own arguments; global options reach it by the environment.
        if "redis" in opts:
            os.environ[URL_ENV] = opts["redis"]
        if "prefix" in opts:
            os.environ[PREFIX_ENV] = opts["prefix"]
        try:
            entry = _BY_MODULE[module_name].load()
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise
            _print({"error": f"{module_name} is not available: {e}"})
            return 2
        return int(entry(rest) or 0)
    args = _parser().parse_args(argv)
    handlers = {
        "submit": _submit,
        "status": _status,
        "cancel": _cancel,
        "batch": _batch,
        "control-plane": _control_plane,
        "env": _env,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
