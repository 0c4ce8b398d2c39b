"""Shared memory for arrays: the sharing strategy, segments and their header page, this
process's registry of segments and blocks, the segment pool, a block's wire form, the
janitor of ``/dev/shm`` names, kernel-kept leases and the reserve fd for the fd limit."""
