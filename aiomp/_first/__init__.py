"""First contact: ``aiomp.run_sync``, a default pool per event loop (docs/design.md,
"First contact")."""
