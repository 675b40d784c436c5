"""One enqueuer process of tests/test_enqueue_gates.py: for each burst, waits for the burst's
go key, starts `count` runs of a workflow through the Python client, prints one JSON line per
start (its input and the decision) and pushes to the burst's done key.

    python -m tests.gate_enqueuer URL WORKFLOW BURSTS COUNT INDEX CUSTOMER KEYBASE
"""

from __future__ import annotations

import json
import sys

import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import load_source


def main() -> None:
    url, workflow, bursts, count, index, customer, base = sys.argv[1:8]
    load_source("tests/gate_workflows.py")
    conn = redis.Redis.from_url(url)
    client = mr.connect(url)
    conn.rpush(f"{base}:ready", index)
    for burst in range(int(bursts)):
        go = f"{base}:go:{burst}"
        if not conn.blpop([go], timeout=120):
            raise SystemExit(f"no go for burst {burst}")
        conn.rpush(go, "go")  # the next process goes too
        for i in range(int(count)):
            n = burst * 10_000 + int(index) * 1000 + i
            inp = {"customer": customer, "n": n, "items": [n]}
            handle = client.start(workflow, inp)
            print(json.dumps({"burst": burst, "input": inp, "id": handle.id,
                              "decision": handle.decision.to_json()}), flush=True)
        conn.rpush(f"{base}:done:{burst}", index)


if __name__ == "__main__":
    main()
