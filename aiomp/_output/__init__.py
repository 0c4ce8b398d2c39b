"""_output."""
