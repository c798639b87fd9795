"""The tiny models of :mod:`lens_attrib.tiny_models` as Hugging Face checkpoints, so that
TransformerLens 4 (which has no ``HookedTransformer`` to build them in) loads the same functions
on its ``TransformerBridge``.

A tiny model is defined by TransformerLens 3.9's parameters: :func:`hooked_parameter_shapes`
lists ``HookedTransformer``'s (``HookedEncoder``'s) parameter names and shapes in their order,
each is drawn from one seeded generator by :func:`lens_attrib.tiny_spec.draw_parameter` and
rounded to float32 (the tiny models are built in float32, then cast), and
:func:`hf_state_dict` lays them out as transformers' checkpoint of the same architecture (the
inverse of TransformerLens 3.9's weight conversion: ``W_Q [head, d_model, d_head]`` →
``q_proj.weight [(head d_head), d_model]``, GPT-2's ``Conv1D`` weights ``[in, out]``, GPT-NeoX's
fused ``query_key_value`` in ``(head qkv d_head)`` order, BERT's MLM transform and decoder).

Two facts of the tiny models are not in a transformers checkpoint, and :func:`load_tiny` sets
them on the loaded model (either backend):

- GPT-2's and GPT-NeoX's unembedding bias ``b_U`` (their LM heads have none; the bridge keeps a
  zero ``bias`` buffer on the head, which is filled; saved as :data:`EXTRA_FILE` in the folder);
- the rotary tables, which TransformerLens 3.9 computes in float32 when the model is built (then
  casts): ``angles = pos / base^(2i/rotary_dim)`` in float32, ``cos``/``sin`` of them
  (:func:`rotary_tables`), indexed by position.

Settings transformers cannot express (no norms, a rotary dimension Llama cannot take, …) raise a
``ModelError`` naming the override. Folders are cached under the temporary directory, keyed by
the arguments and this code (:func:`tiny_folder`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.errors import ModelError
from lens_attrib.tiny_spec import decoder_config, draw_parameter, encoder_config, tiny_tokenizer

EXTRA_FILE = "lens_attrib_tiny.safetensors"
"""The tiny model's settings a transformers checkpoint has no place for (``unembed.b_U``)."""

HF_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "pythia": "GPTNeoXForCausalLM",
    "bert": "BertForMaskedLM",
}

HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_fast",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
}
"""TransformerLens ``act_fn`` → transformers' name of the same function."""

SIZE_FIELDS = ("d_model", "d_head", "n_heads", "d_mlp", "n_layers", "n_ctx", "d_vocab", "seed")
BASE_FIELDS = ("device", "dtype", "act_fn", "default_prepend_bos", *SIZE_FIELDS)
VARIABLE_FIELDS: dict[str, tuple[str, ...]] = {
    "gpt2": BASE_FIELDS,
    "llama": (*BASE_FIELDS, "n_key_value_heads", "rotary_dim", "rotary_base"),
    "pythia": (*BASE_FIELDS, "rotary_dim", "rotary_base"),
    "bert": (*SIZE_FIELDS, "device", "dtype"),
}
"""Config fields each checkpoint can take any (valid) value of; every other field must keep the
tiny model's default."""


