"""The run's roles as tasks and flows call them: typed protocols, their Ray and in-process implementations, and
:class:`Workers`, the roles plus the object store.

``workers.actor.compute_log_prob(batch)`` returns the worker's reply; a ``start_*`` method returns a reference
instead, for calls that run together, fetched with :meth:`Workers.get` (in process the reference is the reply).
A batch several roles read is placed once with :meth:`Workers.put`. :mod:`ppoflow.workers.launcher` starts the
roles: a Ray actor per role, one per data-parallel rank for a training role, or objects in this process.
Details: docs/architecture.md#workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ppoflow.workers.memory import MemoryReports, largest, memory_metrics

if TYPE_CHECKING:
    from tensordict import TensorDict

    from ppoflow.storage.batch import StageResult
    from ppoflow.workers.profiler import ProfileSettings
    from ppoflow.workers.rollout.sampling import SamplingParams


class MemoryRole(Protocol):
    """What every role reports of its memory (:mod:`ppoflow.workers.memory`)."""

    def memory_stats(self) -> dict[str, float]:
        """The peaks of the role's processes since they last reported (the largest over ranks or replicas)."""

    def start_memory_stats(self) -> list:
        """References to each of the role's processes reporting (a rank, a replica): many roles at once."""


class ActorRole(MemoryRole, Protocol):
    """The trained policy (:class:`~ppoflow.workers.training.policy.ActorWorker`)."""

    def compute_log_prob(self, batch: TensorDict, *, at_step_start: bool = False) -> TensorDict: ...
    def update(self, batch: TensorDict, *, step: int) -> StageResult: ...
    def weights_digest(self) -> str | None: ...
    def skip_update(self) -> None: ...
    def snapshot_weights(self) -> None: ...
    def save_pretrained(self, url: str) -> None: ...
    def save_checkpoint(self, directory: str) -> dict[str, dict]: ...
    def load_checkpoint(self, directory: str, entries: dict[str, dict], *, weight_version: int) -> None: ...
    def start_prepare_weights(self, *, again: bool = False, version: int | None = None) -> Any:
        """A reference to the weight update the actor publishes (its buckets stay on the actor's side)."""

    def start_broadcast_weights(self, update: Any) -> Any:
        """A reference to the actor's side of a collective weight broadcast (the rollout takes part too)."""


class ReferenceRole(MemoryRole, Protocol):
    """The frozen initial policy (:class:`~ppoflow.workers.training.policy.ReferenceWorker`; with LoRA the actor's
    base model, :class:`ActorBaseRole`)."""

    def compute_log_prob(self, batch: TensorDict) -> TensorDict | None: ...
    def weights_digest(self) -> str | None: ...


class CriticRole(MemoryRole, Protocol):
    """The value model (:class:`~ppoflow.workers.training.critic.CriticWorker`)."""

    def compute_values(self, batch: TensorDict) -> TensorDict | None: ...
    def update(self, batch: TensorDict, *, step: int) -> dict[str, float] | None: ...
    def weights_digest(self) -> str | None: ...
    def save_checkpoint(self, directory: str) -> dict[str, dict]: ...
    def load_checkpoint(self, directory: str, entries: dict[str, dict]) -> None: ...


class RewardModelRole(MemoryRole, Protocol):
    """The reward model (:class:`~ppoflow.workers.reward_model.RewardModelWorker`)."""

    def score(self, samples: list) -> tuple[list[float], dict[str, list[float]]]: ...
    def weights_digest(self) -> str | None: ...


class RolloutRole(MemoryRole, Protocol):
    """Generation: a rollout worker (:mod:`ppoflow.workers.rollout`), the colocated actor, or the rollout
    service (:class:`~ppoflow.workers.service.rollout_service.RolloutService`)."""

    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict: ...
    def start_apply_weights(self, update: Any) -> Any:
        """A reference to the rollout taking ``update`` (a weight update or a reference to one)."""


