"""Every decoder family ``load_model(folder)`` builds, checked against transformers and run
through every registered method.

Tiny random checkpoints are saved by transformers inside the test
(:func:`lens_attrib.tiny_models.save_tiny_checkpoint`: no download). The oracle is the
transformers model read back from the same folder; in float64 it is made float64 throughout
(:func:`float64_throughout`), so agreement to 1e-10 shows that no weight, table or router passed
through float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib import load_model
from lens_attrib.tiny_models import save_tiny_checkpoint

F64 = torch.float64
FAMILIES = (
    "gpt2",
    "llama",
    "gpt_neox",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "mixtral",
)
TOLERANCE = {torch.float32: 1e-5, F64: 1e-10}
"""Relative to the largest |logit|: float32 rounding over two layers is ~1e-7."""


def float64_throughout(hf_model: Any) -> Any:
    """Make a transformers model compute in float64 where it forces float32, in place.

    - RMSNorm (``x.to(float32)``): ``w ⊙ x / sqrt(mean(x²) + eps)`` in the input dtype; Gemma's
      variant with gain ``1 + w``;
    - rotary tables: ``cos/sin(pos · base^(−2i/d))`` computed in float64;
    - Gemma's embedding scale (a float32 buffer ``√d``): ``√d`` in float64;
    - the mixture-of-experts router (``softmax(logits.float())``): softmax in float64.

    Eager attention's ``softmax(..., dtype=float32)`` (Gemma 2) is handled at call time by
    :func:`softmax_keeps_float64`.
    """
    for module in hf_model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            gemma = kind.startswith("Gemma")
            eps = module.eps if gemma else module.variance_epsilon

            def rms(x: torch.Tensor, norm: Any = module, eps: float = eps, gemma: bool = gemma):
                normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                return normed * (1.0 + norm.weight) if gemma else norm.weight * normed

            module.forward = rms
        elif kind.endswith("RotaryEmbedding"):
            dim = 2 * module.inv_freq.numel()
            base = module.config.rope_parameters["rope_theta"]
            inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)

            def rotary(x: torch.Tensor, position_ids: torch.Tensor, inv: Any = inv, rot: Any = module):
                angles = position_ids[..., None].to(F64) * inv
                angles = torch.cat((angles, angles), dim=-1)
                scale = rot.attention_scaling
                return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)

            module.forward = rotary
        elif kind.endswith("ScaledWordEmbedding"):
            module.embed_scale = torch.tensor(module.embedding_dim**0.5, dtype=F64)
        elif kind.endswith("TopKRouter"):

            def route(x: torch.Tensor, router: Any = module):
                x = x.reshape(-1, router.hidden_dim)
                logits = torch.nn.functional.linear(x, router.weight)
                top, idx = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
                return logits, top / top.sum(dim=-1, keepdim=True), idx

            module.forward = route
    return hf_model


@contextmanager
def softmax_keeps_float64() -> Iterator[None]:
    """``F.softmax(x, dtype=float32)`` of a float64 ``x`` stays float64 (eager attention)."""
    original = torch.nn.functional.softmax

    def softmax(x: torch.Tensor, *args: Any, dtype: Any = None, **kwargs: Any) -> torch.Tensor:
        return original(x, *args, dtype=None if x.dtype == F64 else dtype, **kwargs)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


def reference_logits(hf_model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad(), softmax_keeps_float64():
        return hf_model(ids, **kwargs).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_tiny_checkpoint(f, root / f"tiny-{f}") for f in (*FAMILIES, "qwen2_moe")}


def reference(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": "eager"} if "mixtral" in folder.name else {}
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    return float64_throughout(hf_model) if dtype == F64 else hf_model


IDS = torch.tensor([[2, 30, 41, 25, 60, 8, 33, 70, 12, 52]])  # longer than the 3-token windows


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(folders, family, dtype):
    model = load_model(str(folders[family]), dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    hf_model = reference(folders[family], dtype)
    with torch.no_grad():
        ours = model(IDS)
    ref = reference_logits(hf_model, IDS)
    assert ours.dtype == dtype
    worst = float((ours - ref).abs().max() / ref.abs().max())
    assert worst <= TOLERANCE[dtype], f"{family} {dtype}: max relative |Δ| = {worst:.3e}"
