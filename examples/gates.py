"""Debounce, throttle and singleton (docs/how-to/debounce-throttle-singleton.md)."""

from typing import Any

import marbles_rq as mr


@mr.workflow(debounce="2s", debounce_key="customer", debounce_max="30s")
def sync_customer(ctx: mr.RunContext, change: dict[str, Any]) -> dict[str, Any]:
    return change  # the last change of the window


@mr.workflow(throttle="3/min", throttle_key="customer")
def send_digest(ctx: mr.RunContext, inp: dict[str, Any]) -> str:
    return f"digest sent to {inp['customer']}"


@mr.workflow(singleton="skip", singleton_key="index")
def rebuild_index(ctx: mr.RunContext, inp: dict[str, Any]) -> str:
    mr.wait_for_signal("go", timeout_s=60)  # stands for a long rebuild
    return f"rebuilt {inp['index']}"
