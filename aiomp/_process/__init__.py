"""One child process, start to reap, for spawn and the Pool: checks before a start,
launch, Child (pidfd, exit, signals, reaping), terminate_all, the process-group keeper,
and the private multiprocessing names all of it relies on (``mp_private``)."""
