"""_loop."""
