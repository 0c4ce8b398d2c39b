"""One epoch of an iterable-style dataset in a :class:`aiomp.DataLoader`.

As in torch, each of the ``num_workers`` shards runs the dataset's own iterator, which
splits itself by ``get_worker_info()``; here shard ``s`` is one Pool task (any worker may
run it: its ``get_worker_info().id`` is ``s`` meanwhile) that puts its batches on a
bounded :class:`aiomp.Queue` of ``prefetch_factor * num_workers`` (the back-pressure).
``in_order=True`` hands the batches out round-robin over the shards, as torch does;
``False``, as they come.

A shard whose worker dies is run again on the replacement, which replays the shard's
iterator (each batch ``j`` drawn with the same seeds) and puts only the batches after
those the consumer has received; one the dead worker had put and the consumer had not
yet taken comes twice, and its copy is dropped by its index. So the shard's batches are
the same as with no death, up to ``max_retries`` deaths per shard and epoch; past that,
or where the dataset raised, the shard yields that error after its batches, then nothing
more; the other shards go on. ``timeout`` bounds the wait for each batch: past it, the
epoch's tasks are cancelled (their workers replaced by the Pool) and ``TimeoutError`` (also
torch's ``RuntimeError``) is raised.

Resume (docs/decisions/0085-loader-torch-compat.md): with each batch, a shard sends its
dataset's (and iterator's) state after it, where they have ``state_dict()``; the consumer
keeps, per shard, the state of the last batch it handed out (:meth:`StreamEpoch.position`),
and a resumed shard loads it and goes on at its next batch. At its end a shard sends its
final state, which its next epoch starts from.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio

from .._errors import BrokenWorkerError, QueueClosed
from .._loop import is_cancellation
from .._queue.queue import Queue
from . import options as _options
from . import worker as _worker
from .epoch import Owner, receive
from .feeds import broken
from .worker import Position, ShardMark


def resumable(position: Position | None) -> bool:
    """Whether ``position`` can resume: every shard begun and not ended has a state (a
    dataset keeping none replays its epoch from its start)."""
    if position is None:
        return False
    return all(
        shard["ended"] or shard["state"] is not None or not shard["batches"]
        for shard in position["shards"]
    )


def shards_at(
    current: object, handed: int, between: Position | None, sync: bool
) -> Position | None:
    """What a loader's state holds of an iterable dataset's shards: in the epoch being
    iterated (``current``), their position at the consumer's ``handed``-th batch (``sync``:
    the consumer is behind the epoch, by its handoff); between epochs, ``between`` (the
    states their datasets ended in). None where they keep no state (the epoch replays)."""
    from .local import LocalEpoch

    position: Position | None = between
    if isinstance(current, StreamEpoch):
        position = current.position_at(handed) if sync else None
        position = current.position() if position is None else position
    elif isinstance(current, LocalEpoch) and current.batches is None:
        position = current.position()
    return position if resumable(position) else None


def checked_shards(shards: object, n: int) -> Position | None:
    """A state dict's ``shards`` (None where absent), or ValueError naming what is wrong."""
    if shards is None:
        return None
    bad = "DataLoader state: 'shards' must be {'turn': int, 'shards': [...]}"
    if not isinstance(shards, dict) or not isinstance(shards.get("shards"), list):
        raise ValueError(bad)
    if len(shards["shards"]) != n:
        raise ValueError(
            f"DataLoader state: 'shards' holds {len(shards['shards'])} shards of an iterable "
            f"dataset, this loader runs {n} (an iterable dataset is split by worker: resume "
            "it with the same num_workers)"
        )
    for shard in shards["shards"]:
        if not isinstance(shard, dict) or {"batches", "state", "ended"} - shard.keys():
            raise ValueError(bad)
    return shards


def _shards(resume: Position | None, n: int) -> list[dict[str, Any]]:
    """Each shard's start: from ``resume``, or its first batch with no state."""
    if resume is None:
        return [{"batches": 0, "state": None, "ended": False} for _ in range(n)]
    return [dict(shard) for shard in resume["shards"]]


