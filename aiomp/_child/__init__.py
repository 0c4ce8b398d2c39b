"""_child."""
