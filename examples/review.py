"""A release that waits: it builds in parallel, fans out to child runs, asks a person for
approval, sleeps, and reports as it goes. None of the waiting holds a worker.

    marbles-rq --source examples/review.py enqueue release --input '{"version": "1.4"}' --id rel-1.4
    marbles-rq feed                                   # the approval it waits for
    marbles-rq approve rel-1.4 ship --note "go"       # it wakes, sleeps 5 s, finishes
    marbles-rq status rel-1.4
"""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Release(msgspec.Struct):
    version: str
    regions: list[str] = msgspec.field(default_factory=lambda: ["eu", "us"])
    soak_s: float = 5.0


@mr.step
def build(target: str, version: str) -> str:
    return f"{target}-{version}.tar.gz"


@mr.step
def publish(artifacts: list[str]) -> int:
    return len(artifacts)


@mr.workflow()
def deploy_region(ctx: mr.RunContext, region: str) -> str:
    return f"deployed to {region}"


@mr.workflow()
def release(ctx: mr.RunContext, inp: Release) -> dict[str, object]:
    ctx.tag(version=inp.version)  # a search tag: `marbles-rq runs --tag version=1.4`
    # Two builds at once; each has its own stable place in the ledger.
    artifacts = mr.parallel(lambda: build("linux", inp.version),
                            lambda: build("macos", inp.version))
    ctx.report.milestone({"built": artifacts})
    decision = ctx.ask.approval(f"Ship {inp.version}?", body=", ".join(artifacts), key="ship")
    if not decision["approved"]:
        return {"shipped": False, "note": decision["note"]}
    published = publish(artifacts)
    mr.sleep(inp.soak_s)  # a durable timer: the controller wakes the run
    children = [mr.start_child("deploy_region", region, key=f"deploy-{region}")
                for region in inp.regions]
    deployed = mr.gather(*children)
    ctx.report.result({"version": inp.version, "regions": deployed})
    return {"shipped": True, "published": published, "deployed": deployed}
