"""A short round trip through the durable store: claim, provision, compare-and-set,
journal, effect claim, lease, purge. Run: python examples/store_roundtrip.py REDIS_URL"""

from __future__ import annotations

import sys
import uuid

import msgspec

from marbles_rq.store import Lease, open_store
from marbles_rq.store.records import AgentRecord, EventRecord, JournalEntry, WorkspaceEntry


def main(url: str) -> None:
    store = open_store(url)
    tag = uuid.uuid4().hex[:8]
    agent_id = f"agent-{tag}"

    provision = store.provision(AgentRecord(version=1, id=agent_id, definition_id="demo",
                                            provisioning_key=f"pk-{tag}"))
    print(f"provision pk-{tag}: created={provision.created} agent={provision.agent.id}")

    event = EventRecord(version=1, id=f"ev-{tag}", source="demo",
                        payload=msgspec.Raw(b'{"b":2,"a":12345678901234567890,"s":"\xc3\xa9"}'))
    first, second = store.claim(event, owner=agent_id), store.claim(event, owner=agent_id)
    print(f"claim ev-{tag}: first won={first.won}, second won={second.won}")
    stored = store.get_raw(EventRecord, event.id)
    print(f"stored bytes equal what was written: {stored == msgspec.json.encode(event)}")

    entry = WorkspaceEntry(version=1, workspace_id=f"ws-{tag}", key="config", updated_at="1")
    print(f"cas (absent -> 1): {store.compare_and_set(entry, None, owner=agent_id).ok}")
    stale = store.compare_and_set(msgspec.structs.replace(entry, updated_at="2"), "0")
    print(f"cas with a stale expectation: ok={stale.ok} current={stale.current}")

    store.append("demo", JournalEntry(version=1, id=f"j-{tag}", type="hello"), owner=agent_id)
    seen = [e.id for e in store.read_journal("demo") if e.id == f"j-{tag}"]
    print(f"journal read right after append sees it: {seen == [f'j-{tag}']}")

    lease = store.acquire_lease(f"demo-{tag}", "me", 5000)
    assert isinstance(lease, Lease)
    other = store.acquire_lease(f"demo-{tag}", "someone-else", 5000)
    print(f"lease epoch {lease.epoch}; another token is refused: {not isinstance(other, Lease)}")
    store.release_lease(lease)

    removed = store.purge(agent_id)
    print(f"purge {agent_id}: removed {removed} records; agent gone: "
          f"{store.get_agent(agent_id) is None}")


if __name__ == "__main__":
    main(sys.argv[1])
