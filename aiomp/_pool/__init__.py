"""``aiomp.Pool``: the façade (pool), its engine and calls, the pure scheduler, the
worker-kind seam (kinds) with its process kind and handle, and the process wire
(protocol, worker_main: child modules)."""
