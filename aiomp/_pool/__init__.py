"""_pool."""
