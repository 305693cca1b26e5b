"""The workloads the benchmarks share: the demo as shipped, and a larger model on longer sequences, each
built (model and data) into a scratch folder of the benchmark's own."""

from __future__ import annotations

WORKLOADS = {
    "demo": [],  # grpo_tiny as shipped: 16 prompts x 8 samples, 3-token responses
    "larger": ["actor_rollout_ref.model.build.hidden_size=512", "actor_rollout_ref.model.build.intermediate_size=1024",
               "actor_rollout_ref.model.build.num_hidden_layers=4", "actor_rollout_ref.model.build.num_attention_heads=8",
               "data.max_prompt_length=16", "data.max_response_length=16", "data.synthetic.digits=8"],
}


def built_in(scratch: str, name: str, *, validation: bool = False) -> list[str]:
    """Overrides that build workload ``name``'s model and data files under ``scratch``: overriding a path
    asks for the preset's build recipe explicitly (``build.seed``, ``synthetic.seed``), or the missing
    files would be an error."""
    return [f"actor_rollout_ref.model.path={scratch}/{name}-model", "actor_rollout_ref.model.build.seed=0",
            f"data.train_files={scratch}/{name}-train.parquet", "data.synthetic.seed=0",
            f"data.val_files={scratch}/{name}-val.parquet" if validation else "data.val_files=null"]
