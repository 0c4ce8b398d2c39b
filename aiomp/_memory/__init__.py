"""_memory."""
