import marbles_rq as mr


@mr.workflow("same")
def first(ctx: mr.RunContext) -> None:
    return None
