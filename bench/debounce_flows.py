"""Workflows of bench/debounce.py: one body, gated in each of the ways measured."""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Inp(msgspec.Struct):
    customer: str
    n: int = 0
    items: list[int] = msgspec.field(default_factory=list)


def merge(previous: Inp, new: Inp) -> Inp:
    return Inp(previous.customer, new.n, previous.items[-50:] + new.items)


@mr.workflow()
def b_plain(ctx: mr.RunContext, inp: Inp) -> None: ...


@mr.workflow(debounce="1h", debounce_key="customer")
def b_debounce(ctx: mr.RunContext, inp: Inp) -> None: ...


@mr.workflow(debounce="1h", debounce_key="customer", debounce_reduce=merge)
def b_reduce(ctx: mr.RunContext, inp: Inp) -> None: ...


@mr.workflow(throttle="100000/h", throttle_key="customer")
def b_throttle(ctx: mr.RunContext, inp: Inp) -> None: ...


@mr.workflow(singleton="skip", singleton_key="customer")
def b_singleton(ctx: mr.RunContext, inp: Inp) -> None: ...


@mr.workflow(throttle="1/h", throttle_key="customer")
def b_throttle_full(ctx: mr.RunContext, inp: Inp) -> None: ...
