"""Running a strategy's steps on the workers: the step engine, its task runner, the step graph, steps per task, checkpoints, batch sampling."""
