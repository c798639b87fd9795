"""The architecture facts methods branch on (:class:`Arch`), and the model's attached head.

A leaf module shared by :mod:`lens_attrib.backend` and its backend modules
(:mod:`lens_attrib.backend_hooked`, :mod:`lens_attrib.backend_bridge`), which build an
:class:`Arch`; everything else imports these names from :mod:`lens_attrib.backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

Head = Callable[[Tensor], Tensor]
"""A head-on-top: ``[n, d_model]`` residual rows -> ``[n, n_out]`` outputs."""


@dataclass(frozen=True)
class MlmHead:
    """BERT's masked-LM transform ``LN(φ(x W + b))`` as its parts, for the rules that replace
    ``φ``'s output (the transform has no hook point between ``φ`` and the LayerNorm).

    ``entry``: the module whose first input is ``x``; ``weight [d_model, d_model]``, ``bias``:
    ``W`` and ``b``; ``act``: ``φ``; ``norm``: the LayerNorm module, whose first input is
    ``φ(h)``.
    """

    entry: Any
    weight: Tensor
    bias: Tensor
    act: Callable[[Tensor], Tensor]
    norm: Any


# --------------------------------------------------------------------------- architecture facts
def has_lm_head(model: Any) -> bool:
    """Whether token logits exist (False for encoders loaded without their MLM head)."""
    return not getattr(model, "lens_attrib_no_lm_head", False)


@dataclass(frozen=True)
class Arch:
    """The facts methods branch on, read once from the model's config."""

    encoder: bool
    lm_head: bool
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    normalization: str | None
    positional: str
    parallel: bool
    gated_mlp: bool
    dtype: torch.dtype
    n_ctx: int
    d_mlp: int = 0
    class_head: bool = False
    moe: bool = False
    logit_soft_cap: float = 0.0
    attn_soft_cap: float = 0.0
    post_norms: bool = False
    backend: str = "hooked"

    @property
    def causal(self) -> bool:
        return not self.encoder

    @property
    def rotary(self) -> bool:
        return self.positional == "rotary"

    @property
    def gqa(self) -> bool:
        return self.n_kv_heads != self.n_heads

    @property
    def learned_positions(self) -> bool:
        """A positional embedding is added to the residual stream (GPT-2, BERT)."""
        return self.encoder or self.positional in ("standard", "shortformer")

    @property
    def kind(self) -> str:
        if self.backend == "bridge":
            return "encoder (TransformerBridge)" if self.encoder else "decoder (TransformerBridge)"
        return "encoder (HookedEncoder)" if self.encoder else "decoder (HookedTransformer)"

    @property
    def work_dtype(self) -> torch.dtype:
        """float64 for float64 models, float32 otherwise (bf16/fp16 reductions are upcast)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def as_dict(self) -> dict[str, Any]:
        return {
            "encoder": self.encoder,
            "normalization": self.normalization,
            "positional": self.positional,
            "rotary": self.rotary,
            "gqa": self.gqa,
            "n_kv_heads": self.n_kv_heads,
            "parallel": self.parallel,
            "gated_mlp": self.gated_mlp,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "moe": self.moe,
            "logit_soft_cap": self.logit_soft_cap,
            "attn_soft_cap": self.attn_soft_cap,
            "post_norms": self.post_norms,
        }


def soft_cap(cap: float | None) -> float:
    """A soft-cap ``c`` (``c·tanh(x/c)``) when active, else 0 (TransformerLens: ``-1``/``None``)."""
    return float(cap) if cap is not None and cap > 0 else 0.0


CLASS_HEAD = "lens_attrib_class_head"
"""Attribute (a registered submodule) holding the sequence-classification head a loaded
``*ForSequenceClassification`` checkpoint came with
(:mod:`lens_attrib.classifiers.checkpoint_head`)."""


def attached_head(model: Any) -> Head | None:
    """The model's own classification/regression head, if it was loaded with one."""
    return cast("Head | None", getattr(model, CLASS_HEAD, None))


def arch_from_config(model: Any, *, encoder: bool, backend: str) -> Arch:
    """The facts every backend reads the same way from a TransformerLens-style ``model.cfg``
    (3.9's ``HookedTransformerConfig`` and 4's bridge config share these names); ``encoder`` and
    ``backend`` are what the backend itself knows."""
    cfg = model.cfg
    try:
        dtype = next(model.parameters()).dtype
    except StopIteration:  # pragma: no cover - a model always has parameters
        dtype = torch.float32
    return Arch(
        encoder=encoder,
        lm_head=has_lm_head(model),
        n_layers=int(cfg.n_layers),
        n_heads=int(cfg.n_heads),
        n_kv_heads=int(cfg.n_key_value_heads or cfg.n_heads),
        d_model=int(cfg.d_model),
        d_head=int(cfg.d_head),
        normalization=cfg.normalization_type,
        positional=str(cfg.positional_embedding_type),
        parallel=bool(getattr(cfg, "parallel_attn_mlp", False)),
        gated_mlp=bool(getattr(cfg, "gated_mlp", False)),
        dtype=dtype,
        n_ctx=int(cfg.n_ctx),
        d_mlp=int(cfg.d_mlp or 0),
        class_head=attached_head(model) is not None,
        moe=bool(getattr(cfg, "num_experts", None)),
        logit_soft_cap=soft_cap(getattr(cfg, "output_logits_soft_cap", None)),
        attn_soft_cap=soft_cap(getattr(cfg, "attn_scores_soft_cap", None)),
        post_norms=bool(getattr(cfg, "use_normalization_before_and_after", False)),
        backend=backend,
    )
