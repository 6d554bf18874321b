"""What a worker process imports to run the project's tasks, in a module that
imports nothing itself: the fork server of pipeline/fork_server.py reads it before
this process has imported torch, and tasks/memory.py's bare-process baseline imports
the same."""

from __future__ import annotations

#: distributed, and the task modules (torch, numpy, zarr; not xarray or pandas).
WORKER_MODULES = ("distributed", "tasks.step_task")
