"""Structured extraction with the embedded SmolLM2-135M-Instruct: JSON that always parses and
validates, and the grammar engine built on its real 49k-token tokenizer. One batch (greedy,
seeded and choice rows together), so the test costs one generation's steps."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from bench.structured_schemas import SCHEMAS
from pagedserve.params import SamplingParams
from worker import LLM

INVOICE_SCHEMA = SCHEMAS[9]  # name (<= 40 chars), date (YYYY-MM-DD), amount (0..1e6)
INVOICES = [
    "INVOICE #1042\nBilled to: Maria Gonzalez\nDate: 2024-03-15\nTotal due: $1,250.00",
    "Invoice from ACME Corp. to John Smith, issued on 2023-11-02. Amount: 89.99 EUR.",
    "Bill No. 77 | Customer: Li Wei | 2025-01-30 | TOTAL 4300.50",
    "Dear Peter Novak, your invoice dated 2024-07-08 totals 15.75 USD. Thank you!",
    "Invoice 2024/118 - client: Fatima Khan - date 2024-12-24 - sum: 640",
]
LABELS = ["positive", "negative"]


def ask(invoice: str) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": "Extract the customer name, the invoice date (YYYY-MM-DD) and the total "
            f"amount from this invoice, as JSON.\n\n{invoice}",
        }
    ]


@pytest.mark.timeout(900)  # one batch of ~60 steps; generous for a loaded 2-core machine
def test_invoice_extraction_is_always_valid_json(real_model_dir: Path) -> None:
    llm = LLM(real_model_dir, num_kv_blocks=128, block_size=16)
    so = {"json": INVOICE_SCHEMA}
    greedy = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so)
    seeded = [
        SamplingParams(temperature=0.7, seed=s, max_tokens=80, structured_outputs=so)
        for s in range(3)
    ]
    label = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": LABELS})
    convs = [ask(t) for t in INVOICES] + [ask(t) for t in INVOICES[:3]]
    convs += [[{"role": "user", "content": f"Is this review positive or negative? {r}"}]
              for r in ("I love it!", "This is awful.")]  # fmt: skip
    outs = llm.chat(convs, [greedy] * len(INVOICES) + seeded + [label, label])
    extractions, labels = outs[:-2], outs[-2:]
    for out in extractions:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), INVOICE_SCHEMA)
    # The constraint is not a template: the greedy answers differ between invoices.
    assert len({o.outputs[0].text for o in extractions[: len(INVOICES)]}) == len(INVOICES)
    assert all(o.outputs[0].text in LABELS for o in labels)
