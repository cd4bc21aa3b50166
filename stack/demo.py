"""``pagedserve demo``: ``up`` in the background, real questions and a real batch, then stop.

The demo asks the served model (by default the embedded SmolLM2-135M-Instruct) a few simple
factual questions as interactive chat jobs, greedy, and prints each question with its answer; it
also uploads an OpenAI batch file of a few dozen ``/v1/chat/completions`` lines (``model`` naming
the served model), waits for the control plane to write the batch's output file, saves it under
the home directory and prints some of its answers. A JSON summary goes to stdout; progress and
the question/answer pairs go to stderr. ``--keep`` keeps serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from stack.supervisor import (
    Supervisor,
    config_from,
    has_module,
    install_signals,
    parser,
    setup_logging,
    up_line,
)

#: Asked as interactive chat jobs (greedy; SmolLM2 answers each of these correctly).
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "What is 2+2?",
    "What is the capital of Japan?",
    "What is the boiling point of water in Celsius?",
    "How many days are in a week?",
    "What is the chemical symbol for gold?",
)
COUNTRIES = (
    "France", "Germany", "Japan", "Egypt", "Canada", "Russia", "China", "the United Kingdom",
    "Greece", "India", "Portugal", "Mexico", "Brazil", "Poland", "Norway",
)  # fmt: skip
#: The batch's questions (one line each, cycled to ``--batch-lines``). A 135M model is no oracle:
#: some of its answers to these are wrong, and the batch shows them as they come.
BATCH_QUESTIONS = (
    *(f"What is the capital of {country}?" for country in COUNTRIES),
    "What is 2+2?",
    "What is 6+6?",
    "What is 1+1?",
    "How many days are in a week?",
    "How many hours are in a day?",
    "What is the boiling point of water in Celsius?",
    "What is the chemical symbol for gold?",
    "What is the opposite of hot?",
    "What is the largest ocean on Earth?",
)
#: Greedy and short: the answers are deterministic and the demo quick.
ANSWER_PARAMS = {"max_tokens": 48, "temperature": 0.0}
BATCH_FINAL = ("completed", "failed", "expired", "cancelled")


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def ask(sup: Supervisor, questions: Sequence[str]) -> list[dict[str, Any]]:
    """The questions as interactive chat jobs, with a progress bar; one record per question."""
    from tqdm import tqdm

    from pagedserve.client import Client

    client = Client(sup.redis_url, prefix=sup.cfg.prefix)
    ids = client.submit_many([_chat(q) for q in questions], ANSWER_PARAMS)
    with tqdm(total=len(ids), desc="demo questions", unit="job", file=sys.stderr) as bar:
        while (done := sum(s.terminal for s in client.store.statuses(ids))) < len(ids):
            bar.update(done - bar.n)
            time.sleep(0.1)
        bar.update(done - bar.n)
    out = []
    for q, rec in zip(questions, client.store.get_many(ids), strict=True):
        answer = rec.result.completions[0].text if rec and rec.result else None
        out.append({"question": q, "status": rec.status.value if rec else None, "answer": answer})
    return out


def batch_lines(model: str, n: int) -> str:
    """``n`` OpenAI batch lines asking :data:`BATCH_QUESTIONS` in turn of ``model``."""
    lines = []
    for i in range(n):
        body = {"model": model, "messages": _chat(BATCH_QUESTIONS[i % len(BATCH_QUESTIONS)])}
        lines.append(
            {
                "custom_id": f"q-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body | ANSWER_PARAMS,
            }
        )
    return "".join(json.dumps(x) + "\n" for x in lines)


def start_batch(sup: Supervisor, model: str, n: int) -> tuple[Any, str] | None:
    """Upload the batch file and fan it out (None when the batch modules are not installed)."""
    if n <= 0 or not has_module("pagedserve.batches"):
        return None
    from pagedserve.batches import BatchStore

    bs = BatchStore(sup.redis_url, prefix=sup.cfg.prefix)
    f = bs.files.create(batch_lines(model, n), "demo-questions.jsonl")
    b = bs.create(f.id, "/v1/chat/completions")
    bs.fan_out(b.id)
    return bs, b.id


def finish_batch(sup: Supervisor, bs: Any, batch_id: str, timeout: float = 300.0) -> dict[str, Any]:
    """Wait for the batch to end; save its output file under the home directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = bs.get(batch_id)
        c = b.request_counts
        # Counted by the worker; the control plane then writes the files and completes it.
        counted = c.total and c.completed + c.failed >= c.total
        if counted and (b.status in BATCH_FINAL or not sup.has("control-plane")):
            break
        time.sleep(0.2)
    out: dict[str, Any] = {
        "id": b.id,
        "status": b.status,
        "request_counts": b.request_counts.model_dump(),
        "output_file_id": b.output_file_id,
    }
    text = bs.files.content(b.output_file_id) if b.output_file_id else None
    if text is not None:
        path = sup.home / "demo-batch-output.jsonl"
        path.write_text(text)
        out["output_path"] = str(path)
        out["answers"] = batch_answers(text)
    return out


