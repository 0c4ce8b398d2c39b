"""_arrays."""
