"""Rewards and the algorithm: the custom scorer and where scoring runs, the KL controller, rollout
correction, the advantage estimator.
"""

from __future__ import annotations

from string import Formatter
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from ppoflow.algorithms.names import ADVANTAGE_ESTIMATORS, FILTER_METRICS, IS_LEVELS, KL_PENALTY_KINDS
from ppoflow.configs.schema_base import ResourcesConfig, Section


class CustomRewardConfig(Section):
    path: str | None = Field(
        description="`module:function`, `module`, or a .py file; null = built-in scorers by data_source."
    )
    name: str = Field(description="Function name when `path` names a module or file.")
    timeout_s: float = Field(
        gt=0,
        description="How long one call of the custom scorer may take; a stall is reported "
        "while it lasts, and a call past this is handled by `on_timeout`.",
    )
    on_timeout: Literal["fail", "score"] = Field(
        description="A scorer call past `timeout_s`: fail the step (naming the sample), or give the response "
        "`timeout_score` and go on (counted in reward/scorer_timeouts)."
    )
    timeout_score: float = Field(description="The score of a response whose scorer timed out (on_timeout=score).")
    error_score: float = Field(
        allow_inf_nan=False,
        description="The score of a response its scorer (custom or built-in) fails on - raises, returns no finite "
        "score, crashes - instead of a failed run; logged, counted in reward/scorer_errors.",
    )


class OverlongBufferConfig(Section):
    """DAPO's overlong reward shaping (verl's DAPO reward manager): a response of ``L`` tokens past
    ``max_resp_len - len`` gets ``-(L - (max_resp_len - len)) / len * penalty_factor`` added to its score."""

    enable: bool = Field(description="Shape the training reward of responses that enter the last `len` tokens.")
    len: int = Field(ge=0, description="Tokens at the end of the response budget where the penalty grows.")
    penalty_factor: float = Field(ge=0, description="The penalty of a response that uses the whole budget.")
    log: bool = Field(description="Report reward/overlong_reward/mean and reward/overlong/mean (share penalised).")


class RewardKwargsConfig(Section):
    """verl's ``reward_model.reward_kwargs`` of the DAPO reward manager."""

    overlong_buffer_cfg: OverlongBufferConfig
    max_resp_len: int | None = Field(
        ge=1, description="The response budget of the penalty; null = data.max_response_length."
    )


class RemoteRewardConfig(Section):
    """An HTTP reward service the reward_model stage posts each batch to (docs/reward_models.md)."""

    url: str | None = Field(description="http(s) URL of the reward service; null = none.")
    format: Literal["ppoflow", "openrlhf", "verl"] = Field(
        description="Request and answer schema: ppoflow's, OpenRLHF's remote RM (query/prompts/labels -> rewards) "
        "or verl's compute_score arguments (docs/reward_models.md)."
    )
    batch_size: int = Field(ge=1, description="Responses per request.")
    max_concurrency: int = Field(ge=1, description="Requests in flight at once.")
    timeout_s: float = Field(gt=0, description="How long one request may take before it counts as failed.")
    max_retries: int = Field(ge=0, description="Retries of a failed request (timeout, connection, 5xx, bad answer).")
    backoff_s: float = Field(ge=0, description="Wait before the first retry; doubles with each further one.")
    api_key_env: str | None = Field(description="Environment variable whose value authenticates; null = none.")
    auth_header: str = Field(description="The header that carries the key.")
    auth_scheme: str = Field(description='Written before the key in that header ("Bearer"); "" = the key alone.')
    on_error: Literal["fail", "score"] = Field(
        description="A request that still fails after its retries: fail the step naming the URL, or give its "
        "responses `error_score` (logged, counted in reward_model/remote_errors)."
    )
    error_score: float = Field(allow_inf_nan=False, description="The score of a response whose request failed.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """Only http(s) with a host: urllib would also open ``file://`` and ``ftp://`` URLs."""
        parts = urlsplit(url) if url is not None else None
        if parts is not None and (parts.scheme not in ("http", "https") or not parts.hostname):
            raise PydanticCustomError("http_url", "must be an http:// or https:// URL with a host")
        return url


class RewardModelPathConfig(Section):
    """The reward model's files (verl's ``reward_model.model``)."""

    path: str | None = Field(
        description="Hugging Face sequence-classification model (1 label), or causal LM with a value head "
        "(v_head.summary.*), local path or fsspec URL; needed when `enable`."
    )
    tokenizer_path: str | None = Field(description="Its tokenizer (and chat template); null = `path`.")
    trust_remote_code: bool = Field(description="Passed to transformers' from_pretrained.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Parameter dtype of the loaded model.")


class JudgeModelConfig(RewardModelPathConfig):
    """The judge's own model (``reward_model.judge.model``): served by replicas of its own, never trained."""

    path: str | None = Field(
        description="Hugging Face causal LM (local path or fsspec URL) served by `num_replicas` replicas of its own, "
        "which take no weight updates; null = the policy's rollout replicas judge with its current weights."
    )


class JudgeConfig(Section):
    """An LLM judge on the rollout service: the policy's replicas, or a judge model's own
    (docs/reward_models.md#an-llm-judge)."""

    prompt_template: str | None = Field(
        description="The judge's prompt, with {prompt}, {response} and {ground_truth} filled in; null = no judge."
    )
    parser_path: str | None = Field(
        description="The verdict's parser: a scorer (`module:function`, module or .py file) called with the judge's "
        "text as solution_str; needed with a judge."
    )
    parser_name: str = Field(description="The parser's function name when `parser_path` names a module or file.")
    max_tokens: int = Field(ge=1, description="Longest verdict, in tokens.")
    temperature: float = Field(ge=0, description="The verdict's sampling temperature; 0 = greedy.")
    timeout_s: float = Field(gt=0, description="How long one parser call may take (then it fails).")
    error_score: float = Field(
        allow_inf_nan=False, description="The judge score of a verdict the parser fails on (logged, counted)."
    )
    model: JudgeModelConfig
    num_replicas: int = Field(ge=1, description="Replicas serving the judge model (with `model.path`).")
    resources: ResourcesConfig

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, template: str | None) -> str | None:
        """Only the three fields: ``str.format`` would fail on any other at the first finished trajectory."""
        fields = {name for _, name, _, _ in Formatter().parse(template or "") if name is not None}
        unknown = sorted(fields - {"prompt", "response", "ground_truth"})
        if unknown:
            raise PydanticCustomError(
                "judge_template",
                "names {unknown}; it may name only the fields prompt, response and ground_truth",
                {"unknown": ", ".join(unknown)},
            )
        return template


