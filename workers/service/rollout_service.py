"""The rollout as a service (``actor_rollout_ref.rollout.mode=async``; verl's V1 rollout: LLM server replicas +
AgentLoop workers). :class:`RolloutService` is the rollout role the tasks and the async trainer modes call: it
spreads prompts over the agent-loop workers (:mod:`ppoflow.workers.service.agent_worker`), which run agent loops
against the generation replicas (:mod:`ppoflow.workers.service.replicas`), and pushes new weights to the replicas.
Details: docs/rollout_service.md.
"""

from __future__ import annotations

import logging

from tensordict import TensorDict

from ppoflow.storage.batch import concatenate
from ppoflow.workers.memory import largest, process_memory
from ppoflow.workers.roles import RayObjects
from ppoflow.workers.rollout.sampling import SamplingParams

logger = logging.getLogger("ppoflow.rollout")


class RolloutFailing(RuntimeError):
    """Every prompt group the rollout service generated lately failed; the message gives the last reason."""


class RolloutService:
    """The rollout role of ``rollout.mode=async`` (a :class:`~ppoflow.workers.roles.RolloutRole`): the replicas and
    the agent-loop workers; the judge model's replicas, which take no weights (``judge_replicas``). ``objects``
    fetches replies (the run's, so that it watches the training ranks)."""

    def __init__(
        self,
        replicas: list,
        agents: list,
        *,
        pad_token_id: int,
        objects: RayObjects | None = None,
        judge_replicas: list = (),
    ):
        import ray

        self.replicas, self.agents, self.pad_token_id = replicas, agents, pad_token_id
        self.judge_replicas = list(judge_replicas)
        self.objects = objects or RayObjects()
        self._next_agent = -1
        self._concatenate = ray.remote(num_cpus=0)(concatenate)
        self.weight_version = 0
        self.last_update = None
        """The last weights pushed (a reference: it keeps their buckets alive), for a restarted replica."""

    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict:
        """The generated rollout batch (see :meth:`start_generate`)."""
        return self.objects.get(self.start_generate(prompts, step=step, sampling=sampling))

    def start_generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams):
        """A reference to the generated rollout batch: the prompts split into contiguous shares, one per
        agent worker, their trajectories concatenated in prompt order."""
        self.resync_restarted()
        rows = prompts.batch_size[0]
        share = -(-rows // len(self.agents))
        parts = [
            agent.generate.remote(
                prompts[start : start + share],
                first_position=start,
                step=step,
                sampling=sampling,
                weight_version=self.weight_version,
            )
            for agent, start in zip(self.agents, range(0, rows, share))
        ]
        return self._concatenate.remote(*parts, pad_token_id=self.pad_token_id)

    def submit_group(self, prompt: TensorDict, *, position: int, step: int, sampling: SamplingParams):
        """A reference to one prompt's group (``sampling.n`` trajectories), generated on the next agent worker
        in turn: the async trainer modes feed prompts one at a time and take each group as it finishes.
        ``position`` (the prompt's feed index) keeps the trajectories' seeds apart."""
        self._next_agent = (self._next_agent + 1) % len(self.agents)
        return self.agents[self._next_agent].generate.remote(
            prompt, first_position=position, step=step, sampling=sampling, weight_version=self.weight_version
        )

    def cancel(self, groups: list, timeout_s: float = 10.0) -> None:
        """End the generations of ``groups`` (references from :meth:`submit_group`) and wait, up to
        ``timeout_s``, until they have: each agent worker's task is cancelled, and the replica requests its
        loops made with it (Ray cancels what a cancelled task submitted), so that no request is left waiting
        on a replica when the run kills the actors (which Ray reports as a failed task). Their results are
        dropped; one that failed is logged."""
        import ray

        if not groups:
            return
        for group in groups:
            ray.cancel(group)
        ended, _ = ray.wait(groups, num_returns=len(groups), timeout=timeout_s)
        for group in ended:  # read, or Ray reports each cancellation as an unhandled error when it is freed
            try:
                ray.get(group)
            except ray.exceptions.TaskCancelledError:
                pass
            except ray.exceptions.RayError as error:
                logger.warning("a generation ended at the end of the run failed: %r", error)

    def gateway_urls(self) -> list[str | None]:
        """Each agent worker's gateway base URL (``agent.gateway.enable``; None where it is off): docs/gateway.md."""
        return self.objects.get([agent.gateway_url.remote() for agent in self.agents])

    def memory_stats(self) -> dict[str, float]:
        """The replicas' figures, the largest of each (the agent-loop workers hold no model)."""
        return largest(self.objects.get(self.start_memory_stats()))

    def start_memory_stats(self) -> list:
        """References to every replica's figures (:func:`~ppoflow.workers.memory.process_memory`)."""
        return [replica.__ray_call__.remote(_replica_memory) for replica in self.replicas]

    def sleep(self) -> list:
        """References to every replica going to sleep (:meth:`RolloutReplica.sleep`: requests in flight are
        aborted and resumed after :meth:`wake`; each returns how many it aborted)."""
        return [replica.sleep.remote() for replica in self.replicas]

    def wake(self) -> list:
        """References to every replica serving again."""
        return [replica.wake.remote() for replica in self.replicas]

    def start_apply_weights(self, update) -> list:
        """References to every replica taking the update (a :class:`WeightUpdate` or a reference to one;
        each returns the version it now serves)."""
        import ray

        self.weight_version = (ray.get(update) if isinstance(update, ray.ObjectRef) else update).version
        self.last_update = update
        return [replica.apply_weights.remote(update) for replica in self.replicas]

    def resync_restarted(self) -> None:
        """Give every replica that serves other weights than the last pushed (Ray restarted it after a crash)
        those weights again before it takes requests. A replica restarted in the middle of a batch serves
        its initial weights until the next batch; the trainer sees their version on the trajectories and
        generates that batch again."""
        import ray

        if self.last_update is None:
            return
        versions = ray.get([replica.weight_version.remote() for replica in self.replicas])
        stale = [index for index, version in enumerate(versions) if version != self.weight_version]
        if stale:
            logger.warning(
                "rollout replica(s) %s serve weight version(s) %s instead of %d (restarted): re-syncing",
                stale,
                [versions[i] for i in stale],
                self.weight_version,
            )
            ray.get([self.replicas[index].apply_weights.remote(self.last_update) for index in stale])


class ColocatedRolloutService(RolloutService):
    """The rollout service on the actor's ranks (``hybrid_engine`` with ``rollout.mode=async``): each rank's engine
    is a replica (:class:`~ppoflow.workers.training.policy.ColocatedActorWorker`). A batch wakes every rank (each
    takes its weights from the shards it trains), runs the agent loops against them and puts them to sleep once
    its trajectories are in, so the ranks train with the engines' memory freed. No weights are pushed, and a
    training rank is never restarted, so there is none to re-sync."""

    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict:
        self.objects.get([rank.wake.remote(serve=True) for rank in self.replicas])
        try:
            return super().generate(prompts, step=step, sampling=sampling)
        finally:
            self.objects.get([rank.sleep.remote() for rank in self.replicas])

    def resync_restarted(self) -> None:
        """Nothing to re-sync: the engines serve the ranks' own weights."""


def _replica_memory(replica) -> dict[str, float]:
    """Run inside a replica (``__ray_call__``): its process's memory figures."""
    return process_memory()
