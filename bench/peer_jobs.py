"""Plain job bodies of bench/concurrency.py's peers: RQ imports them from the project's venv
(``bench.peer_jobs.noop``), Dramatiq and Huey through bench/peer_tasks.py in bench/.peers.

* ``noop``      returns 1 (Huey keeps a non-None result, the bench counts them);
* ``io_three``  three sequential GETs of the bench's local HTTP server (it answers after
  50 ms), on one kept-alive httpx connection per thread, as the marbles-rq ``io_flow``
  does with one ``httpx.AsyncClient`` per event loop.
"""

from __future__ import annotations

import threading
from typing import Any

_local = threading.local()


def noop() -> int:
    return 1


def _client() -> Any:
    client = getattr(_local, "client", None)
    if client is None:
        import httpx

        client = _local.client = httpx.Client(timeout=30)
    return client


def io_three(url: str) -> int:
    client = _client()
    total = 0
    for _ in range(3):
        resp = client.get(url)
        resp.raise_for_status()
        total += len(resp.content)
    return total