class RewardModelConfig(Section):
    """Where rule-based scoring runs (verl's ``reward_model.reward_manager``), DAPO's overlong shaping, and the
    model-based rewards: a reward model or a remote reward service, combined with the rule scores by ``combine``."""

    reward_manager: Literal["naive", "ray"] = Field(
        description="naive: score in the flow; ray: score chunks as Prefect tasks on Ray workers (prefect-ray), "
        "for slow scorers (sandboxed code, remote judges). ray needs PREFECT_API_URL."
    )
    num_workers: int = Field(ge=1, description="reward_manager=ray: chunks scored at once.")
    reward_kwargs: RewardKwargsConfig
    combine: Literal["sum", "rule_first"] = Field(
        description="How a model-based score meets a rule score: sum (rule score + model score; a response whose "
        "data source has no scorer gets the model score), rule_first (the rule score where the data source has a "
        "scorer, the model score elsewhere)."
    )
    enable: bool = Field(description="Score each response with the reward model `model.path` in a worker of its own.")
    model: RewardModelPathConfig
    micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Responses per forward pass of the reward model; null = the whole batch."
    )
    max_length: int | None = Field(
        ge=1,
        description="Longest chat-formatted prompt + response the reward model reads; a longer one keeps its "
        "last max_length tokens. null = no limit.",
    )
    use_dynamic_bsz: bool = Field(
        description="Cut forward passes by tokens (forward_max_token_len_per_gpu), not by responses."
    )
    forward_max_token_len_per_gpu: int = Field(ge=1, description="use_dynamic_bsz: tokens per forward pass.")
    resources: ResourcesConfig
    remote: RemoteRewardConfig
    judge: JudgeConfig

    @property
    def model_stage(self) -> bool:
        """Whether a reward model or a reward service scores each response too (the reward_model stage runs)."""
        return self.enable or self.remote.url is not None

    @property
    def model_based(self) -> bool:
        """Whether a model scores each response too: in the reward_model stage, or the judge as trajectories finish."""
        return self.model_stage or self.judge.prompt_template is not None


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(description="In-reward KL coefficient controller.")
    kl_coef: float = Field(ge=0, description="(Initial) KL coefficient.")
    horizon: int = Field(gt=0, description="Adaptive controller horizon.")
    target_kl: float = Field(gt=0, description="Adaptive controller target KL.")


class RolloutCorrectionConfig(Section):
    """verl's off-policy correction between the rollout's sampling log-probs and the trainer's."""

    bypass_mode: bool = Field(
        description="Use the rollout's log-probs as old log-probs and skip the old_log_prob stage."
    )
    rollout_is: Literal[IS_LEVELS] | None = Field(  # type: ignore[valid-type]
        description="Importance-sampling weights old/rollout per token or per sequence; null = none."
    )
    rollout_is_threshold: float | str = Field(
        description='Truncate IS weights at this value, or "lo_hi" (e.g. "0.5_2.0") to zero weights outside '
        "[lo, hi] (IcePop)."
    )
    rollout_is_batch_normalize: bool = Field(description="Normalise IS weights to mean 1 over the batch.")
    rollout_rs: str | None = Field(
        description="Rejection sampling: comma list of token_k1|k2|k3, seq_sum_*, seq_mean_*, seq_max_k2|k3; "
        "null = none."
    )
    rollout_rs_threshold: float | str | list[float | str] | None = Field(
        description='Bound(s) for rollout_rs: one per option or one for all (k1 options take "lo_hi").'
    )


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling: drop prompt groups whose `metric` is the same for every response and
    generate more (``data.gen_batch_size`` prompts at a time) until ``data.train_batch_size`` groups remain."""

    enable: bool = Field(description="Drop zero-variance groups and keep generating (docs/dynamic_sampling.md).")
    metric: Literal[FILTER_METRICS] | None = Field(  # type: ignore[valid-type]
        description="acc: the `acc` its scorer reports; score / seq_reward: the response's score; "
        "seq_final_reward: its token rewards' sum (no in-reward KL). Needed when `enable`."
    )
    max_num_gen_batches: int = Field(
        description="Generation batches a step may use; past it the step fails naming this key. <= 0: no limit."
    )


class AlgorithmConfig(Section):
    adv_estimator: Literal[ADVANTAGE_ESTIMATORS] = Field(description="Advantage estimator (gae needs a critic).")  # type: ignore[valid-type]
    gamma: float = Field(ge=0, le=1, description="Discount factor.")
    lam: float = Field(ge=0, le=1, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(description="Divide GRPO advantages by the group std (false = Dr.GRPO).")
    use_kl_in_reward: bool = Field(
        description="Subtract a KL-to-reference penalty from the token rewards (needs the ref worker)."
    )
    kl_penalty: Literal[KL_PENALTY_KINDS] = Field(description="KL estimator of the in-reward penalty.")  # type: ignore[valid-type]
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig
