"""The test kit (marbles_rq.testing): workflows run by the real executor in memory, on a
virtual clock, with no Redis. A month's sleep and a daily cron schedule across both 2027
DST changes in Berlin take well under a second, every fire at its instant; failures,
crashes and mocks injected into step calls; signals, questions, children, parallel branches,
async bodies, deadlines and events; and the `mr_env` fixture, from the installed entry
point, in a pytest run of its own."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

import marbles_rq as mr
from marbles_rq.client.errors import ResultTimeoutError, RunFailedError
from marbles_rq.engine.waits import AlreadyAnsweredError, UnknownQuestionError
from marbles_rq.testing import Environment
from marbles_rq.triggers.schedule_spec import ScheduleRegistry
from tests.procs import REPO_ROOT

UTC = dt.UTC
BERLIN = ZoneInfo("Europe/Berlin")
DAY = dt.timedelta(days=1)
CALLS: list[str] = []


def iso(ms_text: str | None) -> dt.datetime:
    assert ms_text is not None
    return dt.datetime.fromisoformat(ms_text.replace("Z", "+00:00"))


# -- workflows ----------------------------------------------------------------------------

@mr.workflow()
def kit_month_sleeper(ctx: mr.RunContext) -> str:
    mr.sleep(30 * 86400)
    return "rested"


@mr.workflow()
def kit_until(ctx: mr.RunContext, when: str) -> str:
    ctx.sleep_until(dt.datetime.fromisoformat(when))
    return when


class KitEscape(BaseException):
    """Not an Exception: the executor does not take it for the step's failure."""


@mr.step(name="kit_escaping")
def kit_escaping(n: int) -> int:
    CALLS.append(f"escape {n}")
    raise KitEscape(f"escaped {n}")


@mr.workflow(max_deliveries=3)
def kit_escaper(ctx: mr.RunContext, n: int) -> int:
    return kit_escaping(n)


@mr.workflow()
def kit_clock_reader(ctx: mr.RunContext) -> list[str]:
    before = mr.now()
    mr.sleep(3 * 86400)
    return [before.isoformat(), mr.now().isoformat()]


DAILY = ScheduleRegistry()


@mr.schedule(cron="0 9 * * *", tz="Europe/Berlin", registry=DAILY)
@mr.workflow()
def kit_daily(ctx: mr.RunContext) -> str:
    return "report"


OVERLAPS = ScheduleRegistry()


@mr.schedule(every="1h", registry=OVERLAPS)
@mr.workflow()
def kit_hourly(ctx: mr.RunContext) -> str:
    mr.sleep(1800)
    return "ok"


@mr.schedule(cron="*/10 * * * *", tz="UTC", registry=OVERLAPS)
@mr.workflow()
def kit_ten_minutes(ctx: mr.RunContext) -> str:
    mr.sleep(900)
    return "ok"


@mr.step(retries=2, delay_s=30)
def kit_charge(n: int) -> int:
    CALLS.append(f"charge {n}")
    return n * 10


@mr.step()
def kit_ship(n: int) -> str:
    CALLS.append(f"ship {n}")
    return f"shipped {n}"


@mr.workflow()
def kit_order(ctx: mr.RunContext, n: int) -> dict[str, Any]:
    paid = kit_charge(n)
    shipped = kit_ship(n)
    return {"paid": paid, "shipped": shipped}


@mr.workflow()
def kit_waits_for_go(ctx: mr.RunContext) -> Any:
    try:
        return ctx.wait_for_signal("go", timeout_s=3600)
    except mr.SignalTimeoutError:
        return "timed out"


@mr.workflow()
def kit_asks(ctx: mr.RunContext) -> dict[str, Any]:
    colour = ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
    ok = ctx.ask.approval("Paint it?", key="paint", timeout_s=86400,
                          default={"approved": False, "note": "nobody answered"})
    return {"colour": colour, "ok": ok}


@mr.workflow()
def kit_child(ctx: mr.RunContext, n: int) -> int:
    mr.sleep(60 * n)
    return n * n


@mr.workflow()
def kit_parent(ctx: mr.RunContext) -> list[Any]:
    kids = [mr.start_child("kit_child", n, key=f"c{n}") for n in (1, 2, 3)]
    return list(mr.gather(*kids))


@mr.workflow()
def kit_fan(ctx: mr.RunContext) -> list[Any]:
    return list(mr.parallel(lambda: kit_charge(1), lambda: kit_ship(2)))


