"""_cuda."""