class Role:
    """One role's worker(s), called by method name; each typed method calls the worker method of its name (the
    protocols above say which role has which)."""

    def _submit(self, method: str, *args, **kwargs) -> Any:
        """A reference to the reply of the worker's ``method`` (in process: the reply itself)."""
        raise NotImplementedError

    def _fetch(self, reference: Any) -> Any:
        """The reply behind a reference :meth:`_submit` returned."""
        raise NotImplementedError

    def _call(self, method: str, *args, **kwargs) -> Any:
        return self._fetch(self._submit(method, *args, **kwargs))

    def compute_log_prob(self, batch, **options):
        return self._call("compute_log_prob", batch, **options)

    def compute_values(self, batch):
        return self._call("compute_values", batch)

    def score(self, samples: list):
        return self._call("score", samples)

    def update(self, batch, *, step: int):
        return self._call("update", batch, step=step)

    def weights_digest(self):
        return self._call("weights_digest")

    def skip_update(self) -> None:
        return self._call("skip_update")

    def snapshot_weights(self) -> None:
        return self._call("snapshot_weights")

    def save_pretrained(self, url: str) -> None:
        return self._call("save_pretrained", url)

    def save_checkpoint(self, directory: str):
        return self._call("save_checkpoint", directory)

    def load_checkpoint(self, directory: str, entries: dict[str, dict], **options) -> None:
        return self._call("load_checkpoint", directory, entries, **options)

    def generate(self, prompts, *, step: int, sampling):
        return self._call("generate", prompts, step=step, sampling=sampling)

    def start_prepare_weights(self, *, again: bool = False, version: int | None = None):
        return self._submit("prepare_weights", again=again, version=version)

    def start_broadcast_weights(self, update):
        return self._submit("broadcast_weights", update)

    def start_apply_weights(self, update):
        return self._submit("apply_weights", update)

    def start_each(self, method: str, *args) -> list:
        """References to the replies of each of the role's processes (a rank) to ``method``."""
        return [self._submit(method, *args)]

    def start_memory_stats(self) -> list:
        return self.start_each("memory_stats")

    def memory_stats(self) -> dict[str, float]:
        return largest([self._fetch(reference) for reference in self.start_memory_stats()])


class ActorBaseRole(Role):
    """The reference when it is the actor's base model (``ref_in_actor``: LoRA): no worker of its own, the actor's
    worker(s) with the adapter disabled for the pass, called through the actor's role."""

    _METHODS = {"compute_log_prob": "compute_ref_log_prob", "weights_digest": "ref_weights_digest"}
    """The reference's methods and the actor worker's methods that serve them."""

    def __init__(self, actor: Role):
        self.actor = actor

    def _submit(self, method: str, *args, **kwargs):
        return self.actor._submit(self._METHODS[method], *args, **kwargs)

    def _fetch(self, reference):
        return self.actor._fetch(reference)

    def start_memory_stats(self) -> list:
        """Nothing to ask: its memory is the actor's processes', reported as the actor's."""
        return []


class RayObjects:
    """Ray's object store as the run uses it. :meth:`get` watches the replies of the training roles' ranks other
    than 0 (:attr:`siblings`): when one fails, its error is raised at once rather than leave rank 0 waiting in a
    collective for it."""

    def __init__(self):
        self.siblings: list = []
        """Replies of ranks other than 0 not yet seen finished."""

    def put(self, value):
        import ray

        return ray.put(value)

    def get(self, reference):
        import ray

        self._raise_rank_failures(reference)
        return ray.get(reference)

    def _raise_rank_failures(self, reference) -> None:
        import ray

        siblings = set(self.siblings)
        if not siblings:
            return
        wanted = set(reference) if isinstance(reference, list) else {reference}
        pending = [*wanted, *siblings]
        while wanted.intersection(pending):
            ready, pending = ray.wait(pending, num_returns=1, fetch_local=False)
            for finished in set(ready) & siblings:
                if finished in self.siblings:
                    self.siblings.remove(finished)
                ray.get(finished)  # raises the rank's error

    def ready(self, references: list, timeout_s: float) -> list:
        """Those of ``references`` whose values are ready, waiting up to ``timeout_s`` for the first one."""
        import ray

        if not references:
            return []
        ready, _ = ray.wait(references, num_returns=1, timeout=timeout_s)
        if ready:  # then every other one that is ready too, without waiting
            ready, _ = ray.wait(references, num_returns=len(references), timeout=0)
        return ready


class RayRole(Role):
    """A role served by one Ray actor; ``_submit`` returns an ``ObjectRef``."""

    def __init__(self, handle, objects: RayObjects):
        self.handle, self.objects = handle, objects

    def _submit(self, method: str, *args, **kwargs):
        return getattr(self.handle, method).remote(*args, **kwargs)

    def _fetch(self, reference):
        return self.objects.get(reference)


class RayGroupRole(Role):
    """A training role served by one Ray actor per data-parallel rank. Every call goes to every rank (each works
    out its own share of the batch) and rank 0's reply is the role's; the other ranks' replies are watched by
    :meth:`RayObjects.get`, so that a rank that fails fails the call."""

    def __init__(self, handles: list, objects: RayObjects):
        self.handles, self.objects = handles, objects

    def _submit(self, method: str, *args, **kwargs):
        references = [getattr(handle, method).remote(*args, **kwargs) for handle in self.handles]
        self.objects.siblings.extend(references[1:])
        return references[0]

    def _fetch(self, reference):
        return self.objects.get(reference)

    def start_each(self, method: str, *args) -> list:
        """Every rank replies (the memory figures: the role's are the largest of theirs)."""
        return [getattr(handle, method).remote(*args) for handle in self.handles]


