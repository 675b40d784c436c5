"""`etl`: fetch a document, transform it, publish it -- the shape most real workflows have.

The fetch is safe to repeat. The publish is an effect on another system, so it is keyed on
the run's idempotency key: if the worker dies after publishing but before the step commits,
the redelivered run publishes again with the same key, and the target keeps one copy.

    marbles-rq --source examples/etl.py enqueue etl \\
        --input '{"url": "file:///etc/os-release", "target": "reports"}'
"""

from __future__ import annotations

import hashlib
import os
import urllib.request

import msgspec
import redis

import marbles_rq as mr


class EtlInput(msgspec.Struct):
    url: str
    target: str = "reports"
    max_bytes: int = 1 << 20


class Report(msgspec.Struct):
    lines: int
    words: int
    sha256: str
    first_line: str


@mr.step(retries=3, backoff="exponential", delay_s=0.5)
def fetch(url: str, max_bytes: int) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read(max_bytes).decode("utf-8", errors="replace")


@mr.step
def transform(text: str) -> Report:
    lines = text.splitlines()
    return Report(lines=len(lines), words=len(text.split()),
                  sha256=hashlib.sha256(text.encode()).hexdigest(),
                  first_line=lines[0] if lines else "")


@mr.step(retries=5, delay_s=1.0)
def publish_report(target: str, report: Report) -> str:
    """Publish to a system that takes an idempotency key (here: a Redis hash written with
    HSETNX under the key; a payment or email API would take it as a header)."""
    key = mr.current().idempotency_key
    sink = redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))
    first = sink.hsetnx(f"etl:{target}", key, msgspec.json.encode(report))
    mr.current().log.info("published %s under %s%s", report.sha256[:12], key,
                          "" if first else " (already there: a repeat after a redelivery)")
    return key


@mr.workflow(timeout_s=300)
def etl(ctx: mr.RunContext, inp: EtlInput) -> dict[str, object]:
    text = fetch(inp.url, inp.max_bytes)
    report = transform(text)
    ctx.stream.write(f"{report.lines} lines, {report.words} words")
    key = publish_report(inp.target, report)
    return {"published_as": key, "sha256": report.sha256}
