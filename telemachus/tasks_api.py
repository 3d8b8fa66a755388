"""Django's tasks API, from wherever this Django has it: the one place that knows.

Django 6.0 ships it as `django.tasks`; on Django 5.2 the `django-tasks` package provides the same
API as `django_tasks` (the backport it grew from). The names below are Django 6.0's; the package
spells one differently (`InvalidTaskError` for `InvalidTask`). Everything else in the project
imports the API from here, so moving to Django 6 changes this module, not the code that uses it.
"""

try:
    from django.tasks import (
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued
except ImportError:  # Django 5.2
    from django_tasks import (  # type: ignore[no-redef, assignment]
        DEFAULT_TASK_QUEUE_NAME,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task,
        task_backends,
    )
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef, assignment]
    from django_tasks.base import Task, TaskError  # type: ignore[no-redef, assignment]
    from django_tasks.exceptions import InvalidTaskError as InvalidTask  # type: ignore[no-redef, assignment]
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch  # type: ignore[no-redef, assignment]
    from django_tasks.signals import task_enqueued  # type: ignore[no-redef, assignment]

__all__ = [
    "DEFAULT_TASK_QUEUE_NAME",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "task",
    "task_backends",
    "task_enqueued",
]
