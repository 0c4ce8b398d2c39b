"""CUDA IPC for CuPy arrays behind a driver seam: extents and wire metadata, lease slots,
the libcuda/CuPy backend, IPC-safe blocks, this process's IPC state, the producer and
consumer sides, and the reducer's registration with the public settings."""