# --------------------------------------------------------------------------- the tiny model
def tiny_config(kind: str, seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The HookedTransformerConfig fields of tiny model ``kind`` with ``overrides``, checked
    against what the transformers checkpoint of ``kind`` expresses."""
    if kind == "bert":
        defaults, cfg = encoder_config(seed, {}), encoder_config(seed, overrides)
    else:
        defaults, cfg = decoder_config(kind, seed, {}), decoder_config(kind, seed, overrides)
    builder = f"tiny_{kind}"
    for name, value in overrides.items():
        if name in VARIABLE_FIELDS[kind] or (name in defaults and defaults[name] == value):
            continue
        raise ModelError(
            f"{builder}({name}={value!r}) has no {HF_ARCHITECTURES[kind]} checkpoint to express "
            f"it, so the TransformerBridge cannot build it: build it with backend='hooked' "
            f"(TransformerLens 3.9), or leave {name} at {defaults.get(name, 'its default')!r}."
        )
    if cfg["d_model"] != cfg["n_heads"] * cfg["d_head"] and kind != "llama":
        raise ModelError(
            f"{builder}(d_model={cfg['d_model']}, n_heads={cfg['n_heads']}, "
            f"d_head={cfg['d_head']}): {HF_ARCHITECTURES[kind]} needs d_model = n_heads · d_head."
        )
    if cfg.get("act_fn") not in HF_ACTIVATIONS or (kind == "bert" and cfg["act_fn"] != "gelu"):
        raise ModelError(
            f"{builder}(act_fn={cfg.get('act_fn')!r}): the checkpoint takes one of "
            f"{sorted(HF_ACTIVATIONS) if kind != 'bert' else ['gelu']}."
        )
    if kind == "llama" and cfg["rotary_dim"] != cfg["d_head"]:
        raise ModelError(
            f"tiny_llama(rotary_dim={cfg['rotary_dim']}): LlamaForCausalLM rotates the whole "
            f"head; use rotary_dim = d_head ({cfg['d_head']})."
        )
    return cfg


def hooked_parameter_shapes(kind: str, cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """TransformerLens 3.9's parameter names and shapes of the tiny model, in
    ``named_parameters()`` order (the order :func:`draw_tiny_parameters` draws them in)."""
    d, h, n, m = cfg["d_model"], cfg["d_head"], cfg["n_heads"], cfg["d_mlp"]
    vocab, ctx = cfg["d_vocab"], cfg["n_ctx"]
    norm = cfg.get("normalization_type")

    def ln(prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        if norm == "LN":
            return [(f"{prefix}.w", (d,)), (f"{prefix}.b", (d,))]
        return [(f"{prefix}.w", (d,))] if norm == "RMS" else []

    def attn(prefix: str, kv: int, grouped: bool) -> list[tuple[str, tuple[int, ...]]]:
        g = "_" if grouped else ""
        return [
            (f"{prefix}.W_Q", (n, d, h)),
            (f"{prefix}.W_O", (n, h, d)),
            (f"{prefix}.b_Q", (n, h)),
            (f"{prefix}.b_O", (d,)),
            (f"{prefix}.{g}W_K", (kv, d, h)),
            (f"{prefix}.{g}W_V", (kv, d, h)),
            (f"{prefix}.{g}b_K", (kv, h)),
            (f"{prefix}.{g}b_V", (kv, h)),
        ]

    def mlp(prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        names: list[tuple[str, tuple[int, ...]]]
        if cfg.get("gated_mlp"):
            names = [("W_in", (d, m)), ("W_out", (m, d)), ("W_gate", (d, m))]
            names += [("b_in", (m,)), ("b_out", (d,))]
        else:
            names = [("W_in", (d, m)), ("b_in", (m,)), ("W_out", (m, d)), ("b_out", (d,))]
        return [(f"{prefix}.{name}", shape) for name, shape in names]

    if kind == "bert":
        shapes = [
            ("embed.embed.W_E", (vocab, d)),
            ("embed.pos_embed.W_pos", (ctx, d)),
            ("embed.token_type_embed.W_token_type", (2, d)),
            *ln("embed.ln"),
        ]
        for layer in range(cfg["n_layers"]):
            block = f"blocks.{layer}"
            shapes += attn(f"{block}.attn", n, False) + ln(f"{block}.ln1")
            shapes += mlp(f"{block}.mlp") + ln(f"{block}.ln2")
        shapes += [("mlm_head.W", (d, d)), ("mlm_head.b", (d,)), *ln("mlm_head.ln")]
        shapes += [("unembed.W_U", (d, vocab)), ("unembed.b_U", (vocab,))]
        heads = [("nsp_head.W", (d, 2)), ("nsp_head.b", (2,)), ("pooler.W", (d, d))]
        return [*shapes, *heads, ("pooler.b", (d,))]
    shapes = [("embed.W_E", (vocab, d))]
    if cfg["positional_embedding_type"] == "standard":
        shapes.append(("pos_embed.W_pos", (ctx, d)))
    kv_heads = cfg.get("n_key_value_heads")
    for layer in range(cfg["n_layers"]):
        block = f"blocks.{layer}"
        shapes += ln(f"{block}.ln1") + ln(f"{block}.ln2")
        shapes += attn(f"{block}.attn", kv_heads or n, kv_heads is not None)
        shapes += mlp(f"{block}.mlp")
    return shapes + ln("ln_final") + [("unembed.W_U", (d, vocab)), ("unembed.b_U", (vocab,))]


def draw_tiny_parameters(kind: str, cfg: dict[str, Any], seed: int) -> dict[str, Tensor]:
    """The tiny model's parameters by TransformerLens name, float32 (as the tiny model is built):
    drawn in order from ``Generator().manual_seed(seed)``; Llama's biases zero."""
    gen = torch.Generator().manual_seed(seed)
    params = {
        name: draw_parameter(name, shape, gen).to(torch.float32)
        for name, shape in hooked_parameter_shapes(kind, cfg)
    }
    if kind == "llama":  # Llama has no biases (tiny_models.zero_biases)
        for name, value in params.items():
            if name.split(".")[-1].lstrip("_").startswith("b"):
                value.zero_()
    return params


# --------------------------------------------------------------------------- transformers layout
def _heads_in(w: Tensor) -> Tensor:
    """``[head, d_model, d_head]`` → a ``Linear`` weight ``[(head d_head), d_model]``."""
    return einops.rearrange(w, "n m h -> (n h) m")


def _heads_out(w: Tensor) -> Tensor:
    """``W_O [head, d_head, d_model]`` → a ``Linear`` weight ``[d_model, (head d_head)]``."""
    return einops.rearrange(w, "n h m -> m (n h)")


def _flat(b: Tensor) -> Tensor:
    return einops.rearrange(b, "n h -> (n h)")


def _norm(sd: dict[str, Tensor], hf: str, p: dict[str, Tensor], tl: str) -> None:
    sd[f"{hf}.weight"] = p[f"{tl}.w"]
    if f"{tl}.b" in p:
        sd[f"{hf}.bias"] = p[f"{tl}.b"]


def hf_state_dict(kind: str, cfg: dict[str, Any], p: dict[str, Tensor]) -> dict[str, Tensor]:
    """The transformers state dict of ``kind`` holding the TransformerLens parameters ``p``."""
    sd: dict[str, Tensor] = {}
    layers = range(cfg["n_layers"])
    if kind == "gpt2":
        sd["transformer.wte.weight"] = p["embed.W_E"]
        sd["transformer.wpe.weight"] = p["pos_embed.W_pos"]
        for i in layers:
            tl, hf = f"blocks.{i}", f"transformer.h.{i}"
            _norm(sd, f"{hf}.ln_1", p, f"{tl}.ln1")
            _norm(sd, f"{hf}.ln_2", p, f"{tl}.ln2")
            qkv = [p[f"{tl}.attn.W_{x}"] for x in "QKV"]  # Conv1D: [in, out]
            sd[f"{hf}.attn.c_attn.weight"] = torch.cat([_heads_in(w).T for w in qkv], dim=1)
            sd[f"{hf}.attn.c_attn.bias"] = torch.cat([_flat(p[f"{tl}.attn.b_{x}"]) for x in "QKV"])
            sd[f"{hf}.attn.c_proj.weight"] = _heads_out(p[f"{tl}.attn.W_O"]).T
            sd[f"{hf}.attn.c_proj.bias"] = p[f"{tl}.attn.b_O"]
            sd[f"{hf}.mlp.c_fc.weight"] = p[f"{tl}.mlp.W_in"]
            sd[f"{hf}.mlp.c_fc.bias"] = p[f"{tl}.mlp.b_in"]
            sd[f"{hf}.mlp.c_proj.weight"] = p[f"{tl}.mlp.W_out"]
            sd[f"{hf}.mlp.c_proj.bias"] = p[f"{tl}.mlp.b_out"]
        _norm(sd, "transformer.ln_f", p, "ln_final")
    elif kind == "llama":
        sd["model.embed_tokens.weight"] = p["embed.W_E"]
        g = "_" if cfg.get("n_key_value_heads") is not None else ""
        for i in layers:
            tl, hf = f"blocks.{i}", f"model.layers.{i}"
            _norm(sd, f"{hf}.input_layernorm", p, f"{tl}.ln1")
            _norm(sd, f"{hf}.post_attention_layernorm", p, f"{tl}.ln2")
            sd[f"{hf}.self_attn.q_proj.weight"] = _heads_in(p[f"{tl}.attn.W_Q"])
            sd[f"{hf}.self_attn.k_proj.weight"] = _heads_in(p[f"{tl}.attn.{g}W_K"])
            sd[f"{hf}.self_attn.v_proj.weight"] = _heads_in(p[f"{tl}.attn.{g}W_V"])
            sd[f"{hf}.self_attn.o_proj.weight"] = _heads_out(p[f"{tl}.attn.W_O"])
            sd[f"{hf}.mlp.up_proj.weight"] = p[f"{tl}.mlp.W_in"].T
            sd[f"{hf}.mlp.gate_proj.weight"] = p[f"{tl}.mlp.W_gate"].T
            sd[f"{hf}.mlp.down_proj.weight"] = p[f"{tl}.mlp.W_out"].T
        _norm(sd, "model.norm", p, "ln_final")
    elif kind == "pythia":
        sd["gpt_neox.embed_in.weight"] = p["embed.W_E"]
        for i in layers:
            tl, hf = f"blocks.{i}", f"gpt_neox.layers.{i}"
            _norm(sd, f"{hf}.input_layernorm", p, f"{tl}.ln1")
            _norm(sd, f"{hf}.post_attention_layernorm", p, f"{tl}.ln2")
            w = torch.stack([p[f"{tl}.attn.W_{x}"] for x in "QKV"])
            b = torch.stack([p[f"{tl}.attn.b_{x}"] for x in "QKV"])
            att = f"{hf}.attention"
            sd[f"{att}.query_key_value.weight"] = einops.rearrange(w, "q n m h -> (n q h) m")
            sd[f"{att}.query_key_value.bias"] = einops.rearrange(b, "q n h -> (n q h)")
            sd[f"{att}.dense.weight"] = _heads_out(p[f"{tl}.attn.W_O"])
            sd[f"{att}.dense.bias"] = p[f"{tl}.attn.b_O"]
            sd[f"{hf}.mlp.dense_h_to_4h.weight"] = p[f"{tl}.mlp.W_in"].T
            sd[f"{hf}.mlp.dense_h_to_4h.bias"] = p[f"{tl}.mlp.b_in"]
            sd[f"{hf}.mlp.dense_4h_to_h.weight"] = p[f"{tl}.mlp.W_out"].T
            sd[f"{hf}.mlp.dense_4h_to_h.bias"] = p[f"{tl}.mlp.b_out"]
        _norm(sd, "gpt_neox.final_layer_norm", p, "ln_final")
    else:
        _bert_state_dict(sd, cfg, p)
        return {k: v.contiguous() for k, v in sd.items()}
    sd["lm_head.weight"] = p["unembed.W_U"].T
    return {k: v.contiguous() for k, v in sd.items()}


def _bert_state_dict(sd: dict[str, Tensor], cfg: dict[str, Any], p: dict[str, Tensor]) -> None:
    emb = "bert.embeddings"
    sd[f"{emb}.word_embeddings.weight"] = p["embed.embed.W_E"]
    sd[f"{emb}.position_embeddings.weight"] = p["embed.pos_embed.W_pos"]
    sd[f"{emb}.token_type_embeddings.weight"] = p["embed.token_type_embed.W_token_type"]
    _norm(sd, f"{emb}.LayerNorm", p, "embed.ln")
    for i in range(cfg["n_layers"]):
        tl, hf = f"blocks.{i}", f"bert.encoder.layer.{i}"
        for x, name in zip("QKV", ("query", "key", "value"), strict=True):
            sd[f"{hf}.attention.self.{name}.weight"] = _heads_in(p[f"{tl}.attn.W_{x}"])
            sd[f"{hf}.attention.self.{name}.bias"] = _flat(p[f"{tl}.attn.b_{x}"])
        sd[f"{hf}.attention.output.dense.weight"] = _heads_out(p[f"{tl}.attn.W_O"])
        sd[f"{hf}.attention.output.dense.bias"] = p[f"{tl}.attn.b_O"]
        _norm(sd, f"{hf}.attention.output.LayerNorm", p, f"{tl}.ln1")
        sd[f"{hf}.intermediate.dense.weight"] = p[f"{tl}.mlp.W_in"].T
        sd[f"{hf}.intermediate.dense.bias"] = p[f"{tl}.mlp.b_in"]
        sd[f"{hf}.output.dense.weight"] = p[f"{tl}.mlp.W_out"].T
        sd[f"{hf}.output.dense.bias"] = p[f"{tl}.mlp.b_out"]
        _norm(sd, f"{hf}.output.LayerNorm", p, f"{tl}.ln2")
    head = "cls.predictions"
    sd[f"{head}.transform.dense.weight"] = p["mlm_head.W"].T
    sd[f"{head}.transform.dense.bias"] = p["mlm_head.b"]
    _norm(sd, f"{head}.transform.LayerNorm", p, "mlm_head.ln")
    sd[f"{head}.decoder.weight"] = p["unembed.W_U"].T
    sd[f"{head}.bias"] = p["unembed.b_U"]
    sd[f"{head}.decoder.bias"] = p["unembed.b_U"]  # the same tensor in BertLMPredictionHead


def hf_config(kind: str, cfg: dict[str, Any]) -> Any:
    """The transformers config of the tiny model (dropout off, TransformerLens' ε = 1e-5,
    untied unembedding)."""
    import transformers

    eps = cfg.get("eps", 1e-5)
    common: dict[str, Any] = {"vocab_size": cfg["d_vocab"], "tie_word_embeddings": False}
    act = HF_ACTIVATIONS[cfg["act_fn"]]
    if kind == "bert":
        return transformers.BertConfig(
            **common,
            hidden_size=cfg["d_model"],
            num_hidden_layers=cfg["n_layers"],
            num_attention_heads=cfg["n_heads"],
            intermediate_size=cfg["d_mlp"],
            hidden_act=act,
            max_position_embeddings=cfg["n_ctx"],
            type_vocab_size=2,
            layer_norm_eps=eps,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
            architectures=["BertForMaskedLM"],
        )
    common.update(bos_token_id=2, eos_token_id=3, pad_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2Config(
            **common,
            n_positions=cfg["n_ctx"],
            n_embd=cfg["d_model"],
            n_layer=cfg["n_layers"],
            n_head=cfg["n_heads"],
            n_inner=cfg["d_mlp"],
            activation_function=act,
            layer_norm_epsilon=eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            architectures=["GPT2LMHeadModel"],
        )
    sizes = {
        "hidden_size": cfg["d_model"],
        "intermediate_size": cfg["d_mlp"],
        "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["n_heads"],
        "max_position_embeddings": cfg["n_ctx"],
        "hidden_act": act,
    }
    if kind == "llama":
        return transformers.LlamaConfig(
            **common,
            **sizes,
            num_key_value_heads=cfg.get("n_key_value_heads") or cfg["n_heads"],
            head_dim=cfg["d_head"],
            rms_norm_eps=eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rotary_base"])},
            attention_bias=False,
            mlp_bias=False,
            architectures=["LlamaForCausalLM"],
        )
    return transformers.GPTNeoXConfig(
        **common,
        **sizes,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(cfg.get("rotary_base", 10000)),
            "partial_rotary_factor": cfg["rotary_dim"] / cfg["d_head"],
        },
        layer_norm_eps=eps,
        use_parallel_residual=True,
        attention_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        architectures=["GPTNeoXForCausalLM"],
    )


# --------------------------------------------------------------------------- folders
def _cache_key(kind: str, seed: int, overrides: dict[str, Any]) -> str:
    """Digest of the arguments, this code and :mod:`lens_attrib.tiny_spec` (the draws)."""
    import transformers

    from lens_attrib import tiny_spec

    code = Path(__file__).read_bytes() + Path(tiny_spec.__file__).read_bytes()
    described = json.dumps(
        {
            "kind": kind,
            "seed": seed,
            "overrides": {k: repr(v) for k, v in sorted(overrides.items())},
            "code": hashlib.sha256(code).hexdigest(),
            "transformers": transformers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def tiny_root() -> Path:
    """Where tiny checkpoints are cached: ``$LENS_ATTRIB_TINY_DIR`` or the temporary folder."""
    root = os.environ.get("LENS_ATTRIB_TINY_DIR") or tempfile.gettempdir()
    return Path(root) / "lens_attrib_tiny"


def tiny_folder(kind: str, seed: int = 0, **overrides: Any) -> Path:
    """The transformers folder of tiny model ``kind`` (``gpt2``, ``llama``, ``pythia``,
    ``bert``): written once per arguments (``save_pretrained``, float32, with the word-level
    tokenizer and :data:`EXTRA_FILE`), renamed into place so that parallel writers never see a
    partial folder."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BertForMaskedLM

    if kind not in HF_ARCHITECTURES:
        raise ModelError(f"No tiny model {kind!r}: one of {sorted(HF_ARCHITECTURES)}.")
    cfg = tiny_config(kind, seed, overrides)
    folder = tiny_root() / f"{kind}-{_cache_key(kind, seed, overrides)}"
    if (folder / EXTRA_FILE).is_file():
        return folder
    params = draw_tiny_parameters(kind, cfg, seed)
    config = hf_config(kind, cfg)
    with torch.device("cpu"):
        if kind == "bert":
            model = BertForMaskedLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_state_dict(kind, cfg, params), strict=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(partial)
        tiny_tokenizer(encoder=kind == "bert").save_pretrained(partial)
        save_file({"unembed.b_U": params["unembed.b_U"].contiguous()}, partial / EXTRA_FILE)
        os.replace(partial, folder)
    except OSError:  # another process renamed its folder into place first
        if not (folder / EXTRA_FILE).is_file():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def load_tiny(
    kind: str, seed: int, dtype: torch.dtype, overrides: dict[str, Any], backend: str | None
) -> Any:
    """``load_model(tiny_folder(...), dtype=dtype, backend=backend)`` with the tiny model's
    unembedding bias, float32 rotary tables and ``default_prepend_bos`` set: the function of
    :mod:`lens_attrib.tiny_models`' HookedTransformer of the same arguments."""
    from safetensors.torch import load_file

    from lens_attrib.backend import is_bridge
    from lens_attrib.models import load_model

    cfg = tiny_config(kind, seed, overrides)
    folder = tiny_folder(kind, seed, **overrides)
    model = load_model(str(folder), dtype=dtype, backend=backend)
    b_u = load_file(folder / EXTRA_FILE)["unembed.b_U"]
    bridge = is_bridge(model)
    with torch.no_grad():
        head_bias = model.unembed.original_component.bias if bridge else model.unembed.b_U
        head_bias.copy_(b_u)
    if cfg.get("positional_embedding_type") == "rotary":
        cos, sin = rotary_tables(cfg["rotary_dim"], cfg["n_ctx"], cfg.get("rotary_base", 10000))
        if bridge:
            use_rotary_tables(model, cos, sin)
        else:
            for block in model.blocks:
                block.attn.rotary_cos = cos.to(dtype)
                block.attn.rotary_sin = sin.to(dtype)
    if kind != "bert":
        model.cfg.default_prepend_bos = cfg["default_prepend_bos"]
    model.cfg.model_name = f"tiny_{kind}"
    return model


# --------------------------------------------------------------------------- rotary tables
def rotary_tables(
    rotary_dim: int, n_ctx: int, base: float = 10000
) -> tuple[Float[Tensor, "n_ctx rotary_dim"], Float[Tensor, "n_ctx rotary_dim"]]:
    """``cos``, ``sin`` of ``angles[p, j] = p / base^(2 (j mod rotary_dim/2) / rotary_dim)`` in
    float32, halves repeated (``rotate_half`` pairs), as TransformerLens 3.9 builds a float32
    model's rotary tables (Su et al., 2021, RoFormer)."""
    pos = torch.arange(n_ctx, dtype=torch.float32)
    dim = torch.arange(rotary_dim // 2, dtype=torch.float32)
    freq = einops.repeat(base ** (dim / (rotary_dim / 2)), "d -> (2 d)")
    angles = pos[:, None] / freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def use_rotary_tables(model: Any, cos: Tensor, sin: Tensor) -> None:
    """Every Hugging Face rotary embedding of the bridge ``model`` returns rows of these tables
    (indexed by position) instead of computing its own."""
    for module in model.original_model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.lens_attrib_tables = (cos, sin)
            module.forward = types.MethodType(_table_rotary_forward, module)


def _table_rotary_forward(rotary: Any, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = rotary.lens_attrib_tables
    if position_ids.numel() and (position_ids.min() < 0 or position_ids.max() >= len(cos)):
        raise ModelError(f"Positions beyond the tiny model's {len(cos)} rotary positions.")
    ids = position_ids.to(cos.device)
    return cos[ids].to(device=x.device, dtype=x.dtype), sin[ids].to(device=x.device, dtype=x.dtype)