@mr.step()
async def kit_fetch(n: int) -> int:
    CALLS.append(f"fetch {n}")
    return n + 1


@mr.workflow()
async def kit_async(ctx: mr.RunContext, n: int) -> int:
    first = await kit_fetch(n)
    await mr.sleep(3600)
    return first + await kit_fetch(first)


@mr.workflow(timeout_s=60)
def kit_too_slow(ctx: mr.RunContext) -> str:
    mr.sleep(120)
    return "late"


@mr.on_event("kitshop", type="placed")
@mr.workflow()
def kit_on_placed(ctx: mr.RunContext, event: mr.Event) -> Any:
    paid = ctx.wait_for_event("kitshop", type="paid", match={"order": event.payload["order"]},
                              timeout_s=86400)
    return {"order": event.payload["order"], "amount": paid.payload["amount"]}


@pytest.fixture(autouse=True)
def _calls() -> None:
    CALLS.clear()


# -- the clock ------------------------------------------------------------------------------

def test_a_month_of_sleep_and_a_daily_berlin_schedule_across_both_2027_dst_changes() -> None:
    wall = time.perf_counter()
    env = Environment(start=dt.datetime(2027, 3, 1, tzinfo=BERLIN), tz="Europe/Berlin",
                      schedule_registry=DAILY)
    sleeper = env.start(kit_month_sleeper)
    env.advance(dt.timedelta(days=250))  # to 6 November 2027
    elapsed = time.perf_counter() - wall
    assert env.now() == dt.datetime(2027, 11, 6, tzinfo=BERLIN)

    assert sleeper.result() == "rested"
    # 30 days of 86,400 s from 1 March 00:00 CET (28 February 23:00 UTC), across the change.
    assert iso(sleeper.status().finished_at) == dt.datetime(2027, 3, 30, 23, tzinfo=UTC)

    fired = env.schedules.fired
    assert len(fired) == 250  # one a day, 1 March 09:00 .. 5 November 09:00
    definition = DAILY.get("kit-daily")
    for day, fire in enumerate(fired):
        date = dt.date(2027, 3, 1) + dt.timedelta(days=day)
        summer = dt.date(2027, 3, 28) <= date < dt.date(2027, 10, 31)
        expected = dt.datetime(date.year, date.month, date.day, 7 if summer else 8,
                               tzinfo=UTC)
        assert fire.at == expected, (date, fire.at)
        assert fire.run_id == definition.run_id(int(expected.timestamp() * 1000))
        status = env.status(fire.run_id)
        assert status.status == "succeeded"
        assert iso(status.started_at) == expected  # it ran at its instant, not later
    assert [f.at.hour for f in fired[26:28]] == [8, 7]  # 27 and 28 March
    assert [f.at.hour for f in fired[243:245]] == [7, 8]  # 30 and 31 October
    assert elapsed < 1.0, f"{elapsed:.2f} s of wall time"


def test_an_interval_counts_from_the_last_runs_end_and_a_busy_cron_slot_is_skipped() -> None:
    env = Environment(start=dt.datetime(2027, 1, 1, tzinfo=UTC), schedule_registry=OVERLAPS)
    env.advance(dt.timedelta(hours=5))
    by_key: dict[str, list[str]] = {}
    for fire in env.schedules.fired:
        by_key.setdefault(fire.key, []).append(fire.at.strftime("%H:%M"))
    # every 1h from the end of the previous run (each sleeps 30 min)
    assert by_key["kit-hourly"] == ["01:00", "02:30", "04:00"]
    # every 10 min, each run 15 min: the slot that finds the previous running is skipped
    assert by_key["kit-ten-minutes"][:4] == ["00:10", "00:30", "00:50", "01:10"]
    assert len(by_key["kit-ten-minutes"]) == 15  # 00:10 .. 04:50
    assert env.schedules.skipped("kit-ten-minutes") == 15  # 00:20 .. 05:00


def test_the_clock_starts_where_asked_and_never_moves_by_itself() -> None:
    env = Environment(start=dt.datetime(2030, 1, 1, 12, 0), tz="Europe/Berlin")
    assert env.now() == dt.datetime(2030, 1, 1, 12, 0, tzinfo=BERLIN)
    run = env.start(kit_month_sleeper)
    env.run_until_idle()
    assert env.now() == dt.datetime(2030, 1, 1, 12, 0, tzinfo=BERLIN)
    status = run.status()
    assert status.status == "waiting" and status.waiting is not None
    assert status.waiting.for_["until_ms"] == int(
        dt.datetime(2030, 1, 31, 11, tzinfo=UTC).timestamp() * 1000)
    with pytest.raises(ResultTimeoutError, match="waiting"):
        run.result()
    env.advance(dt.timedelta(days=30) - dt.timedelta(milliseconds=1))
    assert run.status().status == "waiting"  # due one millisecond later, not before
    env.advance(dt.timedelta(milliseconds=1))
    assert run.result() == "rested"
    with pytest.raises(ValueError):
        env.advance(-1)


