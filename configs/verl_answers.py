"""What ppoflow answers for verl's keys and values: verl's values that mean one of ours (:data:`VERL_VALUES`), values
of verl's keys that change nothing here (:data:`NO_OPS`, accepted), and for any other key of verl's the answer by
meaning from the tables of :mod:`ppoflow.configs.verl_keys` (:func:`verl_answer`).
"""

from __future__ import annotations

from ppoflow.configs.verl_keys import ACTOR, CRITIC_FSDP, FSDP1_OFFLOAD, MODEL, REF, RENAMED, ROLLOUT, UNSUPPORTED

VERL_VALUES: dict[str, dict] = {
    "reward_model.reward_manager": {"dapo": "naive"},
    **{f"{role}.strategy": {"fsdp": "fsdp2"} for role in (ACTOR, REF, "critic")},
}
"""Our key -> verl's values for it that mean what one of ours means: verl's DAPO reward manager is the rule score
in the flow (DAPO's overlong shaping applies under any manager here: ``reward_kwargs.overlong_buffer_cfg``); verl's
FSDP1 engine (``strategy=fsdp``) trains what FSDP2 does. The loader replaces them
(:func:`~ppoflow.configs.normalize.normalize`)."""

ANY = ("any value",)
"""In :data:`NO_OPS`: every value of the key changes nothing here (a speed setting of an engine of verl's)."""

_FSDP_SECTIONS = (f"{ACTOR}.fsdp_config", f"{REF}.fsdp_config", *CRITIC_FSDP)
NO_OPS: dict[str, tuple] = {
    "trainer.critic_warmup": (0,),
    **{f"{section}.{offload}": (False,) for section in _FSDP_SECTIONS for offload in (*FSDP1_OFFLOAD, "grad_offload")},
    **{f"{model}.enable_activation_offload": (False,) for model in (MODEL, "critic.model")},
    **{f"{model}.use_shm": (False,) for model in (MODEL, "critic.model", "data")},
    **{f"{MODEL}.{kernels}": (False,) for kernels in ("use_liger", "use_fused_kernels")},
    f"{ACTOR}.use_fused_kernels": (False,),
    **{f"{role}.use_torch_compile": (False,) for role in (ACTOR, REF)},
    "trainer.use_legacy_worker_impl": ("auto", "enable", "disable"),
    "trainer.balance_batch": (True,),
    "trainer.del_local_ckpt_after_load": (False,),
    "trainer.default_hdfs_dir": (None,),
    "trainer.max_actor_ckpt_to_keep": (None,),
    "trainer.max_critic_ckpt_to_keep": (None,),
    "trainer.esi_redundant_time": ANY,
    "trainer.ray_wait_register_center_timeout": ANY,
    "ray_kwargs.timeline_json_file": (None,),
    "data.validation_shuffle": (False,),
    "data.dataloader_num_workers": ANY,
    "data.filter_overlong_prompts_workers": ANY,
    f"{ACTOR}.calculate_entropy": ANY,
    f"{ROLLOUT}.calculate_log_probs": ANY,
    f"{ROLLOUT}.free_cache_engine": (True,),
    f"{ROLLOUT}.multi_turn.enable": (False,),
    **{
        f"{ROLLOUT}.{option}": ANY
        for option in (
            "enforce_eager",
            "cudagraph_capture_sizes",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "load_format",
            "layered_summon",
            "disable_log_stats",
            "multi_stage_wake_up",
        )
    },
}
"""verl key -> the values it may take that change nothing here, because what verl does with them is what ppoflow
does (``trainer.critic_warmup=0``: the actor trains from the first step; an FSDP1 offload switch off); :data:`ANY`:
every value (how fast an engine of verl's runs, not what it computes). The loader drops them before validating
(:func:`~ppoflow.configs.normalize.drop_no_op_verl_values`); any other value is answered by :func:`verl_answer`,
which says which value is accepted."""


def verl_answer(key: str, within: str) -> tuple[str, str] | None:
    """The table's answer for dotted ``key``, or for its nearest section that is still inside ``within`` (the
    unknown key the schema reported): ``(the table's key, the text after "unknown key")``; None if none."""
    parts = key.split(".")
    for end in range(len(parts), within.count("."), -1):
        candidate = ".".join(parts[:end])
        accepted = _accepted_values(candidate)
        if candidate in RENAMED:
            ours = RENAMED[candidate]
            if isinstance(ours, str):
                return candidate, f"did you mean {ours!r}? (verl's name for it){accepted}"
            return candidate, f"did you mean {' and '.join(map(repr, ours))}? (verl's one key for them all){accepted}"
        if candidate in UNSUPPORTED:
            return candidate, f"verl's key, {UNSUPPORTED[candidate]}{accepted}"
    return None


def _accepted_values(key: str) -> str:
    """What a refusal of ``key`` adds when some of its values are accepted as they change nothing."""
    values = NO_OPS.get(key)
    if values is None or values is ANY:
        return ""
    spelled = " or ".join("null" if value is None else str(value).lower() for value in values)
    return f"; {spelled} changes nothing here and is accepted"
