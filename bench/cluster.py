"""Benchmark (not a test): a deployment of 3 lanes on a 3-master Redis Cluster.

Run from the repo root::

    python -m bench.cluster [--runs 3000] [--pool 2] [--buckets N]

Starts a 3-master cluster (``ops/redis.conf`` on every node, no replicas), then with
``MARBLES_LANE_COUNT=3`` and ``RQ_KEY_PREFIX={mrq:rq}``: records ``--runs`` one-step runs
(``bench/runs_flows.py``) from this process with ``ops.enqueue_many`` (first delivery of each
to its lane), starts one ``marbles-rq controller`` and one ``marbles-rq worker --pool P
--lanes all`` and waits until every run settled. Prints, per master, over that window:

* commands (``INFO commandstats``, those inside scripts included), keys (``DBSIZE``) and
  memory (``used_memory`` growth) with the max/mean of each (the aim: <= 1.1);
* redis-server CPU (user + system from /proc) per run, and from it the capacity model: the
  runs/s one master sustains on one core, and what N masters give;
* the runs per lane, and the rate of the whole.

This 2-core machine cannot show the rate scaling with masters (the workers and all three
masters share two cores); the per-master CPU per run is what the model is built from.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["RQ_KEY_PREFIX"] = "{mrq:rq}"  # before rq is imported: RQ's keyspace in one slot
os.environ.setdefault("MARBLES_LANE_COUNT", "3")

import redis

from bench.runs_util import Procs, load_line, median, table
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.lanes import open_lanes
from tests.redis_procs import RedisCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
FLOWS = REPO_ROOT / "bench" / "runs_flows.py"
HZ = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def master_stats(cluster: RedisCluster) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for node in cluster.nodes:
        client = redis.Redis(port=node.port, decode_responses=True)
        if client.info("replication")["role"] != "master":
            continue
        cmds = client.info("commandstats")
        out[node.port] = {
            "commands": sum(int(v["calls"]) for v in cmds.values()),
            "keys": client.dbsize(),
            "memory": client.info("memory")["used_memory"],
            "cpu": cpu_s(node.pid),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--buckets", type=int, default=None,
                        help="bucket count (default: the deployment default)")
    args = parser.parse_args()
    lanes_n = int(os.environ["MARBLES_LANE_COUNT"])
    print("marbles-rq cluster benchmark")
    print(f"command: {' '.join([sys.executable, '-m', 'bench.cluster', *sys.argv[1:]])}")
    print(f"host load at start: {load_line()}")
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp_name:
        tmp = Path(tmp_name)
        cluster = RedisCluster.start(dir=tmp / "cluster")
        env = {**os.environ, "MARBLES_REDIS_URL": cluster.url, "MARBLES_SOURCE": str(FLOWS),
               "PYTHONPATH": str(REPO_ROOT)}
        if args.buckets:
            env["MARBLES_BUCKETS"] = str(args.buckets)
        procs = Procs(tmp, env)
        try:
            load_source(str(FLOWS))
            kw = {} if args.buckets is None else {"buckets": args.buckets}
            store = open_store(cluster.url, lanes=lanes_n, **kw)
            runs = RunStore(store)
            keys = store.keys
            lanes = open_lanes(cluster.url, keys)
            print(f"cluster: 3 masters (ports {', '.join(map(str, cluster.ports))}); "
                  f"buckets {keys.buckets}, lanes {keys.lanes}")
            before = master_stats(cluster)
            ids = [f"c{i}" for i in range(args.runs)]
            started = time.monotonic()
            for i in range(0, len(ids), 500):
                ops.enqueue_many(runs, lanes, [ops.RunRequest("one_step", b"null", rid)
                                               for rid in ids[i:i + 500]])
            enqueued = time.monotonic() - started
            py = [sys.executable, "-m", "marbles_rq"]
            procs.start("controller", [*py, "controller"])
            t0 = time.monotonic()
            procs.start("worker", [*py, "worker", "--pool", str(args.pool), "--lanes", "all"])
            finished = [keys.run_finished(b) for b in range(keys.buckets)]
            while True:
                pipe = store.client.pipeline(transaction=False)
                for key in finished:
                    pipe.zcard(key)
                done = sum(pipe.execute())
                if done >= len(ids):
                    break
                if time.monotonic() - t0 > 600:
                    print(f"timed out: {done} of {len(ids)} settled")
                    return 1
                time.sleep(0.2)
            elapsed = time.monotonic() - t0
            after = master_stats(cluster)
            per_lane = [0] * keys.lanes
            for rid in ids:
                per_lane[keys.lane_of(rid)] += 1
            print(f"\n{len(ids)} one-step runs: recorded and enqueued in {enqueued:.1f} s "
                  f"({len(ids) / enqueued:.0f}/s), executed in {elapsed:.1f} s "
                  f"({len(ids) / elapsed:.0f} runs/s, one worker --pool {args.pool})")
            print(f"runs per lane: {per_lane}")
            rows = []
            deltas = {port: {k: after[port][k] - before[port].get(k, 0) for k in after[port]}
                      for port in after}
            for port, d in sorted(deltas.items()):
                rows.append([port, f"{d['commands']:.0f}", f"{after[port]['keys']:.0f}",
                             f"{d['memory'] / 1024:.0f} KiB",
                             f"{d['cpu']:.2f} s", f"{1000 * d['cpu'] / len(ids):.3f} ms"])
            print("\nper master over the window (commands and memory: growth; keys: after):")
            print(table(["master", "commands", "keys", "memory", "cpu", "cpu/run"], rows))
            for name, pick in (("commands", lambda p: deltas[p]["commands"]),
                               ("keys", lambda p: after[p]["keys"]),
                               ("memory", lambda p: deltas[p]["memory"])):
                values = [pick(p) for p in deltas]
                mean = sum(values) / len(values)
                print(f"  {name}: max/mean {max(values) / mean:.3f} (aim <= 1.1)")
            cpu_per_run = sum(d["cpu"] for d in deltas.values()) / len(ids)
            per_master_ms = median([1000 * d["cpu"] / (len(ids) / len(deltas))
                                    for d in deltas.values()])
            print("\ncapacity model (redis-server CPU only; fsync waits overlap other clients' "
                  "work):")
            print(f"  redis-server CPU per run, all masters: {1000 * cpu_per_run:.3f} ms")
            print(f"  CPU per run a master serves (median): {per_master_ms:.3f} ms -> one "
                  f"master on one core saturates at about {1000 / per_master_ms:.0f} runs/s")
            for n in (1, 3, 6, 12, 30, 64):
                print(f"  {n:>2} masters (lanes = masters): about "
                      f"{n * 1000 / per_master_ms:,.0f} runs/s")
        finally:
            strays = procs.cleanup()
            cluster.stop()
            print(f"stray processes left: {strays or 'none'}")
    print(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