def test_the_clock_refuses_to_go_back_or_past_what_a_datetime_holds_and_stays_put() -> None:
    start = dt.datetime(2030, 1, 1, 12, tzinfo=UTC)
    env = Environment(start=start)
    with pytest.raises(ValueError, match="does not go back"):
        env.advance_to(dt.datetime(2000, 1, 1, tzinfo=UTC))
    for amount in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            env.advance(amount)
    with pytest.raises(ValueError, match="9999"):
        env.advance(dt.timedelta(days=999_999_999))
    assert env.now() == start
    with pytest.raises(TypeError, match="takes a datetime"):
        env.advance_to("2031-01-01")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a datetime"):
        Environment(start="2031-01-01")  # type: ignore[arg-type]
    run = env.start(kit_month_sleeper)
    env.advance(dt.timedelta(days=30))
    assert run.result() == "rested"


def test_mr_now_reads_the_virtual_clock() -> None:
    env = Environment(start=dt.datetime(2031, 5, 1, 8, tzinfo=UTC))
    run = env.start(kit_clock_reader)
    env.advance(dt.timedelta(days=3))
    assert run.result() == ["2031-05-01T08:00:00+00:00", "2031-05-04T08:00:00+00:00"]


def test_sleep_until_a_local_time_after_the_change_to_summer_time() -> None:
    env = Environment(start=dt.datetime(2027, 3, 27, 12, tzinfo=BERLIN), tz="Europe/Berlin")
    run = env.start(kit_until, "2027-03-28T12:00:00+02:00")  # 23 hours later, not 24
    env.advance(dt.timedelta(hours=22, minutes=59, seconds=59))
    assert run.status().status == "waiting"
    env.advance(dt.timedelta(seconds=1))
    assert run.result() == "2027-03-28T12:00:00+02:00"
    assert env.now() == dt.datetime(2027, 3, 28, 12, tzinfo=BERLIN)


def test_a_run_past_its_deadline_fails_at_that_instant() -> None:
    env = Environment(start=dt.datetime(2030, 1, 1, tzinfo=UTC))
    run = env.start(kit_too_slow)
    env.advance(3600)
    status = run.status()
    assert status.status == "failed" and status.error is not None
    assert status.error.type == "RunTimeout"
    assert iso(status.finished_at) == dt.datetime(2030, 1, 1, 0, 1, tzinfo=UTC)


# -- failure injection ------------------------------------------------------------------------

def test_fail_step_fails_attempts_and_the_step_retries() -> None:
    env = Environment()
    env.fail_step("kit_order.kit_charge#0", times=2)
    run = env.start(kit_order, 4)
    env.run_until_idle()
    # Retries wait on the virtual clock (delay_s=30, exponential, jitter: 15-30 s, 30-60 s).
    assert run.status().status == "waiting"
    env.advance(90)
    assert run.result() == {"paid": 40, "shipped": "shipped 4"}
    assert CALLS == ["charge 4", "ship 4"]  # the body ran once: the third attempt
    steps = {s.name: s for s in run.status().steps}
    assert steps["kit_charge"].attempts == 3
    retries = [e.data for e in env.output(run.id)
               if e.type == "parked" and e.data["reason"] == "retry"]
    assert [r["error"] for r in retries] == [
        "RuntimeError: failure injected into step kit_order.kit_charge#0"] * 2


def test_fail_step_beyond_the_retries_fails_the_run_with_the_given_error() -> None:
    env = Environment()
    env.fail_step("kit_order.kit_charge#0", times=3, error=ConnectionError("card declined"))
    run = env.start(kit_order, 4)
    env.advance(90)
    with pytest.raises(RunFailedError) as failed:
        run.result()
    assert failed.value.error["type"] == "ConnectionError"
    assert "card declined" in failed.value.error["message"]
    assert CALLS == []


