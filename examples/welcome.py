import marbles_rq as mr


@mr.step
def draft(name: str) -> str:
    return f"Hello, {name}!"


@mr.step
def send(text: str) -> str:
    return f"sent {text!r} with key {mr.current().idempotency_key}"


@mr.workflow(timeout_s=3600)
def welcome(ctx: mr.RunContext, name: str) -> str:
    text = draft(name)                                       # recorded in the ledger
    decision = ctx.ask.approval(f"Send {text!r}?", key="send")  # parks until answered
    return send(text) if decision["approved"] else "not sent"
