"""`replay --check` over recorded runs: runs/s and CPU per run, next to two baselines measured
in the same run, rounds interleaved.

Run from the repo root::

    .venv/bin/python -m bench.replay_check [--runs 10000] [--rounds 3] [--dry-runs N]

The histories are generated in the file format `marbles-rq export` writes (engine/history.py)
for bench/replay_check_flows.py's `rc_order` (three steps, a question, a fourth step): half
of them waiting at the question (three steps recorded, the question open), half finished (four
steps, the question answered, the result). No Redis is involved: the check reads a file.

Per round, in a rotating order:

* decode: read the file into histories (`history.read_file`): the floor, what any reader of
  the file pays;
* check: the same read, then `replay_check.check_all` against the workflow (what `replay
  --check --from FILE` does after its start-up): every history replayed by the real executor
  in memory, replay-only;
* dry run: `--dry-runs` dry runs of the same workflow (engine/dryrun.py: the same executor
  on the same in-memory store, running the step bodies and answering the question), a full
  execution per run, for scale;
* cli (once per round, last): the real command `marbles-rq replay --check --source ... --from
  FILE` in a separate process, start-up included.

Printed per side: runs/s (median of the rounds, and each round), CPU ms per run (this
process's user + system over the side), and the ratio of check to decode and to dry run.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from bench.runs_util import REPO_ROOT, median, table
from marbles_rq.engine.history import History, QuestionState, read_file, to_line
from marbles_rq.store.records import AskRecord, RunRecord, StepRecord

FLOWS = REPO_ROOT / "bench" / "replay_check_flows.py"


def _entry(i: int, name: str, seq: int, result: object) -> StepRecord:
    return StepRecord(version=1, key=f"rc_order.{name}#0", name=name, status="succeeded",
                      attempts=1, result=msgspec.Raw(msgspec.json.encode(result)),
                      at_ms=1_700_000_000_000 + i, seq=seq, epoch=1 + seq // 3, wseq=seq + 1)


def history(i: int) -> History:
    """Run i: waiting at its question (even i) or finished (odd i)."""
    n = i % 1000
    a, b = n + 1, (n + 1) * 2
    c = b - 3
    ledger = [_entry(i, "rc_fetch", 0, a), _entry(i, "rc_check", 1, b),
              _entry(i, "rc_weigh", 2, c)]
    ask = AskRecord(version=1, key="colour", ask="question", title="Colour?",
                    choices=["red", "blue"], step="rc_order")
    record = RunRecord(version=1, id=f"bench-{i}", name="rc_order", queue="default",
                       input=msgspec.Raw(msgspec.json.encode(n)),
                       requested_at_ms=1_700_000_000_000 + i)
    if i % 2 == 0:
        return History(version=1, run=record, status="waiting", wait_reason="question",
                       wait_for={"questions": ["colour"]}, ledger=ledger,
                       questions=[QuestionState(record=ask, state="open", asked_ms=1)])
    label = f"{c}-red"
    ledger.append(_entry(i, "rc_pack", 3, label))
    return History(version=1, run=record, status="succeeded",
                   result=msgspec.Raw(msgspec.json.encode({"label": label})), ledger=ledger,
                   questions=[QuestionState(record=ask, state="answered",
                                            answer=msgspec.Raw(b'"red"'), asked_ms=1,
                                            answered_ms=2)])


def timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """(wall s, CPU s of this process, runs) of one side."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return time.perf_counter() - t0, time.process_time() - c0, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-runs", type=int, default=None,
                        help="dry runs per round (default: --runs)")
    args = parser.parse_args()
    dry_n = args.runs if args.dry_runs is None else args.dry_runs

    from marbles_rq.engine.authoring import REGISTRY, load_source
    from marbles_rq.engine.dryrun import dry_run
    from marbles_rq.engine.replay_check import check_all

    load_source(str(FLOWS))
    workdir = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    file = workdir / "runs.jsonl"
    with file.open("wb") as fh:
        for i in range(args.runs):
            fh.write(to_line(history(i)))
    print(f"replay --check bench: {args.runs:,} histories ({file.stat().st_size / 1e6:.1f} MB, "
          f"half waiting at a question, half finished; 3-4 steps each), {dry_n:,} dry runs, "
          f"{args.rounds} rounds")
    print(f"command: {' '.join(sys.argv)}; python {platform.python_version()}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")

    def decode() -> int:
        return sum(1 for _ in read_file(str(file)))

    def check() -> int:
        report = check_all(read_file(str(file)), REGISTRY)
        assert report.failing == 0, [v.summary for v in report.verdicts if not v.ok][:3]
        return len(report.verdicts)

    def dry() -> int:
        for i in range(dry_n):
            done = dry_run("rc_order", str(i % 1000).encode(), answer=lambda q: "red",
                           run_id=f"dry-{i}")
            assert done.view.status == "succeeded"
        return dry_n

    def cli() -> int:
        argv = [str(REPO_ROOT / ".venv" / "bin" / "marbles-rq"), "replay", "--check",
                "--source", str(FLOWS), "--from", str(file)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                              stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[-1] == f"{args.runs} runs: ok {args.runs}, failing 0"
        return args.runs

    sides: dict[str, Callable[[], int]] = {"decode": decode, "check": check, "dry run": dry}
    rates: dict[str, list[float]] = {k: [] for k in [*sides, "cli"]}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    check_all(read_file(str(file)), REGISTRY)  # warm-up: imports, decoders
    names = list(sides)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            wall, used, n = timed(sides[name])
            rates[name].append(n / wall)
            cpu[name].append(used * 1000 / n)
            print(f"  round {r + 1}: {name:8} {n / wall:10,.0f} runs/s  "
                  f"{used * 1000 / n:7.3f} CPU ms/run")
        t0 = time.perf_counter()
        n = cli()
        rates["cli"].append(n / (time.perf_counter() - t0))
        print(f"  round {r + 1}: {'cli':8} {rates['cli'][-1]:10,.0f} runs/s  (start-up included)")

    rows = []
    for name in [*names, "cli"]:
        each = ", ".join(f"{x:,.0f}" for x in rates[name])
        cpu_ms = f"{median(cpu[name]):.3f}" if name in cpu else "-"
        rows.append([name, f"{median(rates[name]):,.0f}", each, cpu_ms])
    print()
    print(table(["side", "runs/s (median)", "each round", "CPU ms/run"], rows))
    check_rate, check_cpu = median(rates["check"]), median(cpu["check"])
    print()
    print(f"check vs decode (reading the file only): {check_rate / median(rates['decode']):.3f}x "
          f"the rate, {check_cpu / median(cpu['decode']):.1f}x the CPU per run")
    print(f"check vs dry run (a full in-memory execution): "
          f"{check_rate / median(rates['dry run']):.2f}x the rate, "
          f"{check_cpu / median(cpu['dry run']):.2f}x the CPU per run")
    file.unlink()
    workdir.rmdir()


if __name__ == "__main__":
    main()
