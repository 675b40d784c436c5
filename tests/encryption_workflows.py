"""Workflows of tests/test_encryption.py (loaded by workers with --source).

`enc_all` puts every kind of user value a run stores through the store: its input, a step's
arguments and result, an output line, a published value, a milestone report, an answer to
a question, a signal's payload, a child run's input and result, and its own result. Each
value carries a marker the test chose (a random string), so the test can look for it in
every key of Redis afterwards.

`enc_wait` parks on a signal (a run in flight across a key rotation), with a step before
and after it.
"""

from __future__ import annotations

from typing import Any

import marbles_rq as mr


@mr.step
def enc_echo(text: str) -> str:
    return f"step saw {text}"


@mr.workflow
def enc_child(ctx: mr.RunContext, inp: dict[str, Any]) -> dict[str, Any]:
    return {"child saw": inp["c"]}


@mr.workflow
def enc_all(ctx: mr.RunContext, inp: dict[str, Any]) -> dict[str, Any]:
    stepped = enc_echo(inp["step"])
    ctx.stream.write({"printed": inp["out"]})
    mr.publish("state", {"published": inp["pub"]})
    mr.report.milestone({"reported": inp["rep"]})
    answer = mr.ask.question("What is the answer?", key="q")
    signal = mr.wait_for_signal("go")
    child = mr.start_child("enc_child", {"c": inp["child"]}, key="kid").result()
    return {"stepped": stepped, "answer": answer, "signal": signal, "child": child}


@mr.workflow
def enc_wait(ctx: mr.RunContext, inp: dict[str, Any]) -> dict[str, Any]:
    before = enc_echo(inp["before"])
    signal = mr.wait_for_signal("go")
    after = enc_echo(str(signal))
    return {"before": before, "after": after}


# -- inbound events, batches, event waits, debounce windows -----------------------------------

@mr.on_event("enc-shop", type="paid")
@mr.workflow
def enc_on_event(ctx: mr.RunContext, event: mr.Event) -> dict[str, Any]:
    return {"got": event.payload}


@mr.on_event("enc-batch", batch=mr.Batch(max_size=2, max_wait="30s"))
@mr.workflow
def enc_batched(ctx: mr.RunContext, events: list[mr.Event]) -> list[Any]:
    return [e.payload for e in events]


@mr.workflow
def enc_event_wait(ctx: mr.RunContext, inp: dict[str, Any]) -> Any:
    # The match value is kept in the wait's spec in clear (docs/how-to/encryption.md).
    return mr.wait_for_event("enc-wait", type="paid", match={"order": inp["order"]}).payload


def _merge(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {"customer": new["customer"], "items": previous["items"] + new["items"]}


@mr.workflow(debounce="1s", debounce_key="customer", debounce_reduce=_merge)
def enc_debounced(ctx: mr.RunContext, inp: dict[str, Any]) -> list[Any]:
    return list(inp["items"])


@mr.step
def enc_note(session_id: str, text: str) -> int:
    # An append inside a step, to the run's own session's child: sealed like the rest.
    return mr.session(session_id).append({"note": text})


@mr.step
def enc_put(name: str, data: str) -> int:
    return mr.artifact(name).put(data.encode(), media_type="text/plain")


@mr.workflow
def enc_kept(ctx: mr.RunContext, inp: dict[str, Any]) -> dict[str, Any]:
    """A session message from the body and from a step, an artifact from a step (small:
    kept in Redis) and a large one (over the inline size: in the blob store)."""
    mr.session().append({"said": inp["said"]})
    enc_note(inp["session"], inp["noted"])
    small = enc_put(inp["art"], inp["small"])
    large = enc_put(inp["art"] + "-big", inp["large"])
    return {"small": small, "large": large}
