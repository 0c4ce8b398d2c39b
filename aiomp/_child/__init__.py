"""What every child aiomp starts runs before the user's code: the bootstrap, its output
onto the parent's sockets, the one error report for spawn and the Pool, and the runner of
async functions. Standard library and other child-side modules only."""
