"""What every config section shares: the strict base class, seeds, Ray resource amounts, and the names
that become one component of a path.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """Base of every config section: strict types, unknown keys rejected, immutable once built, and no
    float may be inf or nan (YAML's ``.inf``/``.nan`` would otherwise pass every range check)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


SEED_MAX = 2**32 - 1


Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
"""A random seed: numpy seeds only from [0, 2**32 - 1] (vLLM seeds numpy with ``rollout.seed``), and every
seed of a run takes that one range."""


RAY_RESOURCE_UNIT = 1e-4
"""The smallest non-zero amount of a resource Ray reserves (its fractional precision)."""


def _ray_amount_problem(amount: float) -> str | None:
    """Why Ray would refuse ``amount`` of a resource when the actor is created, or None."""
    if amount < 0:
        return "must be >= 0"
    if 0 < amount < RAY_RESOURCE_UNIT:
        return f"must be 0 or at least {RAY_RESOURCE_UNIT:g} (Ray's resource precision)"
    return None


class ResourcesConfig(Section):
    """What one Ray actor of a role reserves, and how many torch threads it uses. Ray refuses an amount only
    when the actor is created; the config refuses it first."""

    num_cpus: float = Field(
        ge=0, description=f"Ray CPUs reserved by the role's actor: 0 or at least {RAY_RESOURCE_UNIT:g}."
    )
    num_gpus: float = Field(
        ge=0, description=f"Ray GPUs reserved by the role's actor: 0 or at least {RAY_RESOURCE_UNIT:g}."
    )
    num_threads: int = Field(ge=1, description="torch.set_num_threads inside the actor.")
    custom: dict[str, float] = Field(
        description="Ray custom resources each actor of the role reserves (e.g. {trainer_node: 1} to pin the role to "
        f"nodes started with `ray start --resources`); each amount 0 or at least {RAY_RESOURCE_UNIT:g}."
    )

    @field_validator("num_cpus", "num_gpus")
    @classmethod
    def _ray_precision(cls, amount: float) -> float:
        if (problem := _ray_amount_problem(amount)) is not None:
            raise PydanticCustomError("ray_resource_amount", problem)
        return amount

    @field_validator("custom")
    @classmethod
    def _custom_amounts(cls, custom: dict[str, float]) -> dict[str, float]:
        for amount in custom.values():
            if (problem := _ray_amount_problem(amount)) is not None:
                raise PydanticCustomError("ray_resource_amount", f"each amount {problem}")
        return custom


PATH_NAME_PATTERN = r"^[A-Za-z0-9_](?:[A-Za-z0-9._+=@, -]{0,98}[A-Za-z0-9._+=@,-])?$"
"""A name that becomes one component of a path (run and cache directories): no ``/``, ``\\``, ``.``, ``..``,
control characters or leading ``-``, so no name can point outside the directory it is joined to."""


PATH_NAME_RULE = (
    "1 to 100 ASCII letters, digits, spaces and . _ - + = @ , starting with a letter, digit or _ and "
    "not ending in a space"
)


PathName = Annotated[str, Field(pattern=PATH_NAME_PATTERN)]
