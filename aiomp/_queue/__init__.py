"""Cross-process Queue and Event: ``queue`` (Queue) and ``sync`` (its blocking side),
``overflow`` (the log behind a full socket) with its robust ``mutex``, ``items`` (how an
item is pickled and rebuilt) and ``event`` (Event, SyncEvent). Child-side."""
