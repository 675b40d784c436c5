"""Retry policies, and a step that waits for a person when its tries run out.

    marbles-rq --source examples/payments.py enqueue convert --input '{"amount": 100}'
    marbles-rq --source examples/payments.py enqueue charge_order --input 500 --id order-500
    marbles-rq status order-500                       # waiting: failed_step ...
    marbles-rq retry order-500 --input-patch '{"amount": 50}'
    marbles-rq fail order-500 --reason "card expired" # or give up
"""

from __future__ import annotations

import time

import msgspec

import marbles_rq as mr


class Conversion(msgspec.Struct):
    amount: float
    currency: str = "EUR"


@mr.step(retry=mr.Retry(initial="1s", backoff=2.0, max_interval="30s", max_attempts=5,
                        jitter=False))
def fetch_rate(currency: str, available_at: float) -> float:
    # Stands for a service that is down for a moment: it answers from `available_at` on.
    if time.time() < available_at:
        raise ConnectionError("rates service unavailable")
    return {"EUR": 1.08, "GBP": 1.27}.get(currency, 1.0)


@mr.workflow()
def convert(ctx: mr.RunContext, inp: Conversion) -> float:
    opened = mr.now().timestamp()  # recorded: every replay gets the same instant
    return round(inp.amount * fetch_rate(inp.currency, opened + 1.5), 2)


class Card(msgspec.Struct):
    number: str
    cvc: str = ""


# A limit refusal does not get better by waiting: ValueError fails the step at once.
@mr.step(retry=mr.Retry(initial="200ms", max_attempts=3, non_retryable=(ValueError,)))
def charge_card(amount: int, card: Card) -> dict[str, object]:
    if amount > 100:
        raise ValueError(f"amount {amount} is over the card's limit")
    return {"charged": amount, "card": card.number[-4:]}


@mr.workflow(on_exhausted="pause")
def charge_order(ctx: mr.RunContext, amount: int = 500) -> dict[str, object]:
    return charge_card(amount, Card("4000056655665556", "123"))
