"""What every merged and resolved config gets before validation (:func:`normalize`): each cache's defaults; verl's
keys set to values that change nothing dropped, and verl's values spelled as ours; the rollout's dtype, where it is
left to the hardware; one trainer mode; absolute local paths (Hugging Face hub ids left as they are), so that Ray
workers, which may run elsewhere, see the same files. Part of :func:`~ppoflow.configs.loader.load_config`.
"""

from __future__ import annotations

import functools

from ppoflow.configs.modes import DEFAULT_MODE
from ppoflow.configs.verl_answers import ANY, NO_OPS, VERL_VALUES
from ppoflow.storage.fs import is_hub_id, normalize_url


def normalize(container: dict, skip_defaults: dict) -> list[tuple[str, str]]:
    """What every resolved config gets before validation: each cache's defaults, one trainer mode, absolute
    paths; returns the problems found on the way."""
    _fill_skip_defaults(container, skip_defaults)
    drop_no_op_verl_values(container)
    _translate_verl_values(container)
    _choose_rollout_dtype(container)
    return _unify_trainer_mode(container) + _make_paths_absolute(container)


def drop_no_op_verl_values(container: dict) -> None:
    """Take out each key of verl's set to a value that changes nothing here
    (:data:`~ppoflow.configs.verl_answers.NO_OPS`: ``trainer.critic_warmup=0``, an FSDP1 offload switch off, ...),
    and any section of verl's it leaves empty."""
    for key in NO_OPS:
        node, leaf = parent_of(container, key)
        if node is None or leaf not in node or not changes_nothing(key, node[leaf]):
            continue
        del node[leaf]
        parts = key.split(".")[:-1]
        while parts and (section := parent_of(container, ".".join(parts)))[0] is not None:
            parent, name = section
            if parent.get(name) != {}:
                break
            del parent[name]
            parts.pop()


def _translate_verl_values(container: dict) -> None:
    """verl's values that mean one of ours (:data:`~ppoflow.configs.verl_answers.VERL_VALUES`) become it, and one
    logger given as a string (verl's ``trainer.logger=console``) a list of it."""
    for key, values in VERL_VALUES.items():
        node, leaf = parent_of(container, key)
        if node is not None and isinstance(node.get(leaf), str) and node[leaf] in values:
            node[leaf] = values[node[leaf]]
    trainer = container.get("trainer")
    if isinstance(trainer, dict) and isinstance(trainer.get("logger"), str):
        trainer["logger"] = [trainer["logger"]]


def _choose_rollout_dtype(container: dict) -> None:
    """``actor_rollout_ref.rollout.dtype: null`` becomes the dtype that samples fast where the rollout runs
    (:func:`fast_rollout_dtype`, :func:`samples_on_gpu`)."""
    node, leaf = parent_of(container, "actor_rollout_ref.rollout.dtype")
    if node is None or node.get(leaf) is not None:
        return
    trainer = container.get("trainer") or {}
    on_gpu = samples_on_gpu(
        node.get("name"), (node.get("resources") or {}).get("num_gpus"), trainer.get("n_gpus_per_node")
    )
    node[leaf] = fast_rollout_dtype(on_gpu=on_gpu)


def samples_on_gpu(engine: str | None, rollout_gpus, trainer_gpus) -> bool:
    """Whether the rollout samples on a GPU: vLLM, or GPUs reserved for the rollout or the training pool (whose
    ranks host a colocated engine)."""
    return engine == "vllm" or bool(rollout_gpus) or bool(trainer_gpus)


def fast_rollout_dtype(*, on_gpu: bool) -> str:
    """bfloat16 on GPUs (verl's default) and on a CPU that multiplies it on AMX; float32 on other CPUs, where
    bfloat16 matmuls are emulated or narrow (AVX512-BF16) and sampling takes up to twice as long."""
    return "bfloat16" if on_gpu or cpu_has_amx() else "float32"


