"""_spawn."""
