"""`ops/chaos`: the chaos test of the whole system. See tests/chaos/__init__.py.

    ops/chaos                        # short mode (CI): 500 runs, 30 worker kills, ...
    ops/chaos --seed 1234            # replay the same plan of faults
    ops/chaos --runs 5000 --kills 300   # long mode, for nightly use
    ops/chaos --lanes 3                 # the deployment on three lanes

Exit 0: no violation; 1: violations (listed); 2: the chaos could not do what it promises
(a fault found no target, too few runs accepted) or the harness failed.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from tests.chaos.checker import check, summary
from tests.chaos.harness import LANES, Harness
from tests.chaos.plan import WORKER_KILLS, make_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="replay the plan of this seed (default: a new one, printed)")
    parser.add_argument("--runs", type=int, default=500, help="runs to submit (default 500)")
    parser.add_argument("--kills", type=int, default=30,
                        help="worker kills; leader kills, Redis kills and stops scale with "
                             "it (default 30)")
    parser.add_argument("--lanes", type=int, default=LANES,
                        help="lanes of the deployment under test (default "
                             "$MARBLES_CHAOS_LANES, else 1)")
    parser.add_argument("--lease-ms", type=int, default=2000,
                        help="worker and controller lease (default 2000)")
    parser.add_argument("--quiesce-s", type=float, default=None,
                        help="how long to wait for every run to finish after the faults "
                             "(default: 120 s + 0.05 s per run)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where Redis data and process logs go (default: a temp dir, "
                             "removed on success)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir on success")
    parser.add_argument("--recheck", type=Path, default=None, metavar="WORKDIR",
                        help="check the history kept in WORKDIR again (no chaos)")
    args = parser.parse_args(argv)
    if args.lanes < 1:
        parser.error("--lanes must be 1 or more")
    if args.recheck is not None:
        return recheck(args.recheck, args.lanes)

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    plan = make_plan(seed, args.runs, args.kills, lease_ms=args.lease_ms)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
    quiesce = args.quiesce_s if args.quiesce_s is not None else 120 + 0.05 * args.runs
    planned = plan.fault_counts()
    lanes = f" --lanes {args.lanes}" if args.lanes != 1 else ""
    print(f"chaos: seed {seed} (replay: ops/chaos --seed {seed} --runs {args.runs} --kills "
          f"{args.kills}{lanes}); {len(plan.actions)} actions over {plan.duration_s:.0f} s; faults "
          f"planned: " + ", ".join(f"{k} {n}" for k, n in planned.items() if n), flush=True)
    print(f"chaos: work dir {workdir}", flush=True)
    started = time.monotonic()
    harness = Harness(plan, workdir, lease_ms=args.lease_ms, quiesce_s=quiesce,
                      out=lambda line: print(line, flush=True), lanes=args.lanes)
    try:
        harness.start()
        print(f"chaos: started redis-server {harness.url} ({args.lanes} lane"
              f"{'s' if args.lanes != 1 else ''}), 2 controllers, 3 workers "
              f"({time.monotonic() - started:.1f} s); chaos phase begins", flush=True)
        harness.run_chaos()
        chaos_s = time.monotonic() - started
        print(f"chaos: faults done at {chaos_s:.0f} s; pausing schedules, waiting for "
              f"quiescence", flush=True)
        harness.pause_schedules()
        quiet = harness.quiesce()
        print(f"chaos: {'quiescent' if quiet else 'NOT quiescent'} after "
              f"{harness.stuck_after_s:.0f} s; collecting the history", flush=True)
        history = harness.collect()
    except BaseException:
        traceback.print_exc()
        harness.shutdown()
        print(f"chaos: harness failed (seed {seed}); logs in {workdir}")
        return 2
    harness.shutdown()
    report = check(history)
    done = Counter(f.kind for f in history.faults)
    problems = []
    worker_kills = sum(done[k] for k in WORKER_KILLS)
    for what, have, need in (
            ("worker kills", worker_kills, plan.minimums["worker"]),
            ("leader kills", done["leader"], plan.minimums["leader"]),
            ("redis kills", done["redis"], plan.minimums["redis"]),
            ("stops", done["stop_worker"] + done["stop_leader"], plan.minimums["stop"])):
        if have < need:
            problems.append(f"{what}: {have} of {need}")
    accepted = ({s.run for s in history.submitted if s.created is not None}
                | {s.key for s in history.sent if s.created is not None})
    if len(accepted) < plan.runs:
        problems.append(f"runs accepted: {len(accepted)} of {plan.runs}")
    header = [
        f"== chaos summary: seed {seed}, {plan.runs} runs planned, {args.kills} worker kills "
        f"planned, lease {args.lease_ms} ms, {args.lanes} lane(s)",
        f"time: {time.monotonic() - started:.0f} s in all (quiescence after "
        f"{history.stuck_after_s:.0f} s); restarts: "
        + ", ".join(f"{k} {n}" for k, n in harness.restarts().items()),
        f"accepted: {len(accepted)} runs submitted or sent (plus children and schedule runs)",
    ]
    if harness.log.notes:
        header.append(f"harness notes ({len(harness.log.notes)}): "
                      + "; ".join(harness.log.notes[:10]))
    crashes = [c for c in history.crashes if c.excused]
    if crashes:
        header.append(f"excused exits: {len(crashes)} ({crashes[0].excused})")
    print(summary(history, report, header=header))
    if problems:
        print("chaos did not do what it promises: " + "; ".join(problems))
    code = 1 if report.violations else (2 if problems else 0)
    if code == 0 and not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs and data kept in {workdir}")
    return code


def recheck(workdir: Path, lanes: int = 1) -> int:
    """Restart the kept Redis of an earlier run and check its history again."""
    harness = Harness(make_plan(0, 0, 0), workdir, lanes=lanes)
    try:
        harness.reopen()
        history = harness.collect()
    finally:
        harness.shutdown()
    report = check(history)
    print(summary(history, report, header=[f"== chaos recheck of {workdir}"]))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
