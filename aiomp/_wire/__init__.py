"""_wire."""
