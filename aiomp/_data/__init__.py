"""``aiomp.DataLoader``: torch's DataLoader over an :class:`aiomp.Pool`.

- ``loader``: the DataLoader itself (options, ``async with``, epochs, the sync face);
- ``epoch``: one epoch's batches in flight (prefetch bound, order, retries, faults);
- ``sampling``: which samples make each batch, per-batch seeds, resume state;
- ``collate``: the default collate, straight into shared memory (runs in the workers);
- ``worker``: what a loader's worker runs (its initializer and its batch tasks).
"""