def batch_answers(output_jsonl: str) -> list[dict[str, Any]]:
    """(custom_id, question, answer) of each output line, in custom_id order."""
    rows = []
    for line in output_jsonl.splitlines():
        rec = json.loads(line)
        i = int(rec["custom_id"].removeprefix("q-"))
        body = (rec.get("response") or {}).get("body") or {}
        choices = body.get("choices") or [{}]
        answer = (choices[0].get("message") or {}).get("content")
        rows.append(
            {
                "custom_id": rec["custom_id"],
                "question": BATCH_QUESTIONS[i % len(BATCH_QUESTIONS)],
                "answer": answer,
            }
        )
    return sorted(rows, key=lambda r: int(r["custom_id"].removeprefix("q-")))


def show(title: str, rows: Sequence[dict[str, Any]]) -> None:
    print(f"\n{title}", file=sys.stderr)
    for r in rows:
        answer = " ".join((r.get("answer") or f"<{r.get('status')}>").split())
        print(f"  Q: {r['question']}\n  A: {answer}", file=sys.stderr)


def run_demo(sup: Supervisor, jobs: int, lines: int) -> dict[str, Any]:
    hb = sup.wait_worker()
    model = str(hb.get("model") or "")
    questions = [DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)] for i in range(jobs)]
    # The batch runs at bulk priority behind the interactive questions, on the same worker.
    started = start_batch(sup, model, lines)
    answers = ask(sup, questions)
    show(f"{model} answers (greedy, chat jobs):", answers)
    summary: dict[str, Any] = {"model": model, "jobs": len(answers), "statuses": {}}
    for a in answers:
        summary["statuses"][a["status"]] = summary["statuses"].get(a["status"], 0) + 1
    summary["answers"] = answers
    if started is not None:
        summary["batch"] = batch = finish_batch(sup, *started)
        if "answers" in batch:
            shown = batch["answers"][:5]
            show(f"batch {batch['id']}: {len(batch['answers'])} answers, the first:", shown)
            print(f"  (all in {batch['output_path']})", file=sys.stderr)
    summary["look"] = sup.urls()
    return summary


def _parser() -> argparse.ArgumentParser:
    ap = parser("demo")
    ap.description = __doc__.split("\n")[0]
    ap.add_argument("--jobs", type=int, default=len(DEMO_QUESTIONS), help="questions to ask")
    ap.add_argument("--batch-lines", type=int, default=24, help="lines of the demo batch")
    ap.add_argument("--keep", action="store_true", help="keep serving after the demo")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    sup = Supervisor(config_from(args))
    install_signals(sup)
    try:
        sup.start()
        print(json.dumps(up_line(sup)), file=sys.stderr, flush=True)
        summary = run_demo(sup, args.jobs, args.batch_lines)
        summary["pids"] = sup.pids()
        print(json.dumps(summary, indent=2), flush=True)
        if args.keep:
            print("serving; Ctrl-C stops everything", file=sys.stderr)
            return sup.wait()
        return 0
    finally:
        sup.stop()


__all__ = ["main", "run_demo"]

if __name__ == "__main__":
    raise SystemExit(main())
