import marbles_rq as mr


@mr.workflow("folder_a")
def folder_a(ctx: mr.RunContext) -> str:
    return "a"
