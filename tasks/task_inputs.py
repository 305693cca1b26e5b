"""Task runs whose every input says something in the Prefect UI.

Prefect records a task run's inputs as links only, and a constant argument as an empty list; a
:class:`RecordedTask` records each such argument as Prefect's own ``constant`` input whose ``type`` names it
(:func:`describe`: ``"int 12"``, ``"TensorDict of 128"``). Only the first task run taking a result of the start-up
(``load_data``, ``start_workers``) links to it; later ones record a constant naming its origin, so the run graph
holds O(steps) edges. Calls and submissions go through Prefect's own engine. Details: docs/ui.md.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any
from uuid import UUID

from prefect import Task
from prefect.client.schemas.objects import Constant
from prefect.context import FlowRunContext
from prefect.states import State
from prefect.task_engine import run_task
from prefect.utilities.annotations import quote
from prefect.utilities.callables import get_call_parameters
from prefect.utilities.engine import collect_task_run_inputs_sync, get_state_for_result
from tensordict import TensorDict

SCALARS = (bool, int, float, str, type(None))
LONGEST_SHOWN_TEXT = 40
"""A string argument longer than this is shown by its length, not its text."""
STARTUP_TASKS = frozenset({"load_data", "start_workers"})
"""The start-up's tasks (tasks/startup.py): what they return is an input of every stage of every step."""
STARTUP_RUNS: dict[UUID, str] = {}
"""The start-up task runs of this process, by id: their task's name (two entries a flow run)."""
LINKED_STARTUP_RUNS: set[UUID] = set()
"""The start-up task runs that a task run already links to."""


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


def recorded_inputs(parameters: dict[str, Any]) -> tuple[dict[str, Any], dict[str, set[Constant]]]:
    """The parameters to call the task with and the ``constant`` inputs to record beside Prefect's links: one
    for each parameter that links to no task run, and one naming the origin of each that links only to
    start-up task runs already linked to, a parameter then passed ``quote``-d so that Prefect does not link
    it (its engine unwraps it before the call)."""
    called, constants = dict(parameters), {}
    linked_before = set(LINKED_STARTUP_RUNS)
    for name, value in parameters.items():
        links = {link.id for link in collect_task_run_inputs_sync(value)}
        origins = {STARTUP_RUNS.get(link) for link in links}
        if not links:
            constants[name] = {Constant(type=describe(value))}
        elif None not in origins and links <= linked_before:
            constants[name] = {Constant(type=f"{describe(value)} from {' and '.join(sorted(origins))}")}
            called[name] = quote(value)
        elif None not in origins:
            LINKED_STARTUP_RUNS.update(links)
    return called, constants


def task_run_of(returned: Any) -> UUID | None:
    """The task run that returned ``returned`` (a result, or its state) in this flow run, if any."""
    produced = returned if isinstance(returned, State) else (get_state_for_result(returned) or (None,))[0]
    return produced.state_details.task_run_id if produced is not None else None


class RecordedTask(Task):
    """A Prefect task whose runs record their constant arguments (:func:`recorded_inputs`)."""

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        parameters, constants = recorded_inputs(get_call_parameters(self.fn, args, kwargs))
        returned = run_task(
            task=self,
            parameters=parameters,
            wait_for=wait_for,
            return_type="state" if return_state else "result",
            dependencies=constants,
        )
        if self.name in STARTUP_TASKS and (task_run_id := task_run_of(returned)) is not None:
            STARTUP_RUNS[task_run_id] = self.name
        return returned

    def submit(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        context = FlowRunContext.get()
        if context is None:
            raise RuntimeError(f"task {self.name} can only be submitted inside a flow run")
        parameters, constants = recorded_inputs(get_call_parameters(self.fn, args, kwargs))
        future = context.task_runner.submit(self, parameters, wait_for, dependencies=constants)
        if self.name in STARTUP_TASKS:
            STARTUP_RUNS[future.task_run_id] = self.name
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
