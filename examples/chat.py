"""Sessions (docs/how-to/sessions.md): a support conversation kept as a transcript. The run
appends the customer's question to its own session, a step drafts the answer and appends
it, and the run hands its notes to a shared session other runs append to as well."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def draft_answer(question: str) -> int:
    reply = f"Thanks for asking about {question!r}: here is what we know."
    # In a step, the append carries the run's automatic idempotency key: a step executed
    # again (its worker was killed before it committed) appends nothing twice.
    position: int = mr.session().append({"role": "assistant", "text": reply})
    return position


@mr.workflow
def support_chat(ctx: mr.RunContext, question: str) -> dict[str, object]:
    chat = mr.session()  # the run's own session: its id is the run's id
    chat.append({"role": "customer", "text": question})
    answered_at = draft_answer(question)
    notes = mr.session("support-notes")  # shared by every run; a child of this run's session
    notes.append({"run": ctx.run_id, "question": question})
    return {"session": chat.id, "answered_at": answered_at,
            "messages": len(chat.read())}
