"""First contact: ``aiomp.run_sync``, a default pool per event loop (DESIGN, First contact)."""
