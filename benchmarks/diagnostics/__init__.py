"""Diagnostics: scripts that explain a figure rather than compare against a baseline.

Public API only; none of them writes RESULTS.md. One line each: benchmarks/README.md.
"""