class LocalRole(Role):
    """A role served by an object in this process; ``_submit`` runs the call and returns its value."""

    def __init__(self, worker):
        self.worker = worker

    def _submit(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def _fetch(self, reference):
        return reference


@dataclass
class Workers:
    """The run's roles plus how to place and fetch data for them."""

    rollout: RolloutRole
    actor: ActorRole
    ref: ReferenceRole | None = None
    critic: CriticRole | None = None
    reward_model: RewardModelRole | None = None
    colocated: bool = False
    """The rollout role is the actor's worker (``actor_rollout_ref.hybrid_engine``)."""
    streams_reward: bool = False
    """The rollout scores each trajectory as it finishes (the rollout service with in-process scoring)."""
    uses_ray: bool = True
    started_ray: bool = False
    placement: dict = field(default_factory=dict)
    """Role -> the Ray node id of each of its actors (rank order), for the start-up log."""
    objects: RayObjects = field(default_factory=RayObjects)
    _handles: list = field(default_factory=list)
    _placement_groups: list = field(default_factory=list)
    _memory: MemoryReports | None = None

    def roles(self) -> list[str]:
        """The roles served, by name (a colocated rollout is the actor's, so it is named with it)."""
        names = ["actor+rollout"] if self.colocated else ["actor", "rollout"]
        return names + [role for role in ("ref", "critic", "reward_model") if getattr(self, role) is not None]

    def placement_note(self) -> str:
        """Where each role runs, by Ray node id, rank by rank (empty when every actor is on one node and
        no role has several ranks: nothing worth saying)."""
        nodes = {node for ids in self.placement.values() for node in ids}
        if len(nodes) <= 1 and all(len(ids) == 1 for ids in self.placement.values()):
            return ""
        return "; ".join(
            f"{role} on node{'s' if len(ids) > 1 else ''} {', '.join(node[:12] for node in ids)}"
            for role, ids in self.placement.items()
        )

    def memory_metrics(self) -> dict[str, float]:
        """The step's memory figures of every role (:class:`~ppoflow.workers.memory.MemoryReports`), named
        ``perf/<role>/...`` and, for the actor, as verl names them. In process every role is this process: its
        figures are the actor's."""
        if not self.uses_ray:
            return memory_metrics({"actor": self.actor.memory_stats()})
        if self._memory is None:
            roles = {"actor": self.actor, "rollout": None if self.colocated else self.rollout}
            roles.update(ref=self.ref, critic=self.critic, reward_model=self.reward_model)
            served = {name: role for name, role in roles.items() if role is not None}
            self._memory = MemoryReports(served, self.objects.get)
        return self._memory.collect()

    def start_profile(self, step: int, settings: ProfileSettings) -> list:
        """Ask every process of the profiled roles (``settings``: a :class:`~ppoflow.workers.profiler.ProfileSettings`)
        to record ``step``, each process once whichever roles it serves, without waiting: one busy with an earlier
        call (a rollout generating ahead) starts when it is done. The references :meth:`stop_profile` takes."""
        roles = self._processes(settings.roles)
        return [reply for role in roles for reply in role.start_each("start_profile", step, settings)]

    def stop_profile(self, settings: ProfileSettings, started: list) -> list[str]:
        """They stop and write their files: the URLs written."""
        self.get(started)
        replies = self.get(
            [reply for role in self._processes(settings.roles) for reply in role.start_each("stop_profile")]
        )
        return [url for urls in replies for url in urls]

    def _processes(self, names: dict) -> list[Role]:
        """The roles ``names`` as distinct sets of processes: a colocated rollout, or a reference that is the
        actor's base model, is the actor's."""
        chosen: list[Role] = []
        for name in names:
            role = getattr(self, name)
            role = role.actor if isinstance(role, ActorBaseRole) else role
            if role is not None and all(role is not other for other in chosen):
                chosen.append(role)
        return chosen

    def put(self, value):
        """Place ``value`` where every role can read it (Ray's object store, or nowhere in-process)."""
        return self.objects.put(value) if self.uses_ray else value

    def get(self, reference):
        """The value behind a reference returned by a ``start_*`` method or ``put`` (lists fetched together)."""
        return self.objects.get(reference) if self.uses_ray else reference

    def ready(self, references: list, timeout_s: float) -> list:
        """Those of ``references`` whose values are ready, waiting up to ``timeout_s`` for the first one."""
        return self.objects.ready(references, timeout_s)

    def shutdown(self) -> None:
        """Stop the actors, and Ray itself when this run started it."""
        if not self.uses_ray:
            return
        import ray

        for handle in self._handles:
            ray.kill(handle)
        for group in self._placement_groups:
            ray.util.remove_placement_group(group)
        if self.started_ray:
            ray.shutdown()
