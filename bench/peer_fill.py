"""Fills the Dramatiq or Huey queue of bench/concurrency.py, from bench/.peers, through each
library's own enqueue call (one message at a time: neither has a pipelined bulk enqueue).
A script of its own so that the tasks are registered under their module's name,
``bench.peer_tasks``, which the consumers import (run as ``__main__`` they would not be)::

    bench/.peers/bin/python -m bench.peer_fill dramatiq|huey noop|io N [URL]
"""

from __future__ import annotations

import sys

from bench import peer_tasks


def fill(peer: str, job: str, n: int, url: str) -> None:
    args = (url,) if job == "io" else ()
    if peer == "dramatiq":
        actor = peer_tasks.d_io if job == "io" else peer_tasks.d_noop
        for _ in range(n):
            actor.send(*args)
    else:
        task = peer_tasks.h_io if job == "io" else peer_tasks.h_noop
        for _ in range(n):
            task(*args)


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[0] in ("dramatiq", "huey") and argv[1] in ("noop", "io"):
        fill(argv[0], argv[1], int(argv[2]), argv[3] if len(argv) == 4 else "")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
