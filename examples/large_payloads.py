import marbles_rq as mr


@mr.step
def export_rows(rows: int) -> str:
    # Over 256 KiB for a few thousand rows: stored in the blob store, not in Redis.
    return "".join(f"{i},customer-{i:06d},{i * 7 % 1000}.00\n" for i in range(rows))


@mr.workflow
def export_csv(ctx: mr.RunContext, rows: int) -> dict[str, int]:
    text = export_rows(rows)  # the step's result (its ledger entry) is offloaded
    return {"rows": text.count("\n"), "bytes": len(text)}
