"""What the benchmarks share: the workloads (the demo as shipped, and a larger model on longer sequences,
each built - model and data - into a scratch folder of the benchmark's own), and running ppoflow's own
training loop on one of them with or without Ray and Prefect."""

from __future__ import annotations

import logging
import statistics

WORKLOADS = {
    "demo": [],  # grpo_tiny as shipped: 16 prompts x 8 samples, 3-token responses
    "larger": ["actor_rollout_ref.model.build.hidden_size=512", "actor_rollout_ref.model.build.intermediate_size=1024",
               "actor_rollout_ref.model.build.num_hidden_layers=4", "actor_rollout_ref.model.build.num_attention_heads=8",
               "data.max_prompt_length=16", "data.max_response_length=16", "data.synthetic.digits=8"],
}


def start_local_ray() -> None:
    """A local Ray for a benchmark's runs (4 logical CPUs on any machine, no dashboard, the workers' logs
    off the console), with Prefect's per-task-run lines quieted."""
    import ray

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def built_in(scratch: str, name: str, *, validation: bool = False) -> list[str]:
    """Overrides that build workload ``name``'s model and data files under ``scratch``: overriding a path
    asks for the preset's build recipe explicitly (``build.seed``, ``synthetic.seed``), or the missing
    files would be an error."""
    return [f"actor_rollout_ref.model.path={scratch}/{name}-model", "actor_rollout_ref.model.build.seed=0",
            f"data.train_files={scratch}/{name}-train.parquet", "data.synthetic.seed=0",
            f"data.val_files={scratch}/{name}-val.parquet" if validation else "data.val_files=null"]


def ppoflow_steps(cfg, *, ray_workers: bool, prefect_tasks: bool, steps: int) -> list[dict[str, float]]:
    """Each step's metrics over ``steps`` steps of ppoflow's loop on ``cfg``, its workers in Ray actors or
    in this process, its stages Prefect task runs (inside a flow) or plain functions."""
    import dataclasses

    from prefect import flow

    from ppoflow.flows.modes import make_trainer
    from ppoflow.flows.stages import Stages
    from ppoflow.flows.state import TrainerState
    from ppoflow.flows.train import start_run, train_steps

    run = start_run(cfg, orchestrated=ray_workers)
    run = dataclasses.replace(run, stages=Stages(run.workers, run.stages.caches, orchestrated=prefect_tasks,
                                                  tags=run.stages.tags))
    state = TrainerState(cfg, len(run.train_set))
    mode = make_trainer(run, state)

    def loop() -> list[dict[str, float]]:
        return [dict(step.metrics) for step in train_steps(run, state, mode, range(1, steps + 1))]

    try:
        return flow(name="benchmark-steps")(loop)() if prefect_tasks else loop()
    finally:
        run.workers.shutdown()


def timing_medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of every ``timing_s/<name>`` over the rows that report it, by ``<name>``."""
    names = sorted({name for row in rows for name in row if name.startswith("timing_s/")})
    return {name[len("timing_s/"):]: statistics.median(row[name] for row in rows if name in row) for name in names}