class StreamEpoch:
    """The async iterator of one epoch of an iterable-style dataset. ``resume``: where
    each shard resumes (:meth:`position`'s form, from a state dict), or the states its
    datasets ended the last epoch in, which their next epoch starts from."""

    def __init__(self, loader: Owner, epoch: int, resume: Position | None = None) -> None:
        self.loader = loader
        self.epoch = epoch
        n = loader.num_workers
        self.queue = Queue(maxsize=loader.prefetch_factor * n)
        shards = _shards(resume, n)
        self.first = [shard["batches"] for shard in shards]  # batches before the resume
        self.received = list(self.first)  # items of each shard taken off the queue
        #: shard -> its number of items (batches, an error); a shard resumed ended has none
        self.ends: dict[int, int] = {s: self.first[s] for s in range(n) if shards[s]["ended"]}
        self.ready: dict[tuple[int, int], tuple[bool, Any, Any]] = {}
        self.next_j = list(self.first)  # the next batch of each shard to hand out
        self.turn = 0 if resume is None else int(resume.get("turn", 0)) % n
        self.handed_count = sum(self.first)  # the epoch's items handed out, resumed ones too
        self.done = False
        self.failures: dict[int, BaseException] = {}
        self.scopes = [anyio.CancelScope() for _ in range(n)]
        #: Each shard's state after its batches handed out (None: its dataset keeps none),
        #: and after its end.
        self.states: list[Any] = [shard["state"] for shard in shards]
        self.end_states: dict[int, Any] = {}
        #: The positions after the last batches handed out, by count: the sync face's
        #: consumer is up to its handoff's capacity behind this epoch.
        self.history: deque[tuple[int, Position]] = deque(maxlen=4 * n + 16)
        #: Counts the batches handed out where this epoch is the consumer's iterator
        #: (``async for``; the sync face counts its own).
        self.watch: _options.LengthWatch | None = None
        for shard in range(n):
            if shard not in self.ends:
                loader.host_tg().start_soon(self._run, shard, self.states[shard])

    def __aiter__(self) -> StreamEpoch:
        return self

    async def _run(self, shard: int, state: Any) -> None:
        loader = self.loader
        loader.in_flight += 1
        size = loader.batch_size or 1  # None (no batching): each sample alone
        start = (shard, self.first[shard], state)
        args = (self.epoch, loader.seed, size, loader.drop_last, self.queue, start)
        try:
            with self.scopes[shard]:
                for tries in range(loader.max_retries + 1):
                    try:  # replay the shard, putting what the consumer has not received
                        await loader.pool.apply(_worker.stream, (*args, self.received[shard]))
                        break
                    except BrokenWorkerError as exc:
                        if tries == loader.max_retries:
                            self.failures[shard] = broken(exc, self.handed_count, None, tries)
        except BaseException as exc:
            if is_cancellation(exc):
                raise
            exc.add_note(f"aiomp.DataLoader: in worker {shard}'s share of the iterable dataset")
            self.failures[shard] = exc
        finally:
            loader.fetched()
        if shard in self.failures:
            try:  # behind the shard's batches already queued (FIFO), so it comes after them
                await self.queue.put((shard, ShardMark.FAILED, None, None))
            except QueueClosed:
                pass

    async def __anext__(self) -> Any:
        """The next batch, or a shard's failure (raised). Cancellation leaves it as it was."""
        while True:
            got = self._take()
            if got is not None:
                break
            if len(self.ends) == self.loader.num_workers and not self.ready:
                self.close()
                self.loader.finished(self)
                raise StopAsyncIteration
            await receive(self._receive)
        self.handed_count += 1
        self.history.append((self.handed_count, self.position()))
        ok, value = got
        if not ok:
            raise _options.user_error(value)
        if self.watch is not None:
            self.watch.step()
        return self.loader.pinned(value)

    async def _receive(self) -> None:
        timeout = self.loader.timeout
        try:
            with anyio.fail_after(timeout):
                shard, j, batch, state = await self.queue.get()
        except TimeoutError as exc:
            self.close()
            assert timeout is not None
            raise _options.timed_out(timeout, exc) from exc
        if shard in self.ends:
            return  # a replayed shard's second end
        if j is ShardMark.END:
            self.ends[shard] = self.received[shard]
            self.end_states[shard] = state
        elif j is ShardMark.FAILED:
            failure = self.failures.pop(shard)
            self.ready[shard, self.received[shard]] = (False, failure, self.states[shard])
            self.ends[shard] = self.received[shard] + 1
            self.end_states[shard] = self.states[shard]
        elif j == self.received[shard]:
            self.ready[shard, j] = (True, batch, state)
            self.received[shard] += 1
        # else: a batch the dead worker put, put again by its replay: dropped

    def _take(self) -> tuple[bool, Any] | None:
        n = self.loader.num_workers
        if not self.loader.in_order:
            if not self.ready:
                return None
            key = next(iter(self.ready))
        else:
            for _ in range(n):  # round-robin, skipping the shards that have ended
                s = self.turn
                if self.ends.get(s, -1) == self.next_j[s]:
                    self.turn = (s + 1) % n
                    continue
                key = (s, self.next_j[s])
                if key not in self.ready:
                    return None
                self.turn = (s + 1) % n
                break
            else:
                return None
        ok, value, state = self.ready.pop(key)
        self.next_j[key[0]] += 1
        self.states[key[0]] = state
        return ok, value

    def position(self) -> Position:
        """Where each shard is (its batches handed out, its dataset's state after them,
        whether it has ended) and whose turn is next: what a resume starts from."""
        shards = []
        for s, j in enumerate(self.next_j):
            ended = self.ends.get(s, -1) == j
            state = self.end_states.get(s) if ended else self.states[s]
            shards.append({"batches": j, "state": state, "ended": ended})
        return {"turn": self.turn, "shards": shards}

    def position_at(self, handed: int) -> Position | None:
        """:meth:`position` when ``handed`` batches had been handed out (None: too far
        back, or before the first)."""
        for count, position in reversed(self.history):
            if count == handed:
                return position
        return None

    def carried(self) -> Position | None:
        """At the epoch's end: the states its shards' datasets ended in, which the next
        epoch's shards start from (as torch's persistent workers keep their datasets);
        None where the dataset keeps no state."""
        states = [self.end_states.get(s) for s in range(self.loader.num_workers)]
        if all(state is None for state in states):
            return None
        return {"turn": 0, "shards": [{"batches": 0, "state": st, "ended": False} for st in states]}

    def close(self) -> None:
        """Leave the epoch: shards stop at their next put; a hung one is cancelled."""
        if self.done:
            return
        self.done = True
        self.queue.close()
        self.ready.clear()
        for scope in self.scopes:
            scope.cancel()
