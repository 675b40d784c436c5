"""An application using marbles-rq through the client: it starts runs of the shop's
workflows (examples/app/shop.py) by name, waits for their results, approves an order that
waits for a person, and handles the typed errors. It does not import the workflows.

    marbles-rq --source examples/app/shop.py dev          # in another terminal
    export MARBLES_REDIS_URL=redis://127.0.0.1:6399/0
    .venv/bin/python examples/app/client_demo.py

Each line it prints starts with what it did; it exits 0 when every step went as expected.
"""

from __future__ import annotations

import sys
import uuid

import marbles_rq as mr


def main() -> int:
    tag = uuid.uuid4().hex[:8]  # a fresh set of order ids per invocation
    with mr.connect() as client:  # MARBLES_REDIS_URL, MARBLES_PREFIX: as the CLI
        # Start and wait: the run's id is the order's, so starting it again is harmless.
        run = client.start("place_order", {"sku": "book", "qty": 3}, id=f"order-{tag}-1")
        print("placed:", run.result(timeout=60))
        again = client.start("place_order", {"sku": "book", "qty": 3}, id=f"order-{tag}-1")
        print("started again:", "created" if again.created else "the same run, nothing new")

        # Many at once: validated first, recorded and enqueued in one round trip.
        handles = client.start_many([
            mr.StartRequest("place_order", {"sku": sku}, id=f"order-{tag}-{sku}")
            for sku in ("lamp", "book")])
        print("batch:", [h.result(timeout=60)["total"] for h in handles])

        # A run that fails: result() raises its error, typed.
        try:
            client.start("place_order", {"sku": "unicorn"}).result(timeout=60)
        except mr.RunFailedError as exc:
            print("failed:", exc.error["type"], exc.error["message"])

        # A big order waits for an approval: follow its output until it parks, approve.
        big = client.start("place_order", {"sku": "sofa", "qty": 2}, id=f"order-{tag}-big")
        for entry in big.watch():
            if entry.type == "parked":
                break
        asked = [q for q in big.status().questions if q.state == "open"]
        print("waiting for:", [(q.key, q.title) for q in asked])
        print("approve:", big.approve("big-order", note="regular customer").message)
        print("big order:", big.result(timeout=60))

        # Cancel a run that has not finished: result() says so.
        slow = client.start("restock", {"sku": "lamp", "steps": 50, "sleep_s": 0.2})
        print("cancel:", slow.cancel().outcome)
        try:
            slow.result(timeout=60)
        except mr.RunCancelledError:
            print("restock: cancelled")

        # A wait with a timeout: the run goes on; wait again later.
        try:
            client.start("restock", {"sku": "book", "steps": 3}).result(timeout=0.01)
        except mr.ResultTimeoutError as exc:
            print("timeout:", exc.code)

        page = client.runs(workflow="place_order", limit=10)
        print("recent orders:", len(page.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
