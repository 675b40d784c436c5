import marbles_rq as mr


@mr.workflow("same")
def second(ctx: mr.RunContext) -> None:
    return None
