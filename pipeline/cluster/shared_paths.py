"""Whether a cluster's workers see the run's folders where this process does, and
run the same code of this project (`check_workers_code`, tasks/code_identity.py).

The client hands its workers absolute paths (pipeline/config/run_config.py): the dataset store,
which they read, and the output directory, where they write their rows of every
checkpoint. Workers on another host without a shared disk, or in another mount
namespace, may not have them; without this check the first sign was a worker's
FileNotFoundError deep in a step, or a checkpoint only some workers wrote. So once
per run on a cluster the user started, each of the run's workers is asked whether it
sees a file this process has just made in the output directory (the same folder,
not one of the same name) and the dataset store (the same path: an identical copy
on each host is fine, docs/multihost.md).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator

from distributed import Client

from pipeline.cluster.workers import ClusterError, ClusterWorker, live_workers
from tasks.code_identity import code_identity

#: Seconds the workers have to answer (each looks up two paths).
ANSWER_S = 30.0


@contextlib.contextmanager
def marker_in(folder: str) -> Iterator[str]:
    """A file of this process's own in `folder`, removed on the way out."""
    path = os.path.join(folder, f".hetcnn-seen-{uuid.uuid4().hex[:12]}")
    with open(path, "x", encoding="utf-8"):
        pass
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def first_unseen(seen: dict[str, dict[str, object]], workers: list[ClusterWorker],
                 shown: dict[str, str]) -> str | None:
    """One line for the first worker (in the run's order) that does not see a folder:
    `seen` holds, per folder (its name in the line: "dataset store"), each worker
    address's answer (True: seen), `shown` each folder's path; None when every worker
    sees every folder."""
    for worker in workers:
        for what, path in shown.items():
            answer = seen[what].get(worker.address)
            if answer is None or isinstance(answer, OSError):  # no word on the folder
                return (f"worker {worker.name} ({worker.address}) did not answer whether it "
                        f"sees the run's {what} {path} ({type(answer).__name__}: {answer})")
            if answer is not True:
                return (f"worker {worker.name} ({worker.address}) does not see the run's "
                        f"{what} {path}: every worker needs the dataset store and the "
                        "output directory at the same path as this process (a shared "
                        "disk, or the dataset copied to that path; docs/multihost.md)")
    return None


def check_workers_see(client: Client, workers: list[ClusterWorker], dataset: str,
                      output_dir: str) -> None:
    """Raise ClusterError naming the first of `workers` that does not see the dataset
    store `dataset` or the output directory `output_dir` (module doc). Workers that
    left the cluster, before or while they are asked, are passed over (`still_listed`,
    `left_meanwhile`)."""
    workers = still_listed(client, workers)
    if not workers:
        return
    addresses = [w.address for w in workers]
    with marker_in(output_dir) as marker:
        looked_up = {"dataset store": dataset, "output directory": marker}
        try:
            seen = {what: client.run(os.path.exists, path, workers=addresses,
                                     on_error="return", callback_timeout=ANSWER_S)
                    for what, path in looked_up.items()}
        except TimeoutError:
            raise ClusterError(f"the run's workers did not say within {ANSWER_S:g} s whether "
                               f"they see the dataset store {dataset} and the output "
                               f"directory {output_dir}") from None
    gone = left_meanwhile(client, workers, *seen.values())
    line = first_unseen(seen, [w for w in workers if w.address not in gone],
                        {"dataset store": dataset, "output directory": output_dir})
    if line is not None:
        raise ClusterError(line)


def other_code(client: Client, workers: list[ClusterWorker]) -> dict[str, str]:
    """Each of `workers` (by address) that runs other code of this project than this
    process, with why: another copy, or the files as they were before they changed (a
    process keeps what it imported; tasks/code_identity.py). ClusterError where one
    could not be asked in time, or not reached (`unreached_for_code`): it did not say."""
    root, digest = code_identity()
    workers = still_listed(client, workers)
    try:
        answers = client.run(code_identity, workers=[w.address for w in workers],
                             on_error="return", callback_timeout=ANSWER_S)
    except TimeoutError:
        raise ClusterError(f"the run's workers did not say within {ANSWER_S:g} s which code "
                           "of this project they run") from None
    gone = left_meanwhile(client, workers, answers)
    workers = [w for w in workers if w.address not in gone]
    unreached = unreached_for_code(answers, workers)
    if unreached:
        raise ClusterError("; ".join(f"worker {worker.name} ({worker.address}) could not be "
                                     f"reached: {unreached[worker.address]}"
                                     for worker in workers if worker.address in unreached))
    other = {}
    for worker in workers:
        answer = answers.get(worker.address)
        if isinstance(answer, (tuple, list)) and answer[1] == digest:
            continue
        if not isinstance(answer, (tuple, list)):
            other[worker.address] = (f"could not say which code it runs "
                                     f"({type(answer).__name__}: {answer})")
        elif answer[0] == root:
            other[worker.address] = (
                f"runs other code than this run: the project's files at {root} changed "
                "since it or this process imported them (a process keeps the code it "
                "imported)")
        else:
            other[worker.address] = (f"runs other code than this run: the project at "
                                     f"{answer[0]}, this run's at {root}")
    return other


def still_listed(client: Client, workers: list[ClusterWorker]) -> list[ClusterWorker]:
    """Those of `workers` the scheduler still lists. Asked of one it no longer knows,
    it tries to connect for 30 s (Dask's connect timeout), and the run failed saying
    its workers did not answer whether they see its folders."""
    listed = live_workers(client)
    return [w for w in workers if w.address in listed]


def left_meanwhile(client: Client, workers: list[ClusterWorker],
                   *answers: dict[str, object]) -> set[str]:
    """Those of `workers` (by address) that gave no answer in one of `answers` (no
    reply, or a closed comm) and that the scheduler no longer lists: they left the
    cluster while they were asked (a job's walltime, a `scancel`). They are not
    blamed for the folders or the code; the placement after finds them gone, as
    every lost worker (pipeline/run.py, `_placed_surviving`): the work goes to the
    others, or the run stops with the lost-worker line if none is left."""
    silent = {w.address for w in workers for answered in answers
              if answered.get(w.address) is None or isinstance(answered.get(w.address), OSError)}
    return silent - set(live_workers(client)) if silent else set()


def unreached_for_code(answers: dict[str, object], workers: list[ClusterWorker]
                       ) -> dict[str, str]:
    """Those of `workers` (by address, with the error) whose answer in `answers` (a
    `client.run(..., on_error="return")`'s) is no answer: the scheduler could not reach
    it (a refused or dropped connection, a connect timeout: an OSError) or it has
    none. Such a worker said nothing about its code, as one too slow to answer, and is
    asked again; an error it raised itself (it cannot import this project) is its
    answer."""
    unreached = {}
    for worker in workers:
        answer = answers.get(worker.address)
        if answer is None or isinstance(answer, OSError):
            unreached[worker.address] = (f"{type(answer).__name__}: {answer}"
                                         if answer is not None else "no answer")
    return unreached


def check_workers_code(client: Client, workers: list[ClusterWorker]) -> None:
    """Raise ClusterError naming the first of `workers` that runs other code of this
    project than this process (`other_code`)."""
    other = other_code(client, workers)
    for worker in workers:
        if worker.address in other:
            raise ClusterError(f"worker {worker.name} ({worker.address}) "
                               f"{other[worker.address]}; start the workers again on this "
                               "run's code (installed in their Python, or PYTHONPATH), and "
                               "this run again if it is the older")
