"""Schedules (issue 7): declarations, occurrence computation across DST, overlap and catch-up
decisions, and real controller/worker processes against a real redis-server: kill -9 of the
leader while schedules are due, downtime, claimed-but-unstarted occurrences, pause/resume
across restarts, orphaned schedules, roll under the lock, and bad input."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.engine.authoring import DefinitionError
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.schedules import (
    ScheduleDuty,
    ScheduleRegistry,
    _Fire,
    _Move,
    _Previous,
    decide,
    derive_key,
    roll_schedule,
    slots_after,
)
from tests.procs import REPO_ROOT, Procs, wait_for

SRC = REPO_ROOT / "tests" / "sched_sources"
FLOWS, MANY, GAP, TICK, ORPHAN = (SRC / f"{n}.py" for n in ("flows", "many", "gap", "tick",
                                                            "orphan"))
FIRED = "sx:fired"
KEYS = Keyspace()
BERLIN = ZoneInfo("Europe/Berlin")


def ms(text: str, tz: ZoneInfo = BERLIN, fold: int = 0) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=tz, fold=fold).timestamp() * 1000)


def wall(ms_: int, tz: ZoneInfo = BERLIN) -> str:
    return datetime.fromtimestamp(ms_ / 1000, tz).strftime("%H:%M%z")


# -- occurrences across DST (fixed instants) --------------------------------------------------


def test_spring_forward_fires_the_skipped_slot_once_at_the_jump() -> None:
    # 2026-03-29 in Berlin: 02:00 CET becomes 03:00 CEST; 02:30 does not exist.
    after = ms("2026-03-28T12:00")
    daily = [wall(s) for s, _ in zip(slots_after("30 2 * * *", BERLIN, after), range(3),
                                     strict=False)]
    assert daily == ["03:00+0200", "02:30+0200", "02:30+0200"]
    half = [wall(s) for s, _ in zip(slots_after("*/30 * * * *", BERLIN, ms("2026-03-29T01:00")),
                                    range(3), strict=False)]
    assert half == ["01:30+0100", "03:00+0200", "03:30+0200"]  # 02:00 and 02:30 fire once


def test_fall_back_fires_each_nominal_slot_once_not_twice() -> None:
    # 2026-10-25 in Berlin: 03:00 CEST becomes 02:00 CET; 02:00-02:59 happen twice.
    daily = list(zip(slots_after("30 2 * * *", BERLIN, ms("2026-10-24T12:00")), range(2),
                     strict=False))
    assert [wall(s) for s, _ in daily] == ["02:30+0200", "02:30+0100"]
    assert daily[1][0] - daily[0][0] == 25 * 3600 * 1000  # the day is 25 hours long
    half = [wall(s) for s, _ in zip(slots_after("*/30 * * * *", BERLIN, ms("2026-10-25T01:00")),
                                    range(4), strict=False)]
    assert half == ["01:30+0200", "02:00+0200", "02:30+0200", "03:00+0100"]
    # Starting inside the repeated hour (after the first 02:30) does not fire it again.
    inside = ms("2026-10-25T02:10", fold=1)
    assert wall(next(slots_after("*/30 * * * *", BERLIN, inside))) == "03:00+0100"


# -- declarations -----------------------------------------------------------------------------


def test_keys_are_the_target_slug_plus_a_short_input_hash() -> None:
    reg = ScheduleRegistry()
    a = mr.schedule(every="30s", workflow="Daily Report!", registry=reg)
    assert a is None
    b_def = list(reg.schedules.values())
    assert [d.key for d in b_def] == ["daily-report"]
    assert derive_key("Daily Report!", {"b": 1, "a": 2}) == derive_key("Daily Report!",
                                                                        {"a": 2, "b": 1})
    assert derive_key("x", {"a": 1}).startswith("x-") and len(derive_key("x", {"a": 1})) == 10
    mr.schedule(cron="0 9 * * MON-FRI", tz="Europe/Berlin", workflow="Daily Report!",
                registry=reg)
    mr.schedule(at={"weekday": ["mon", "fri"], "hour": 9, "minute": 30}, tz="UTC",
                workflow="Daily Report!", registry=reg)
    assert sorted(reg.schedules) == ["daily-report", "daily-report-2", "daily-report-3"]
    cal = reg.schedules["daily-report-3"]
    assert (cal.kind, cal.cron) == ("calendar", "30 9 * * 1,5")


@pytest.mark.parametrize("kwargs, needle", [
    ({"cron": "61 * * * *"}, "invalid cron"),
    ({"cron": "0 9 * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
    ({"every": "0s"}, "invalid every"),
    ({"every": "5 minutes"}, "invalid every"),
    ({"every": "1s", "cron": "* * * * *"}, "exactly one"),
    ({"every": "1s", "overlap": "queue"}, "overlap must be"),
    ({"at": {"hour": 24}}, "invalid at hour"),
    ({"at": {"hour": 1, "weekday": "funday"}}, "invalid at weekday"),
])
def test_a_bad_declaration_fails_at_load_naming_the_place(kwargs: dict[str, Any],
                                                          needle: str) -> None:
    reg = ScheduleRegistry()
    with pytest.raises(DefinitionError) as err:
        mr.schedule(workflow="w", registry=reg, **kwargs)
    assert needle in str(err.value)
    assert "test_schedules.py:" in str(err.value)  # where it was declared
    assert not reg.schedules


# -- decisions: overlap and catch-up ---------------------------------------------------------


def _defn(**kwargs: Any) -> Any:
    reg = ScheduleRegistry()
    mr.schedule(workflow="w", registry=reg, **kwargs)
    return next(iter(reg.schedules.values()))


IDLE = _Previous(None, False, None, None)


def _running(run_id: str = "r1") -> _Previous:
    return _Previous(run_id, True, None, "running")


def test_interval_measures_from_completion_and_never_queues_missed_ticks() -> None:
    d = _defn(every="10s")
    st = {"registered_ms": "0", "cursor": "10000", "last_run": "r1", "last_start": "10000"}
    # The previous run finished at 95 s: due at 105 s, not earlier.
    done = _Previous("r1", False, 95_000, "succeeded")
    move = decide(d, st, done, 100_000)
    assert isinstance(move, _Move) and move.cursor == 105_000
    assert move.finish == ("r1", 95_000, "succeeded")
    # Long overdue (downtime): one occurrence, at its due time.
    fire = decide(d, st, done, 1_000_000)
    assert isinstance(fire, _Fire) and fire.nominal_ms == 105_000
    assert fire.cursor == "1010000"  # the next one counts from now at the earliest
    # Still running: nothing fires, it is looked at again.
    wait = decide(d, st, _running(), 1_000_000)
    assert isinstance(wait, _Move) and wait.cursor == 10_000 and not wait.skipped


def test_cron_overlap_policies_and_catch_up_window() -> None:
    utc = ZoneInfo("UTC")
    now = ms("2026-06-01T09:00:30", utc)
    nine = ms("2026-06-01T09:00", utc)
    st = {"registered_ms": "0", "cursor": str(nine), "last_run": "r1"}
    skip = decide(_defn(cron="* * * * *", tz="UTC"), st, _running(), now)
    assert isinstance(skip, _Move) and skip.skipped and skip.cursor == nine + 60_000
    buf = decide(_defn(cron="* * * * *", tz="UTC", overlap="buffer_one"), st, _running(), now)
    assert isinstance(buf, _Move) and buf.buffered == str(nine)
    allow = decide(_defn(cron="* * * * *", tz="UTC", overlap="allow"), st, _running(), now)
    assert isinstance(allow, _Fire) and allow.nominal_ms == nine
    # The buffered slot fires once the previous run finished.
    st_buf = {**st, "cursor": str(nine + 60_000), "buffered": str(nine)}
    done = _Previous("r1", False, now, "succeeded")
    fired = decide(_defn(cron="* * * * *", tz="UTC", overlap="buffer_one"), st_buf, done,
                   now + 1000)
    assert isinstance(fired, _Fire) and fired.from_buffer and fired.nominal_ms == nine
    # After downtime: the latest missed slot inside one period fires, once.
    hourly = _defn(cron="0 * * * *", tz="UTC")
    old = {"registered_ms": "0", "cursor": str(ms("2026-06-01T02:00", utc))}
    late = decide(hourly, old, IDLE, ms("2026-06-01T09:20", utc))
    assert isinstance(late, _Fire) and late.nominal_ms == nine
    assert late.cursor == str(ms("2026-06-01T10:00", utc))
    # Outside the window (catch_up=10m): skipped, the cursor moves to the next slot.
    short = _defn(cron="0 * * * *", tz="UTC", catch_up="10m")
    missed = decide(short, old, IDLE, ms("2026-06-01T09:20", utc))
    assert isinstance(missed, _Move) and missed.skipped
    assert missed.cursor == ms("2026-06-01T10:00", utc)


# -- real processes ---------------------------------------------------------------------------


@pytest.fixture
def procs_for(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Procs] = []

    def make(*sources: Path) -> Procs:
        procs = Procs(redis_url, tmp_path / f"procs{len(made)}", sources=(FLOWS, *sources))
        made.append(procs)
        return procs

    try:
        yield make
    finally:
        for procs in made:
            try:
                procs.stop_all()
            finally:
                print(procs.report())


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def _fired(r: redis.Redis) -> list[str]:
    return [str(x) for x in r.lrange(FIRED, 0, -1)]


def _now_ms(r: redis.Redis) -> int:
    secs, micros = r.time()
    return int(secs) * 1000 + int(micros) // 1000


def _parse(run_id: str) -> tuple[str, int]:
    _, key, nominal = run_id.split(":")
    return key, int(nominal)


def _open_occurrences(r: redis.Redis) -> int:
    return sum(int(r.zcard(KEYS.occurrences_open(b))) for b in range(KEYS.buckets))


def _state(r: redis.Redis, key: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in r.hgetall(KEYS.schedule(key)).items()}


def _wait_fired(r: redis.Redis, procs: Procs, n: int, *, match: str = "",
                timeout: float = 60.0) -> list[str]:
    return wait_for(lambda: (lambda f: f if len([x for x in f if match in x]) >= n else None)(
        _fired(r)), timeout=timeout, what=f"{n} fired runs matching {match!r}",
        context=procs.report)


def test_kill9_of_the_leader_while_schedules_are_due_never_runs_an_occurrence_twice(
        redis_url: str, procs_for: Any) -> None:
    procs = procs_for(MANY)
    r = _client(redis_url)
    procs.worker(pool=4)
    ctl = procs.controller(lease_ms=2000, interval=0.05)
    seen = len(_wait_fired(r, procs, 20))
    for _ in range(3):
        seen = len(_wait_fired(r, procs, seen + 15))
        ctl.kill9()  # mid-pass, with about 20 schedules coming due every second
        ctl = procs.controller(lease_ms=2000, interval=0.05)
    _wait_fired(r, procs, seen + 40)
    ctl.stop()
    wait_for(lambda: _open_occurrences(r) == 0, timeout=30, what="no open occurrence",
             context=procs.report)
    procs.stop_all()
    fired = _fired(r)
    runs_per_occurrence = Counter(fired)
    assert max(runs_per_occurrence.values()) == 1, runs_per_occurrence.most_common(3)
    by_key: dict[str, list[int]] = defaultdict(list)
    for run_id in fired:
        key, nominal = _parse(run_id)
        by_key[key].append(nominal)
        occ = r.hgetall(KEYS.occurrence(key, f"{key}@{nominal}"))
        assert occ.get("run_id") == run_id and occ.get("status") == "started"
    assert len(by_key) == 20
    for key, nominals in by_key.items():
        nominals.sort()
        gaps = [b - a for a, b in itertools.pairwise(nominals)]
        # Each slot is measured from the previous run's completion: never two within 1 s.
        assert min(gaps) >= 1000, (key, gaps)
    ctl_logs = "".join(p.text() for p in procs.procs if p.role == "controller")
    assert ctl_logs.count("elected controller") == 4


def test_an_occurrence_claimed_but_not_started_is_started_once_on_recovery(
        redis_url: str, procs_for: Any) -> None:
    procs = procs_for(GAP)
    r = _client(redis_url)
    ctl = procs.controller(lease_ms=2000)
    ctl.wait_log("schedule gap (every 2s -> sx_note): created")
    ctl.kill9()
    # What a leader that died between the claim and recording the run leaves behind.
    store = open_store(redis_url)
    bucket = KEYS.bucket_of("gap")
    epoch = int(r.hget(KEYS.controller_fence(bucket), "epoch") or 0)
    cursor = _state(r, "gap")["cursor"]
    nominal = int(cursor)
    occ_id = f"gap@{nominal}"
    reply = store.scripts.claim_occurrences([dict(
        keys=KEYS.schedule_keys("gap"), occurrence_key=KEYS.occurrence("gap", occ_id),
        key="gap", ctl_epoch=epoch, expected=cursor, nominal_ms=nominal, occurrence_id=occ_id,
        run_id=f"sched:gap:{nominal}", cursor=str(nominal + 2000),
        due_ms=str(nominal + 2000))])[0]
    assert reply.status == "ok"
    assert r.exists(KEYS.run(f"sched:gap:{nominal}")) == 0
    procs.worker()
    ctl = procs.controller(lease_ms=2000)
    _wait_fired(r, procs, 3, match="sched:gap:")
    ctl.wait_log(f"occurrence {occ_id} was claimed but not started")
    assert _fired(r).count(f"sched:gap:{nominal}") == 1
    assert _fired(r)[0] == f"sched:gap:{nominal}"
    assert r.hget(KEYS.occurrence("gap", occ_id), "status") == "started"


def test_an_interval_schedule_due_during_controller_downtime_fires_once(
        redis_url: str, procs_for: Any) -> None:
    procs = procs_for(GAP)
    r = _client(redis_url)
    procs.worker()
    ctl = procs.controller()
    _wait_fired(r, procs, 2, match="sched:gap:")
    ctl.stop()
    stopped = _now_ms(r)
    before = set(_fired(r))
    # Three periods of downtime (a wait on the server's clock, not on a sleep).
    wait_for(lambda: _now_ms(r) >= stopped + 6500, timeout=20, what="6.5 s of downtime",
             interval=0.2)
    restarted = _now_ms(r)
    procs.controller()
    _wait_fired(r, procs, len(before) + 2, match="sched:gap:")
    after = [_parse(x)[1] for x in _fired(r) if x not in before]
    overdue = [n for n in after if n < restarted]
    assert len(overdue) == 1, (after, restarted)  # missed ticks never queue
    assert after[1] - after[0] >= 2000


def _json(procs: Procs, *args: str) -> Any:
    done = procs.cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_pause_and_resume_are_recorded_and_survive_a_controller_restart(
        redis_url: str, procs_for: Any) -> None:
    procs = procs_for(TICK)
    r = _client(redis_url)
    procs.worker()
    ctl = procs.controller()
    _wait_fired(r, procs, 1, match="sched:tick:")
    done = procs.cli("schedules", "pause", "tick")
    assert done.returncode == 0 and "schedule tick paused" in done.stdout, done.stderr
    ctl.stop()
    ctl = procs.controller()
    tocks = len([x for x in _fired(r) if "sched:tock:" in x])
    _wait_fired(r, procs, tocks + 2, match="sched:tock:")  # any tick in flight has landed
    ticks = [x for x in _fired(r) if "sched:tick:" in x]
    _wait_fired(r, procs, tocks + 5, match="sched:tock:")
    assert [x for x in _fired(r) if "sched:tick:" in x] == ticks  # paused: nothing fired
    listed = {s["key"]: s for s in _json(procs, "schedules")}
    assert listed["tick"]["status"] == "paused" and listed["tock"]["status"] == "active"
    assert listed["tock"]["kind"] == "interval" and listed["tock"]["lastStart"]
    done = procs.cli("schedules", "resume", "tick")
    assert done.returncode == 0 and "schedule tick resumed" in done.stdout
    _wait_fired(r, procs, len(ticks) + 1, match="sched:tick:")


def test_a_schedule_removed_from_the_source_is_orphaned_and_never_fires(
        redis_url: str, procs_for: Any) -> None:
    first = procs_for(ORPHAN)
    r = _client(redis_url)
    ctl = first.controller()
    ctl.wait_log("schedule orphan (every 3s -> sx_note): created")
    ctl.stop()
    due = int(_state(r, "orphan")["cursor"])
    second = procs_for(TICK)  # no longer declares "orphan"
    second.worker()
    ctl = second.controller()
    ctl.wait_log("schedule orphan is no longer declared: orphaned")
    wait_for(lambda: _now_ms(r) > due + 1000, timeout=20, what="the orphan's due time",
             interval=0.2)
    _wait_fired(r, second, len(_fired(r)) + 4)  # passes went by after it was due
    assert not [x for x in _fired(r) if "sched:orphan:" in x]
    assert "last_run" not in _state(r, "orphan")
    listed = {s["key"]: s for s in _json(second, "schedules")}
    assert listed["orphan"]["status"] == "orphaned" and listed["orphan"]["nextDue"] is None
    text = second.cli("schedules").stdout
    assert "orphan  orphaned  every 3s" in text


@pytest.mark.parametrize("bad, needle", [
    ("bad_cron", "invalid cron '61 * * * *'"),
    ("bad_tz", "unknown time zone 'Mars/Olympus_Mons'"),
    ("bad_every", "invalid every '0s'"),
])
def test_bad_declarations_fail_at_load_with_exit_2(redis_url: str, procs_for: Any, bad: str,
                                                   needle: str) -> None:
    procs = procs_for(SRC / f"{bad}.py")
    for args in (("schedules",), ("controller",)):
        done = procs.cli(*args, timeout=30)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and f"{bad}.py:3" in lines[0], lines
    assert _client(redis_url).dbsize() == 0  # nothing recorded


def test_unknown_schedule_key_is_one_line_exit_2_and_records_nothing(
        redis_url: str, procs_for: Any) -> None:
    procs = procs_for(GAP)
    for args in (("pause", "nosuch"), ("resume", "nosuch"), ("pause", "a/b")):
        done = procs.cli("schedules", *args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "unknown schedule" in done.stderr
    assert _client(redis_url).dbsize() == 0  # nothing recorded at all
    # A declared key no controller registered yet can be paused; the pause is kept.
    assert procs.cli("schedules", "pause", "gap").returncode == 0
    ctl = procs.controller()
    ctl.wait_log("schedule gap (every 2s -> sx_note): created")
    assert _state(_client(redis_url), "gap")["paused"] == "1"
    assert {s["key"]: s["status"] for s in _json(procs, "schedules")} == {"gap": "paused"}


# -- roll ------------------------------------------------------------------------------------


@mr.workflow("sx_roll_target")
def sx_roll_target(ctx: mr.RunContext) -> str:
    return "rolled"


def test_roll_fires_one_occurrence_under_the_lock_or_reports_the_holder(
        redis_url: str) -> None:
    reg = ScheduleRegistry()
    mr.schedule(every="1h", workflow="sx_roll_target", key="rollme", registry=reg)
    runs = RunStore(open_store(redis_url))
    rq = rq_connection(redis_url)
    duty = ScheduleDuty(reg)
    ctl = Controller(runs, rq, duties=[duty])
    assert ctl.lead()
    ctl.recover()
    held = runs.scripts.lock_schedule(keys=KEYS.schedule_keys("rollme"), holder="other:42",
                                      ttl_ms=60_000)
    assert held.status == "ok"
    skipped = roll_schedule(runs, rq, "rollme", registry=reg)
    assert (skipped.status, skipped.holder) == ("skipped", "other:42")
    assert str(skipped) == "[schedule] rollme skipped: held by other:42"
    r = _client(redis_url)
    assert not r.keys("*:run:sched:rollme:*")
    runs.scripts.lock_schedule(keys=KEYS.schedule_keys("rollme"), holder="other:42", ttl_ms=0)
    fired = roll_schedule(runs, rq, "rollme", registry=reg)
    assert fired.status == "fired" and fired.run_id is not None
    view = runs.get(fired.run_id)
    assert view is not None and view.record.name == "sx_roll_target"
    assert r.get(KEYS.schedule_lock("rollme")) is None  # released
    assert _state(r, "rollme")["last_run"] == fired.run_id
    # The cursor did not move: a roll is forced, beside the schedule's own cadence.
    assert int(_state(r, "rollme")["cursor"]) > _now_ms(r) + 3_000_000
    with pytest.raises(mr.MarblesError, match="unknown schedule"):
        roll_schedule(runs, rq, "nosuch", registry=reg)


def test_a_cron_schedule_fires_the_slot_a_dst_jump_skips_once_at_the_jump(
        redis_url: str, procs_for: Any, tmp_path: Path) -> None:
    """A real controller in a named zone whose clocks jump forward an hour at the next
    minute boundary (a zone compiled with zic, found through PYTHONTZPATH): the daily slot
    inside the skipped hour fires once, at the jump, and the next one is tomorrow's."""
    if shutil.which("zic") is None:
        pytest.skip("zic (tzdata's zone compiler) is not installed")
    r = _client(redis_url)
    now = _now_ms(r)
    jump = (now // 60_000 + 1) * 60_000
    if jump - now < 15_000:
        jump += 60_000
    until = datetime.fromtimestamp(jump / 1000, UTC).strftime("%Y %b %d %H:%M:%Su")
    zones = tmp_path / "zones"
    (tmp_path / "jump.zi").write_text(f"Zone Test/Jump 0:00 - UTC0 {until}\n"
                                      f"               1:00 - UTC1\n")
    subprocess.run(["zic", "-d", str(zones), str(tmp_path / "jump.zi")], check=True)
    with (zones / "Test" / "Jump").open("rb") as fh:
        tz = ZoneInfo.from_file(fh, key="Test/Jump")
    skipped = datetime.fromtimestamp(jump / 1000 + 1800, UTC)  # a wall time that never exists
    cron = f"{skipped.minute} {skipped.hour} * * *"
    source = tmp_path / "dst.py"
    source.write_text("import marbles_rq as mr\n\n"
                      f"mr.schedule(cron={cron!r}, tz='Test/Jump', workflow='sx_note', "
                      "key='jump')\n")
    procs = procs_for(source)
    procs.env["PYTHONTZPATH"] = str(zones)
    procs.worker()
    ctl = procs.controller()
    ctl.wait_log("schedule jump (cron")
    assert int(_state(r, "jump")["cursor"]) == jump
    fired = _wait_fired(r, procs, 1, match="sched:jump:", timeout=120)
    assert [_parse(x)[1] for x in fired if "sched:jump:" in x] == [jump]
    tomorrow = next(slots_after(cron, tz, jump))
    assert tomorrow - jump == 23 * 3600_000 + 1800_000  # 30 min into the new offset, a day on
    wait_for(lambda: _state(r, "jump").get("cursor") == str(tomorrow), timeout=10,
             what="the cursor on tomorrow's slot", context=procs.report)
    ctl.wait_log("schedule jump: fired run")
    assert [x for x in _fired(r) if "sched:jump:" in x] == [f"sched:jump:{jump}"]


def test_interval_with_allow_counts_from_the_previous_nominal_and_never_queues() -> None:
    d = _defn(every="10s", overlap="allow")
    st = {"registered_ms": "0", "cursor": "20000", "last_run": "r1", "last_start": "10500"}
    on_time = decide(d, st, _running(), 20_010)
    assert isinstance(on_time, _Fire) and on_time.nominal_ms == 20_000
    assert on_time.cursor == "30000"  # overlaps the run still going
    late = decide(d, st, _running(), 1_000_000)  # after downtime: once, then from now
    assert isinstance(late, _Fire) and late.nominal_ms == 20_000
    assert late.cursor == "1010000"


def test_the_controller_skips_a_due_schedule_whose_lock_is_held(redis_url: str) -> None:
    reg = ScheduleRegistry()
    mr.schedule(every="1h", workflow="sx_roll_target", key="lockme", registry=reg)
    runs = RunStore(open_store(redis_url))
    duty = ScheduleDuty(reg, threaded=False)
    ctl = Controller(runs, rq_connection(redis_url), duties=[duty])
    assert ctl.lead()
    ctl.recover()
    r = _client(redis_url)
    due = _now_ms(r) - 10
    r.hset(KEYS.schedule("lockme"), "cursor", due)  # as if an hour had passed
    r.zadd(KEYS.schedule_due(KEYS.bucket_of("lockme")), {"lockme": due})
    runs.scripts.lock_schedule(keys=KEYS.schedule_keys("lockme"), holder="roll:x", ttl_ms=60_000)
    duty.fire_due(ctl)
    assert not r.keys("*:run:sched:lockme:*") and duty.stats.fired == 0
    looked_again = r.zscore(KEYS.schedule_due(KEYS.bucket_of("lockme")), "lockme")
    assert looked_again is not None and looked_again > _now_ms(r) + 500  # not every pass
    runs.scripts.lock_schedule(keys=KEYS.schedule_keys("lockme"), holder="roll:x", ttl_ms=0)
    r.zadd(KEYS.schedule_due(KEYS.bucket_of("lockme")), {"lockme": due})
    duty.fire_due(ctl)
    assert duty.stats.fired == 1 and r.exists(KEYS.run(f"sched:lockme:{due}")) == 1
