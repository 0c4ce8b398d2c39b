"""aiomp.spawn / start_processes / ProcessContext: start children that run one function,
supervise them, read each one's report, terminate and reap them; and the child's side
(``child_main``). Builds on ``_process`` (one child, start to reap) and ``_child``."""
