"""``aiomp.DataLoader``: torch's DataLoader over an :class:`aiomp.Pool`.

- ``loader``: the DataLoader itself (torch's arguments, ``async with``, epochs, resume);
- ``options``: torch's arguments checked as torch checks them, and the resume state's;
- ``syncface``: ``with loader:`` and ``for batch in loader`` with no event loop;
- ``handoff``: the sync face's channel from the private loop's thread, and its exit hook;
- ``epoch``: one map-style epoch's batches in flight (prefetch bound, order, resume), and
  what every epoch reads of its loader (``Owner``, so that no module imports the loader's);
- ``feeds``: the transport of a map-style epoch (one feed task per worker slot), its one
  retry rule and its ``timeout=`` deadline;
- ``streams``: one epoch of an iterable-style dataset (one task per shard);
- ``local``: ``num_workers=0``, batches built in the calling process;
- ``sampling``: which samples make each batch, per-batch seeds, the built-in samplers;
- ``collate``: the default collate, straight into shared memory (runs in the workers);
- ``worker``: what a loader's worker runs (its initializer and its batch tasks).

Imports run one way: ``loader`` over ``syncface`` over ``handoff``; the epochs
(``streams``, ``local``, ``epoch``) over ``feeds``, then ``worker``, ``sampling`` and
``collate``. An epoch gets its loader as an ``Owner`` when it is made.
"""
