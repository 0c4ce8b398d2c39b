"""The parent's side of children's output: a Forwarder per child reads its stdout, stderr
and logging records on the event loop (``forwarder``) and turns them into labelled lines
or a callback's (``lines``). The child's side is ``aiomp._child.output``."""