def test_fail_step_and_mock_step_on_async_steps() -> None:
    env = Environment()
    env.fail_step("kit_async.kit_fetch#0", times=1, error=TimeoutError)
    run = env.start(kit_async, 1)
    env.advance(3600)
    with pytest.raises(RunFailedError) as failed:  # kit_fetch has no retries
        run.result()
    assert failed.value.error["type"] == "TimeoutError"
    env.mock_step("kit_fetch", lambda n: n * 100)
    mocked = env.start(kit_async, 1)
    env.advance(3600)
    assert mocked.result() == 100 + 10000
    assert CALLS == []


def test_crash_after_a_step_replays_the_ledger_without_running_it_again() -> None:
    env = Environment()
    env.crash_after("kit_order.kit_charge#0")
    run = env.start(kit_order, 5)
    assert run.result() == {"paid": 50, "shipped": "shipped 5"}
    assert CALLS == ["charge 5", "ship 5"]  # charged once, though delivered twice
    status = run.status()
    assert status.attempt == 2  # a redelivery
    kinds = [e.data["kind"] for e in env.output(run.id) if e.type == "attempt_started"]
    assert kinds == ["first", "redelivery"]


def test_a_base_exception_from_a_step_is_a_crash_redelivered_until_max_deliveries() -> None:
    """On a worker it ends the work-horse; the run is redelivered, and failed once it has
    had its max_deliveries. The kit does the same (it used to raise it out of `result()`
    and leave the run running for ever), and names what escaped."""
    env = Environment()
    run = env.start(kit_escaper, 4)
    with pytest.raises(RunFailedError, match=r"DeliveriesExhausted.*KitEscape: escaped 4"):
        run.result()
    status = run.status()
    assert (status.status, status.attempt) == ("failed", 3)
    assert CALLS == ["escape 4"] * 3
    other = env.start(kit_month_sleeper)  # the environment goes on
    env.advance(dt.timedelta(days=30))
    assert other.result() == "rested"


def test_an_injection_that_could_never_match_is_refused_naming_it() -> None:
    """A step's bare name given for a call's key, a typo'd step name: the injection would
    silently do nothing and the test pass for the wrong reason."""
    env = Environment()
    for inject in (env.fail_step, env.crash_after):
        with pytest.raises(ValueError, match=r"'kit_charge' is not a ledger key"):
            inject("kit_charge")
    with pytest.raises(ValueError, match=r"no step named 'kit_chrage'.*kit_charge"):
        env.mock_step("kit_chrage", 1)
    env.crash_after("kit_order.|parallel#0[1].kit_charge#0")  # a branch's call: a key
    env.mock_step("kit_order.kit_charge#0", 7)
    assert env.start(kit_order, 5).result()["paid"] == 7


def test_mock_step_replaces_the_body_and_is_still_recorded() -> None:
    env = Environment()
    env.mock_step("kit_charge", 7)
    env.mock_step("kit_order.kit_ship#0", lambda n: f"mocked {n}")
    run = env.start(kit_order, 1)
    assert run.result() == {"paid": 7, "shipped": "mocked 1"}
    assert CALLS == []
    assert [(s.name, s.status) for s in run.status().steps] == [
        ("kit_charge", "succeeded"), ("kit_ship", "succeeded")]


# -- what runs wait for -----------------------------------------------------------------------

def test_a_signal_before_its_timeout_and_a_timeout_at_its_instant() -> None:
    env = Environment(start=dt.datetime(2030, 5, 1, tzinfo=UTC))
    got = env.start(kit_waits_for_go, run_id="got")
    late = env.start(kit_waits_for_go, run_id="late")
    env.advance(600)
    sent = got.signal("go", {"by": "ann"})
    assert sent.woken and sent.seq == 1
    env.advance(3600)
    assert got.result() == {"by": "ann"}
    assert iso(got.status().finished_at) == dt.datetime(2030, 5, 1, 0, 10, tzinfo=UTC)
    assert late.result() == "timed out"
    assert iso(late.status().finished_at) == dt.datetime(2030, 5, 1, 1, 0, tzinfo=UTC)


def test_a_signal_sent_before_the_run_asks_is_buffered() -> None:
    env = Environment()
    run = env.start(kit_waits_for_go)
    run.signal("go", 1)
    assert run.result() == 1
    assert run.status().signals["go"].taken == 1


