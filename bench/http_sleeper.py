"""The local HTTP server of ``bench/concurrency.py --io``: answers every GET after a
non-blocking sleep (50 ms by default), HTTP/1.1 with keep-alive, on plain asyncio streams so
it serves hundreds of requests at once on one core and costs little next to the workers.

    python -m bench.http_sleeper --port 8765 [--delay-ms 50]

On SIGTERM it prints how many requests it answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

BODY = b"ok"
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
            + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


async def serve(port: int, delay_s: float) -> int:
    answered = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await asyncio.sleep(delay_s)
                writer.write(RESPONSE)
                await writer.drain()
                answered += 1
                if b"connection: close" in head.lower():
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on 127.0.0.1:{port}, delay {delay_s * 1000:.0f} ms", flush=True)
    async with server:
        await stop.wait()
    return answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        answered = asyncio.run(serve(args.port, args.delay_ms / 1000))
        print(f"answered {answered} requests", flush=True)


if __name__ == "__main__":
    main()
