"""The shipped tasks, by name. A task is a package here: description, reference, baseline
source, input generators (visible and held-out shapes), tolerances, device, timing mode,
roofline costs and a variant space for the search proposer."""

from __future__ import annotations

from wanka.lab.task import LabError, Task


def all_tasks() -> dict[str, Task]:
    from wanka.lab.tasks import (
        dense_attention,
        lightning_indexer,
        moe_dispatch,
        rmsnorm,
        rope,
        sparse_attention,
    )

    tasks: list[Task] = [*sparse_attention.TASKS, *lightning_indexer.TASKS,
                         *dense_attention.TASKS, *rmsnorm.TASKS, *rope.TASKS, *moe_dispatch.TASKS]  # fmt: skip
    return {t.name: t for t in tasks}


def get_task(name: str) -> Task:
    tasks = all_tasks()
    if name not in tasks:
        raise LabError(f"unknown task {name!r}; have: {', '.join(sorted(tasks))}")
    return tasks[name]
