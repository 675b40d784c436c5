"""The project's example workflows (examples/), each run to its end by the test kit
(marbles_rq.testing): in memory, on a virtual clock, answering their questions. A step
whose effect goes to Redis (chain's `link`, etl's `publish_report`) is replaced with
`mock_step`; every other body runs for real."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import load_source
from marbles_rq.testing import Environment
from tests.procs import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture(scope="module", autouse=True)
def _examples() -> None:
    for name in ("welcome.py", "review.py", "async_pages.py", "chain.py", "etl.py",
                 "app/shop.py", "trip.py"):
        load_source(str(EXAMPLES / name))


def test_welcome_sends_once_approved_and_not_when_rejected() -> None:
    env = Environment()
    sent = env.start("welcome", "Ada")
    declined = env.start("welcome", "Bob")
    env.run_until_idle()
    assert [q.key for q in sent.status().questions] == ["send"]
    sent.approve("send")
    declined.reject("send", "not today")
    assert sent.result() == f"sent 'Hello, Ada!' with key {sent.id}:welcome.send#0"
    assert declined.result() == "not sent"


def test_review_builds_asks_soaks_and_deploys_to_its_regions() -> None:
    env = Environment(start=dt.datetime(2027, 6, 1, 12, tzinfo=dt.UTC))
    run = env.start("release", {"version": "1.4", "soak_s": 3600}, run_id="rel-1.4")
    env.run_until_idle()
    status = run.status()
    assert status.waiting is not None and status.waiting.reason == "question"
    assert [r.entry for r in status.reports] == [
        {"built": ["linux-1.4.tar.gz", "macos-1.4.tar.gz"]}]
    run.approve("ship", "go")
    env.run_until_idle()
    assert run.status().waiting is not None  # the soak: an hour on the virtual clock
    env.advance(dt.timedelta(hours=1))
    assert run.result() == {"shipped": True, "published": 2,
                            "deployed": ["deployed to eu", "deployed to us"]}
    assert [c.result() for c in env.children(run.id)] == ["deployed to eu", "deployed to us"]
    assert run.status().finished_at == "2027-06-01T13:00:00.000Z"


def test_review_rejected_ships_nothing() -> None:
    env = Environment()
    run = env.start("release", {"version": "2.0"})
    env.run_until_idle()
    run.reject("ship", "wait for QA")
    assert run.result() == {"shipped": False, "note": "wait for QA"}
    assert env.children(run.id) == []


def test_async_pages_measures_and_sleeps() -> None:
    env = Environment()
    run = env.start("measure_all", ["a", "bb", "ccc"])
    env.advance(1)
    assert run.result() == {"sizes": [1, 2, 3], "total": 6}


def test_chain_runs_its_links_in_order() -> None:
    env = Environment()
    env.mock_step("link", lambda index, sleep_s: mr.current().idempotency_key)
    run = env.start("chain", {"steps": 3})
    assert run.result() == {"steps": 3, "keys": [f"{run.id}:chain.link#{i}" for i in range(3)]}


def test_etl_fetches_transforms_and_publishes() -> None:
    source = REPO_ROOT / "pyproject.toml"
    text = source.read_text()
    env = Environment()
    env.mock_step("publish_report", lambda target, report: f"{target}:{report.lines}")
    run = env.start("etl", {"url": source.resolve().as_uri(), "target": "reports"})
    result = run.result()
    assert result["published_as"] == f"reports:{len(text.splitlines())}"
    assert result["sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_shop_orders_small_big_rejected_and_unknown() -> None:
    env = Environment()
    small = env.start("place_order", {"sku": "book", "qty": 2})
    big = env.start("place_order", {"sku": "sofa"})
    refused = env.start("place_order", {"sku": "sofa", "qty": 2})
    unknown = env.start("place_order", {"sku": "boat"})
    env.run_until_idle()
    big.approve("big-order")
    refused.reject("big-order", "too much")
    assert small.result() == {"status": "placed", "total": 24, "reservation": "res-book-2",
                              "receipt": f"ch-{small.id}:place_order.charge#0"}
    assert big.result()["status"] == "placed"
    assert refused.result() == {"status": "rejected", "total": 2400, "note": "too much"}
    with pytest.raises(mr.RunFailedError) as failed:
        unknown.result()
    assert failed.value.error["type"] == "ValueError"


def test_shop_restock_and_a_tracked_delivery() -> None:
    env = Environment()
    restock = env.start("restock", {"sku": "lamp", "steps": 2, "sleep_s": 0})
    assert restock.result() == {"sku": "lamp", "batches": 2}
    track = env.start("track_delivery", "o-1")
    env.run_until_idle()
    assert track.get("stage") == "packed"
    track.signal("scan", {"at": "hub"})
    env.advance(dt.timedelta(days=2))
    assert track.get("stage") == "hub"
    track.signal("scan", {"at": "delivered"})
    assert track.result() == {"order": "o-1", "scans": ["hub", "delivered"]}
    assert track.get("stage") == "delivered"


def test_trip_undoes_its_bookings_when_the_payment_fails() -> None:
    env = Environment()
    paid = env.start("trip", {"traveller": "ada"})
    declined = env.start("trip", {"traveller": "bob", "card": "declined"})
    env.run_until_idle()
    assert paid.result() == {"flight": "flight-ada", "hotel": "hotel-ada",
                             "payment": "paid-ada"}
    assert paid.status().compensations[0].status == "not_run"  # registered, never needed
    assert declined.status().status == "failed"
    assert [(c.name, c.status) for c in declined.status().compensations] == [
        ("cancel_hotel", "done"), ("cancel_flight", "done")]
