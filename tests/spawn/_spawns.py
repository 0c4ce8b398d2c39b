"""Helpers shared by the spawn contract tests: bounds, start methods, exit codes."""

from __future__ import annotations

import signal

import aiomp

#: Bound on every await on a child. Generous: two shared cores, cold interpreters.
TIMEOUT = 20
GRACE = 0.5
METHODS = ["spawn", "forkserver", "fork"]


def exitcodes(ctx: aiomp.ProcessContext) -> list[int | None]:
    return [p.exitcode for p in ctx.processes]


#: A failed child is terminated along with the others if it has not exited yet (as torch
#: does): its error has already arrived, so its exit status is either.
FAILED = (1, -signal.SIGTERM)
