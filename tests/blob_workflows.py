"""Workflows of tests/test_blobs.py and bench/blobs.py: steps that return large values
(offloaded to the blob store), loaded by their worker processes (--source)."""

from __future__ import annotations

import hashlib

import msgspec

import marbles_rq as mr


class BigInput(msgspec.Struct):
    size: int = 1 << 20   # characters each step returns
    steps: int = 1


def big_text(index: int, size: int) -> str:
    """`size` characters, different per index, that do not compress to nothing."""
    seed = hashlib.sha256(str(index).encode()).hexdigest()
    return (seed * (size // len(seed) + 1))[:size]


@mr.step
def bw_chunk(index: int, size: int) -> str:
    return big_text(index, size)


@mr.workflow(retention_s=2)
def bw_big(ctx: mr.RunContext, inp: BigInput) -> str:
    """Each step returns `size` characters; the result is the last step's (as large)."""
    last = ""
    for i in range(inp.steps):
        last = bw_chunk(i, inp.size)
    return last


@mr.workflow
def bw_big_kept(ctx: mr.RunContext, inp: BigInput) -> str:
    """bw_big with the default retention (the bench reads its result back)."""
    last = ""
    for i in range(inp.steps):
        last = bw_chunk(i, inp.size)
    return last
