"""Side-by-side benchmarks of aiomp against its baselines. Never imported by tests.

Run ``python -m benchmarks.run [names...]``; see ``benchmarks/README.md``.
"""
