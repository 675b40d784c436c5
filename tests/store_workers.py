"""Worker code for tests/test_store_contract.py and tests/test_store_redis.py.

A *job* is ``job(store, index, *args) -> picklable result``. Against Redis each job runs in
its own OS process (``run_processes``): the process opens its own store from the URL,
waits at a shared start barrier so all workers really overlap, runs the job and sends the
result back. Against MemoryStore the same jobs run in threads (``run_threads``), because
in-memory state cannot be shared across processes.

The module also holds whole-process entry points for the crash tests (a continuous writer
that records every acknowledged write, and a slowed-down purge to be SIGKILLed midway).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from marbles_rq.store import Store, open_store
from marbles_rq.store.records import (
    AgentRecord,
    EffectReceipt,
    EventRecord,
    JournalEntry,
    WorkspaceEntry,
)

BARRIER_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 120.0


def _raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(obj))


# -- jobs ------------------------------------------------------------------------------------


def claim_all(store: Store, index: int, n_ids: int) -> list[tuple[bool, str]]:
    """Claim every id ``ev-0 .. ev-<n-1>`` with a record naming this worker; even workers go
    up, odd workers go down, so both head-on and crossing races happen. Returns, per id (in
    id order), (won, source of the record the claim returned)."""
    order = range(n_ids) if index % 2 == 0 else range(n_ids - 1, -1, -1)
    out: dict[int, tuple[bool, str]] = {}
    for i in order:
        res = store.claim(EventRecord(version=1, id=f"ev-{i}", source=f"p{index}"))
        assert res.record.id == f"ev-{i}"
        out[i] = (res.won, res.record.source)
    return [out[i] for i in range(n_ids)]


def provision(store: Store, index: int, pkey: str) -> tuple[bool, str, bytes]:
    """Provision `pkey` proposing the agent id ``agent-p<index>``."""
    res = store.provision(AgentRecord(version=1, id=f"agent-p{index}", definition_id="def",
                                      provisioning_key=pkey, meta=_raw({"by": index})))
    return res.created, res.agent.id, msgspec.json.encode(res.agent)


def cas(store: Store, index: int, ws: str, key: str, expected: str | None,
        round_: int) -> tuple[bool, str | None, str]:
    """CAS the entry to ``u<round>-p<index>``; returns (ok, current, the updated_at tried)."""
    mine = f"u{round_}-p{index}"
    res = store.compare_and_set(
        WorkspaceEntry(version=1, workspace_id=ws, key=key, updated_at=mine,
                       value=_raw({"by": index, "round": round_})),
        expected)
    return res.ok, res.current, mine


def claim_effect(store: Store, index: int, scope: str, key: str,
                 epoch: int | None) -> tuple[bool, bool, bytes | None]:
    res = store.claim_effect(
        EffectReceipt(version=1, scope=scope, key=key, meta=_raw({"by": index})), epoch=epoch)
    receipt = None if res.receipt is None else bytes(res.receipt.meta)
    return res.won, res.stale, receipt


JOBS: dict[str, Callable[..., Any]] = {
    "claim_all": claim_all,
    "provision": provision,
    "cas": cas,
    "claim_effect": claim_effect,
}


# -- running jobs concurrently ---------------------------------------------------------------


def _process_main(url: str, job: str, index: int, args: tuple[Any, ...],
                  barrier: Any, results: Any) -> None:
    try:
        store = open_store(url)  # connect before the barrier: the race is the job, not setup
        barrier.wait(BARRIER_TIMEOUT_S)
        results.put((index, True, JOBS[job](store, index, *args)))
    except BaseException:
        barrier.abort()
        results.put((index, False, traceback.format_exc()))


_CTX: Any = None


def mp_context() -> Any:
    """forkserver with this module preloaded: each worker starts in milliseconds, and none
    inherits a connection or lock from the test process (unlike plain fork)."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.store_workers"])
        _CTX = ctx
    return _CTX


