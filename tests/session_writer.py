"""One writer process of tests/test_sessions.py: appends `count` messages {"w": writer,
"j": j} to one session, each with the idempotency key ``w<writer>-<j>``, and writes each
confirmed j to its progress file (one line each). Started again after a kill -9, it resends
from the first unconfirmed message with the same keys: what the server had already appended
is answered with its first position, appended nothing twice.

    python -m tests.session_writer REDIS_URL SESSION WRITER COUNT PROGRESS_FILE
"""

from __future__ import annotations

import os
import sys

import marbles_rq as mr


def main() -> None:
    url, session_id, writer, count, progress = sys.argv[1:6]
    done = 0
    if os.path.exists(progress):
        with open(progress) as f:
            done = sum(1 for line in f if line.endswith("\n"))  # a torn last line: resent
    client = mr.connect(url)
    session = client.session(session_id)
    with open(progress, "a") as out:
        for j in range(done, int(count)):
            session.append({"w": int(writer), "j": j}, key=f"w{writer}-{j}")
            out.write(f"{j}\n")
            out.flush()
    print("done", flush=True)


if __name__ == "__main__":
    main()