def test_questions_answers_and_an_approval_that_times_out_to_its_default() -> None:
    env = Environment(start=dt.datetime(2030, 1, 1, tzinfo=UTC))
    run = env.start(kit_asks)
    env.run_until_idle()
    assert [q.key for q in run.status().questions] == ["colour"]
    with pytest.raises(UnknownQuestionError):
        run.answer("size", "L")
    run.answer("colour", "2")  # the choice's number, as on the CLI
    with pytest.raises(AlreadyAnsweredError):
        run.answer("colour", "red")
    env.run_until_idle()
    assert {q.key: q.state for q in run.status().questions} == {"colour": "answered",
                                                                "paint": "open"}
    env.advance(DAY)
    assert run.result() == {"colour": "blue",
                            "ok": {"approved": False, "note": "nobody answered"}}
    with pytest.raises(AlreadyAnsweredError):
        run.approve("paint")


def test_children_run_and_their_parent_gathers_them() -> None:
    env = Environment()
    parent = env.start(kit_parent)
    env.run_until_idle()
    children = env.children(parent)  # a handle, or its id
    assert [c.id for c in children] == [c.id for c in env.children(parent.id)]
    assert [c.workflow for c in children] == ["kit_child"] * 3
    assert [c.status().status for c in children] == ["waiting"] * 3
    env.advance(120)
    assert parent.status().status == "waiting"  # the third child sleeps 3 minutes
    env.advance(60)
    assert parent.result() == [1, 4, 9]
    assert [c.result() for c in children] == [1, 4, 9]


def test_cancelling_a_parent_cancels_its_children() -> None:
    env = Environment()
    parent = env.start(kit_parent)
    env.run_until_idle()
    outcome = parent.cancel()
    assert outcome.outcome == "cancelled" and len(outcome.children) == 3
    assert {c.status().status for c in env.children(parent.id)} == {"cancelled"}


def test_parallel_branches() -> None:
    env = Environment()
    run = env.start(kit_fan)
    assert run.result() == [10, "shipped 2"]
    assert sorted(CALLS) == ["charge 1", "ship 2"]


def test_an_async_workflow_with_an_async_step_and_a_timer() -> None:
    env = Environment()
    run = env.start(kit_async, 1)
    env.run_until_idle()
    assert run.status().status == "waiting"
    env.advance(3600)
    assert run.result() == 2 + 3
    assert CALLS == ["fetch 1", "fetch 2"]  # the first is replayed, not run again


def test_pause_holds_a_timer_until_resume() -> None:
    env = Environment()
    run = env.start(kit_month_sleeper)
    env.run_until_idle()
    assert run.pause().outcome == "paused"
    env.advance(dt.timedelta(days=31))
    assert run.status().status == "waiting"
    run.resume()
    assert run.result() == "rested"


def test_an_event_starts_its_trigger_and_a_matching_event_wakes_the_wait() -> None:
    env = Environment()
    sent = env.send_event("kitshop", "placed", {"order": "A-1"}, id="p1")
    assert sent.workflow == "kit_on_placed" and sent.run_created
    run = env.handle(sent.run_id)
    env.run_until_idle()
    assert run.status().status == "waiting"
    other = env.send_event("kitshop", "paid", {"order": "B-2", "amount": 5})
    assert other.delivered == ()  # another order: no wait matches
    paid = env.send_event("kitshop", "paid", {"order": "A-1", "amount": 12})
    assert paid.delivered == (run.id,)
    assert run.result() == {"order": "A-1", "amount": 12}
    again = env.send_event("kitshop", "placed", {"order": "A-1"}, id="p1")
    assert not again.created and again.run_id == run.id


def test_an_event_received_before_the_wait_opens_counts_within_the_lookback() -> None:
    env = Environment()
    env.send_event("kitshop", "paid", {"order": "A-3", "amount": 3})
    sent = env.send_event("kitshop", "placed", {"order": "A-3"})
    assert env.result(sent.run_id) == {"order": "A-3", "amount": 3}


# -- the pytest plugin ------------------------------------------------------------------------

def test_the_mr_env_fixture_comes_from_the_installed_entry_point(tmp_path: Path) -> None:
    (tmp_path / "test_uses_kit.py").write_text(textwrap.dedent("""
        import datetime as dt

        import marbles_rq as mr


        @mr.workflow()
        def nap(ctx) -> str:
            mr.sleep(7 * 86400)
            return "awake"


        def test_a_week_passes(mr_env):
            run = mr_env.start(nap)
            mr_env.advance(dt.timedelta(days=7))
            assert run.result() == "awake"
    """))
    env = {**os.environ, "MARBLES_REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing listens
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_uses_kit.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert REPO_ROOT.exists()