def run_processes(url: str, job: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Run ``JOBS[job](store, i, *args[i])`` in ``len(args)`` separate processes that start
    together; returns the results in worker order. Raises if any worker failed."""
    ctx = mp_context()
    barrier = ctx.Barrier(len(args))
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(url, job, i, a, barrier, results),
                         daemon=True) for i, a in enumerate(args)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        reported: set[int] = set()
        while len(reported) < len(procs):
            try:
                index, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                # A worker that died without reporting (a crash, not an exception) would
                # otherwise leave us waiting for the full timeout.
                dead = [i for i, p in enumerate(procs)
                        if i not in reported and p.exitcode is not None]
                if dead and results.empty():
                    raise AssertionError(
                        f"workers {dead} exited without a result (exit codes "
                        f"{[procs[i].exitcode for i in dead]})") from None
                if time.monotonic() > deadline:
                    msg = f"workers still running after {RESULT_TIMEOUT_S}s"
                    raise AssertionError(msg) from None
                continue
            reported.add(index)
            if ok:
                got[index] = value
            else:
                errors.append(f"worker {index}:\n{value}")
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("worker(s) failed:\n" + "\n".join(errors))
    return [got[i] for i in range(len(args))]


def run_threads(store: Store, job: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Like run_processes, with threads sharing one (in-memory) store."""
    barrier = threading.Barrier(len(args))
    got: dict[int, Any] = {}
    errors: list[str] = []

    def main(index: int, a: tuple[Any, ...]) -> None:
        try:
            barrier.wait(BARRIER_TIMEOUT_S)
            got[index] = JOBS[job](store, index, *a)
        except BaseException:
            barrier.abort()
            errors.append(f"worker {index}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=main, args=(i, a), daemon=True)
               for i, a in enumerate(args)]
    # A memory operation takes microseconds: with the default 5 ms GIL switch interval one
    # thread can finish its whole job before the others run. Switch often, so they overlap.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(RESULT_TIMEOUT_S)
    finally:
        sys.setswitchinterval(interval)
    if errors or any(t.is_alive() for t in threads):
        raise AssertionError("worker(s) failed or hung:\n" + "\n".join(errors))
    return [got[i] for i in range(len(args))]


# -- whole-process entry points for crash tests ----------------------------------------------


def continuous_writer(url: str, ack_path: str) -> None:
    """Write claims, CAS updates and journal entries in a loop until Redis goes away; after
    each acknowledged write append one line to `ack_path` (O_APPEND, unbuffered):

        claim <id>            EventRecord <id> with source "writer"
        cas <key> <n>         entry ws-writer/<key> now has updated_at "<n:08d>"
        journal <id>          entry <id> of journal "jwriter", type "t-<id>"
    """
    store = open_store(url)
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    versions: dict[str, int] = {}
    n = 0
    try:
        while True:
            rid = f"w-{n}"
            if store.claim(EventRecord(version=1, id=rid, source="writer"), owner="").won:
                os.write(fd, f"claim {rid}\n".encode())
            key = f"k{n % 7}"
            cur = versions.get(key)
            new = (cur or 0) + 1
            res = store.compare_and_set(
                WorkspaceEntry(version=1, workspace_id="ws-writer", key=key,
                               updated_at=f"{new:08d}", value=_raw(new)),
                None if cur is None else f"{cur:08d}")
            if not res.ok:
                raise AssertionError(f"writer CAS conflict on {key}: {res}")
            versions[key] = new
            os.write(fd, f"cas {key} {new}\n".encode())
            if store.append("jwriter", JournalEntry(version=1, id=rid, type=f"t-{rid}")).won:
                os.write(fd, f"journal {rid}\n".encode())
            n += 1
    finally:
        os.close(fd)


def slow_purge(url: str, owner: str, batch_size: int, pause_s: float) -> None:
    """purge(owner) with a pause after every batch script, so a SIGKILL lands midway."""
    store = open_store(url)
    real_call = store.scripts.call

    def call(name: str, keys: list[str], args: list[Any]) -> list[Any]:
        reply = real_call(name, keys, args)
        if name == "purge_owned":
            time.sleep(pause_s)
        return reply

    store.scripts.call = call  # type: ignore[method-assign]
    store.purge(owner, batch_size=batch_size)


def start_process(target: Callable[..., None], *args: Any) -> Any:
    proc = mp_context().Process(target=target, args=args, daemon=True)
    proc.start()
    return proc
