import marbles_rq as mr

LOADED = []


@mr.workflow("folder_b")
def folder_b(ctx: mr.RunContext) -> str:
    return "b"