def rollout_dtype_line(rollout_dtype: str, *, on_gpu: bool) -> str:
    """What a run says of its rollout's dtype at the start: which, and what this hardware makes fast."""
    fast = fast_rollout_dtype(on_gpu=on_gpu)
    where = "a GPU" if on_gpu else f"this CPU ({'with' if cpu_has_amx() else 'without'} AMX)"
    advice = "" if rollout_dtype == fast else f"; {fast} samples faster on it"
    return f"the rollout samples in {rollout_dtype} (actor_rollout_ref.rollout.dtype) on {where}{advice}"


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (``amx_bf16`` among /proc/cpuinfo's flags; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return False


def changes_nothing(key: str, value) -> bool:
    """Whether verl's ``key`` set to ``value`` changes nothing here (:data:`~ppoflow.configs.verl_answers.NO_OPS`; a
    bool only equals a bool: YAML's ``0`` is not ``false``)."""
    values = NO_OPS.get(key)
    return values is not None and (values is ANY or any(type(value) is type(v) and value == v for v in values))


PATH_KEYS = (
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "critic.model.path",
    "critic.model.tokenizer_path",
    "trainer.default_local_dir",
    "trainer.resume_from_path",
)
"""Keys holding local paths or URLs; relative local paths are resolved against the caller's working
directory here, once, so that Ray workers (which may run elsewhere) see the same files."""
MODEL_PATH_KEYS = {key for key in PATH_KEYS if key.endswith(("model.path", "tokenizer_path"))}
"""Those that may hold a Hugging Face hub id instead (:func:`~ppoflow.storage.fs.is_hub_id`)."""


def _make_paths_absolute(container: dict) -> list[tuple[str, str]]:
    """Resolve the local paths of :data:`PATH_KEYS`; returns a problem for each value that is no path at all."""
    keys = list(PATH_KEYS) + [f"skip.{stage}.dump_dir" for stage in (container.get("skip") or {})]
    problems = []
    for key in keys:
        node, leaf = parent_of(container, key)
        if node is None or node.get(leaf) is None:
            continue
        value = node[leaf]
        if key in MODEL_PATH_KEYS and isinstance(value, str) and is_hub_id(value) and node.get("build") is None:
            continue  # a hub id stays one (workers.models resolves it in the hub cache); a model to build is a path
        try:
            if isinstance(value, str):
                node[leaf] = normalize_url(value)
            elif isinstance(value, list):
                node[leaf] = [normalize_url(v) if isinstance(v, str) else v for v in value]
        except ValueError as error:  # os.path refuses a NUL byte
            problems.append((key, f"is not a path: {error} (got {value!r})"))
    return problems


def parent_of(container: dict, key: str) -> tuple[dict | None, str]:
    """The mapping holding dotted ``key`` in ``container`` (None when a section on the way is not one), and
    the key's last part."""
    *parents, leaf = key.split(".")
    node = container
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _unify_trainer_mode(container: dict) -> list[tuple[str, str]]:
    """``trainer.mode`` and verl's ``trainer.v1.trainer_mode`` are one setting: whichever is given sets both
    (neither: :data:`~ppoflow.configs.modes.DEFAULT_MODE`); both given and different is a problem naming both
    (``trainer.mode`` then wins)."""
    trainer = container.get("trainer")
    if not isinstance(trainer, dict) or not isinstance(trainer.get("v1"), dict):
        return []  # the schema reports the malformed section
    mode, v1_mode = trainer.get("mode"), trainer["v1"].get("trainer_mode")
    problems = []
    if mode is not None and v1_mode is not None and mode != v1_mode:
        problems.append(
            (
                "trainer.v1.trainer_mode",
                f"{v1_mode!r} disagrees with trainer.mode={mode!r}: they are one setting; set one of them",
            )
        )
    trainer["mode"] = trainer["v1"]["trainer_mode"] = mode or v1_mode or DEFAULT_MODE
    return problems


def _fill_skip_defaults(container: dict, stage_defaults: dict) -> None:
    """Give every ``skip.<stage>`` section the defaults of ``skip.rollout`` in ``ppo_trainer.yaml``
    (verl's role defaults, the same for every stage) for the keys it does not set."""
    skip = container.get("skip")
    if isinstance(skip, dict):
        for stage, section in skip.items():
            if isinstance(section, dict):
                skip[stage] = {**stage_defaults, **section}
