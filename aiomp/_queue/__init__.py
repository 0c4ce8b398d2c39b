"""_queue."""
