"""Task runs whose every input says something in the Prefect UI.

Prefect records a task run's inputs as links only: an argument another task run returned links to that
run, and anything else - a step number, a flag, a config - is recorded as an empty list (Prefect 3.9's
``collect_task_run_inputs`` leaves constants to a TODO), which the UI's Task inputs tab shows as
``"step": []``. A :class:`RecordedTask` records each such argument as Prefect's own ``constant`` input
instead, whose ``type`` field names it compactly (:func:`describe`): ``"int 12"``, ``"TensorDict of 128"``,
``"SamplingParams"``. Arguments that link keep their links only. Everything else about the run is
Prefect's: the call and the submission go through Prefect's own engine and task runner.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import Constant
from prefect.context import FlowRunContext
from prefect.task_engine import run_task
from prefect.utilities.callables import get_call_parameters
from prefect.utilities.engine import collect_task_run_inputs_sync
from tensordict import TensorDict

SCALARS = (bool, int, float, str, type(None))
LONGEST_SHOWN_TEXT = 40
"""A string argument longer than this is shown by its length, not its text."""


def describe(value: Any) -> str:
    """What the UI shows for an argument that links to no task run: a number, flag or short text with its
    value, a batch or a list with its size, anything else by its type."""
    kind = type(value).__name__
    if isinstance(value, str) and len(value) > LONGEST_SHOWN_TEXT:
        return f"str of {len(value)} characters"
    if isinstance(value, SCALARS):
        return f"{kind} {value!r}" if value is not None else "None"
    if isinstance(value, TensorDict):
        return f"TensorDict of {value.batch_size[0]}" if value.batch_dims else "TensorDict"
    if isinstance(value, (list, tuple, dict)):
        return f"{kind} of {len(value)}"
    return kind


def constant_inputs(parameters: dict[str, Any]) -> dict[str, set[Constant]]:
    """A ``constant`` input for each parameter that links to no task run."""
    return {name: {Constant(type=describe(value))} for name, value in parameters.items()
            if not collect_task_run_inputs_sync(value)}


class RecordedTask(Task):
    """A Prefect task whose runs record their constant arguments (:func:`constant_inputs`)."""

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        parameters = get_call_parameters(self.fn, args, kwargs)
        return run_task(task=self, parameters=parameters, wait_for=wait_for,
                        return_type="state" if return_state else "result",
                        dependencies=constant_inputs(parameters))

    def submit(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        context = FlowRunContext.get()
        if context is None:
            raise RuntimeError(f"task {self.name} can only be submitted inside a flow run")
        parameters = get_call_parameters(self.fn, args, kwargs)
        future = context.task_runner.submit(self, parameters, wait_for, dependencies=constant_inputs(parameters))
        if return_state:
            future.wait()
            return future.state
        return future

    def named(self, task_run_name: str, tags: Iterable[str] | None = None) -> RecordedTask:
        """This task with its runs named ``task_run_name`` (and tagged ``tags``): a shallow copy, since
        :meth:`with_options` builds a new task and reads the function's source again, at every stage of
        every step."""
        configured = copy.copy(self)
        configured.task_run_name = task_run_name
        if tags is not None:
            configured.tags = set(tags)
        return configured

    def with_options(self, **options: Any) -> RecordedTask:
        configured = super().with_options(**options)
        configured.__class__ = RecordedTask  # Prefect's with_options always builds a plain Task
        return configured


def recorded_task(**options: Any):
    """``@prefect.task(**options)``, as a :class:`RecordedTask`."""
    return lambda fn: RecordedTask(fn=fn, **options)
