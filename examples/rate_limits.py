"""Rate limits (docs/how-to/rate-limits.md): a workflow limited per customer, and a limit
taken inside a body before the step that calls a rate-limited API."""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Notice(msgspec.Struct):
    customer: str
    text: str = "hello"


@mr.step
def send_notice(customer: str, text: str) -> str:
    return f"sent to {customer}: {text}"


@mr.step
def charge_customer(customer: str) -> str:
    return f"charged {customer}"


@mr.workflow(rate_limit="10/s", rate_key="customer")  # at most 10 a second per customer
def notify_customer(ctx: mr.RunContext, notice: Notice) -> str:
    return send_notice(notice.customer, notice.text)


@mr.workflow
def checkout(ctx: mr.RunContext, notice: Notice) -> str:
    mr.rate_limit("card-api", mr.Rate("20/s", burst=5))  # shared by every run that calls it
    return charge_customer(notice.customer)
