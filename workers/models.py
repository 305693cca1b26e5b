"""Loading Hugging Face models and tokenizers (from a local path or any fsspec URL), and building the
demo's tiny model.

Nothing can be downloaded from a model hub on our CI machines, so the demo and the tests build a
random-initialised Llama and a character-level tokenizer from a config, ``save_pretrained`` them, and
then load them back through :func:`load_tokenizer` / :func:`load_causal_lm` exactly like any other
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import fsspec
import torch

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import ModelConfig, ResourcesConfig, TinyModelConfig
from ppoflow.storage.fs import is_hub_id, path_problem
from ppoflow.storage.safetensors_stream import write_safetensors
from ppoflow.workers.hub import hub_absent, hub_cache, hub_snapshot
from ppoflow.workers.transport import send_batches_as_plain_values

TINY_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
TINY_CHARACTERS = "0123456789+-=>:,|?abcdefghij"
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Concatenates message contents: lets verl-style chat-message datasets run on the tiny tokenizer."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_up_worker_process(resources: ResourcesConfig) -> torch.device:
    """Set this worker process's torch threads to its role's ``num_threads`` and, in a Ray worker, have
    Ray send its step batches as plain values (:mod:`ppoflow.workers.transport`); return its device (the
    GPU when the role reserves one, else the CPU)."""
    torch.set_num_threads(resources.num_threads)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        send_batches_as_plain_values()
    return torch.device("cuda" if resources.num_gpus > 0 else "cpu")


def keep_attention_off_cudnn_if_padded(device: torch.device, remove_padding: bool) -> None:
    """In a worker that runs padded forward passes on a GPU, keep PyTorch's SDPA off its cuDNN backend for the
    process: a left-padded row's pad positions attend to no key, and cuDNN's kernels then give NaN gradients in
    bf16 (seen on an H200, docs/benchmarks.md#on-a-gpu); the memory-efficient and flash kernels handle such
    rows. Packed passes (``use_remove_padding``) have no padding and keep every backend."""
    if device.type == "cuda" and not remove_padding:
        torch.backends.cuda.enable_cudnn_sdp(False)


def holds_model(path: str) -> bool:
    """Whether ``path`` (local, an fsspec URL or a hub id) contains a Hugging Face model (a ``config.json``)."""
    fs, config_path = _config_json(path)
    return fs.exists(config_path)


def _config_json(path: str):
    """The filesystem of model directory ``path`` and the path of its ``config.json`` inside it (a hub id's: in its
    snapshot in the hub cache, or where none is)."""
    if is_hub_id(path):
        path = hub_snapshot(path) or os.path.join(hub_cache(), path)  # absent: a path that holds nothing
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(path))
    return fs, f"{root.rstrip('/')}/config.json"


def builds_model(model: ModelConfig) -> bool:
    """Whether :func:`ensure_model` will build the tiny model: ``model.build`` is set and ``model.path``
    holds no model yet."""
    return model.build is not None and not holds_model(model.path)


def ensure_model(model: ModelConfig, key: str) -> None:
    """Build the tiny model into ``model.path`` when :func:`builds_model`, saying so (``key`` names the path).

    Whether a path that is not built holds a usable model is the preflight's check (:func:`model_config`).
    """
    if builds_model(model):
        # print, not a logger: inside the flow (log_prints) it reaches the console and the Prefect UI
        print(
            f"building a random-init tiny Llama into {model.path} ({_build_key(key)} is set and "
            f"{model.path} holds no model)"
        )
        build_tiny_model(model.path, model.build)


def _build_key(path_key: str) -> str:
    """``actor_rollout_ref.model.path`` -> ``actor_rollout_ref.model.build``."""
    return f"{path_key.removesuffix('.path')}.build"


def model_config(model: ModelConfig, key: str) -> dict:
    """The parsed ``config.json`` of ``model.path``; :class:`ConfigError` naming ``key`` when it is absent,
    unreadable, not a JSON object, or names no ``model_type`` (transformers could not pick a class)."""
    fs, config_path = _config_json(model.path)
    url = f"{model.path.rstrip('/')}/config.json"
    try:
        config = json.loads(fs.cat_file(config_path))
    except FileNotFoundError:
        if is_hub_id(model.path):
            raise ConfigError([(key, hub_absent(model.path))]) from None
        hint = _build_key(key)
        raise ConfigError(
            [
                (
                    key,
                    f"{model.path!r} holds no Hugging Face model (no config.json); point it at a "
                    f"model directory, or set {hint}.* (e.g. {hint}.seed=0) to build a random-init "
                    "tiny Llama there",
                )
            ]
        ) from None
    except (OSError, ValueError) as error:  # ValueError: not JSON, not UTF-8
        raise ConfigError([(key, f"{url} is unreadable: {error}")]) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError([(key, f"{url} is not a Hugging Face model config (a JSON object with a model_type)")])
    return config


def save_pretrained(
    model,
    tokenizer,
    url: str,
    *,
    weights: dict[str, torch.Tensor],
    stream: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Write ``model`` (its config, and ``weights``: its full state dict, gathered when it is sharded) and
    ``tokenizer`` as a Hugging Face directory at ``url`` (local path or fsspec URL). ``stream``: the weights to
    write instead, one at a time in ``weights``' order, ``weights`` then giving only their names, dtypes and
    shapes (its tensors may alias the model's): each is written as it comes (:func:`write_safetensors`) when
    transformers would save them unconverted; for a model whose weights transformers converts, gathered first."""
    import tempfile

    fs, root = fsspec.core.url_to_fs(os.path.expanduser(url))
    with tempfile.TemporaryDirectory() as staging:
        layout = None if stream is None else unconverted_layout(model, weights)
        if layout is None:
            model.save_pretrained(staging, state_dict=weights if stream is None else dict(stream))
        else:  # transformers writes the config files; the weights follow one by one
            model.save_pretrained(staging, state_dict={})
            kept = ((name, tensor) for name, tensor in stream if name in layout)  # tied aliases left out
            write_safetensors(os.path.join(staging, "model.safetensors"), layout, kept, {"format": "pt"})
        _name_unwrapped_architecture(Path(staging) / "config.json", model)
        tokenizer.save_pretrained(staging)
        fs.makedirs(root, exist_ok=True)
        for name in os.listdir(staging):
            fs.put_file(os.path.join(staging, name), f"{root.rstrip('/')}/{name}")


def unconverted_layout(model, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """``weights`` as transformers' ``save_pretrained`` would write them (tied aliases left out) when it writes
    them as they are; None when it would convert them (renamed or fused tensors, as for some mixture-of-experts)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(dict(weights), model)
    saved = revert_weight_conversion(model, kept)
    unchanged = saved.keys() == kept.keys() and all(saved[name] is tensor for name, tensor in kept.items())
    return kept if unchanged else None


def _name_unwrapped_architecture(config_path: Path, model) -> None:
    """transformers records the model's class name as its architecture; FSDP2 wraps the class in a subclass
    (``FSDPLlamaForCausalLM``), so record the class it wraps, which loaders such as vLLM look up."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    wrapped = next(cls for cls in type(model).__mro__[1:] if not issubclass(cls, FSDPModule))
    config = json.loads(config_path.read_text())
    config["architectures"] = [wrapped.__name__]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_model_paths(model: ModelConfig, key: str) -> None:
    """:class:`ConfigError` naming the key when ``model.path`` or ``model.tokenizer_path`` (or the model's
    ``config.json``) is a path no load should open: a symlink loop, a dangling symlink, a FIFO or other
    special file, a file where a directory belongs (:func:`~ppoflow.storage.fs.path_problem`)."""
    paths = (
        (key, model.path, "directory"),
        (key, f"{model.path.rstrip('/')}/config.json", "file"),
        (f"{key.removesuffix('.path')}.tokenizer_path", model.tokenizer_path, "directory"),
    )
    problems: dict[str, str] = {}
    for name, path, want in paths:  # one problem per key: config.json is not checked under a broken model.path
        if path and name not in problems and (problem := path_problem(path, want=want)) is not None:
            problems[name] = f"{path} {problem}"
    if problems:
        raise ConfigError(list(problems.items()))


def check_context_length(
    model: ModelConfig, needed: int, key: str, what: str = "data.max_prompt_length + data.max_response_length"
) -> None:
    """:class:`ConfigError` naming ``key`` when ``needed`` tokens (``what``: prompt + response) would exceed the
    model's ``max_position_embeddings`` (the build recipe's when the model is still to be built), or when the
    model's paths or config are unusable (:func:`check_model_paths`, :func:`model_config`)."""
    check_model_paths(model, key)
    if builds_model(model):
        limit, source = model.build.max_position_embeddings, _build_key(key)
    else:
        limit, source = model_config(model, key).get("max_position_embeddings"), model.path
    if limit is not None and needed > limit:
        raise ConfigError(
            [
                (
                    key,
                    f"{what} = {needed} exceeds the model's max_position_embeddings={limit} ({source})",
                )
            ]
        )


def build_tiny_model(path: str, spec: TinyModelConfig) -> None:
    """Write a random-init Llama and its character tokenizer to a local directory ``path``."""
    from transformers import LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(tiny_llama_config(spec, tokenizer))
    Path(path).expanduser().mkdir(parents=True, exist_ok=True)
    model.save_pretrained(Path(path).expanduser())
    tokenizer.save_pretrained(Path(path).expanduser())


def tiny_tokenizer():
    """The tiny models' tokenizer: one token per character of :data:`TINY_CHARACTERS`, left-padding, with
    :data:`TINY_CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(TINY_SPECIAL_TOKENS + tuple(TINY_CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(spec: TinyModelConfig, tokenizer, **extra):
    """The Llama config of a tiny model built from ``spec`` over :func:`tiny_tokenizer`'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def local_model_dir(path: str) -> str:
    """A local directory holding the files of ``path``: a hub id's snapshot in the hub cache (:func:`hub_snapshot`);
    remote URLs are copied once into a cache."""
    if is_hub_id(path):
        snapshot = hub_snapshot(path)
        if snapshot is None:
            raise FileNotFoundError(hub_absent(path))
        return snapshot
    fs, root = fsspec.core.url_to_fs(os.path.expanduser(path))
    if "file" in fs.protocol:
        return root
    cache_root = Path(os.environ.get("PPOFLOW_MODEL_CACHE", "~/.cache/ppoflow/models")).expanduser()
    local = cache_root / hashlib.sha256(path.encode()).hexdigest()[:16]
    if not (local / "config.json").exists():
        staging = local.with_suffix(".partial")
        fs.get(root.rstrip("/") + "/", str(staging), recursive=True)
        staging.rename(local)
    return str(local)


def load_tokenizer(model: ModelConfig):
    """Load the tokenizer of ``model`` (``tokenizer_path`` or ``path``), left-padding, with a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        local_model_dir(model.tokenizer_path or model.path), trust_remote_code=model.trust_remote_code
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dtype_of(model: ModelConfig) -> torch.dtype:
    """The torch dtype of ``model.dtype``."""
    return _DTYPES[model.dtype]


def load_causal_lm(model: ModelConfig, dtype: str | None = None):
    """Load ``model.path`` as a causal LM in ``dtype`` (default: ``model.dtype``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        local_model_dir(model.path), dtype=_DTYPES[dtype or model.dtype], trust_remote_code=model.trust_remote_code
    )


def copy_in_dtype(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], dtype: str) -> torch.nn.Module:
    """A new model of ``model``'s architecture, in eval mode, holding ``weights`` (every entry of its state dict,
    under its own names, taken one at a time) cast to ``dtype``: what a colocated rollout samples with when
    ``rollout.dtype`` is not the actor's. Built on the meta device and filled by assignment from one
    allocation, which a CPU allocator returns whole when the copy is dropped (tensor by tensor it would keep the
    freed pages in its heap); each weight is copied in as it comes, so a source that builds them (LoRA's merged
    layers) holds one at a time. Tied weights share their slot; buffers left out of state dicts (rotary
    frequencies) are copied."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(model.config, dtype=_DTYPES[dtype])
    shapes = copy.state_dict(keep_vars=True)
    starts, total = {}, 0
    for tensor in shapes.values():
        if id(tensor) not in starts:  # each slice starts 128-byte aligned
            starts[id(tensor)], total = total, total + -(-tensor.numel() // 64) * 64
    flat = torch.empty(total, dtype=_DTYPES[dtype], device=next(model.parameters()).device)
    state = {
        name: flat[starts[id(tensor)] : starts[id(tensor)] + tensor.numel()].view(tensor.shape)
        for name, tensor in shapes.items()
    }
    filled = set()
    for name, tensor in weights:
        state[name].copy_(tensor)
        filled.add(name)
    if filled != set(state):
        raise ValueError(f"weights for a {type(copy).__name__} lack {sorted(set(state) - filled)[:3]}")
    copy.load_state_dict(state, assign=True)
    copy.tie_weights()
    for name, buffer in model.named_buffers():
        owner, _, attribute = name.rpartition(".")
        target = copy.get_submodule(owner)
        if getattr(target, attribute, None) is not None and getattr(target, attribute).is_meta:
            setattr(target, attribute, buffer.clone())
    return copy.eval()


def with_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """``model``, recomputing its decoder layers' activations in the backward pass when ``enabled``
    (``enable_gradient_checkpointing``): transformers' non-reentrant checkpointing, which FSDP2 and inputs
    that need no gradient both work with. Only a training forward pass checkpoints."""
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name for it
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_value_model(model: ModelConfig, *, seed: int):
    """Load ``model.path`` with a fresh scalar head per token (verl's critic: token classification, 1 label),
    initialised from ``seed``: every data-parallel rank must start from the same weights (FSDP2 shards what
    each rank holds; it does not broadcast), and a rerun from the same config starts the same. The head's
    dropout is off (transformers defaults it to 0.1, as verl turns it off): a value update must see the
    predictions the value pass made, not a random thinning of them."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    directory = local_model_dir(model.path)
    config = AutoConfig.from_pretrained(directory, num_labels=1, trust_remote_code=model.trust_remote_code)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_pretrained(
            directory, config=config, dtype=_DTYPES[model.dtype], trust_remote_code=model.trust_remote_code
        )
