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
from tests.tl_versions import hooked_only

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
    - the mixture-of-experts router (``softmax(logits.float())``): softmax in float64 (top-k
      weights renormalised where the router does: Mixtral, Qwen-MoE with ``norm_topk_prob``).

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

            def rotary(
                x: torch.Tensor, position_ids: torch.Tensor, inv: Any = inv, rot: Any = module
            ):
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
                if getattr(router, "norm_topk_prob", True):  # Mixtral always; Qwen-MoE: config
                    top = top / top.sum(dim=-1, keepdim=True)
                return logits, top, idx

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


# --------------------------------------------------------------------------- every method
IDS_BATCH = [[2, 30, 41, 25, 60, 8, 19], [2, 33, 70, 12, 52]]
"""Token ids (the word-level tokenizer is not what transformers builds for every family): the
second row is left-padded in the batch; both are longer than the 3-token sliding windows."""
METHOD_FAMILIES = ("mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "mixtral")
"""GPT-2, Llama and NeoX shapes run every method in the method tests (lens_attrib.tiny_models)."""
FAST_OPTIONS: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"n_steps": 16},
    "reagent": {"max_probe_steps": 4, "num_probes": 1},
}


@pytest.fixture(scope="module")
def models64(folders) -> dict[str, Any]:
    return {f: load_model(str(folders[f]), dtype=F64) for f in METHOD_FAMILIES}


def refusal(model: Any, method: str) -> str | None:
    """Why ``method`` must refuse this model (``None``: it must run)."""
    from lens_attrib.backend import ARCHITECTURE_LIMITS, arch_of
    from lens_attrib.methods.registry import METHODS

    arch = arch_of(model)
    if not METHODS[method].decoder:
        return "does not apply to a decoder"
    for fact, refused in ARCHITECTURE_LIMITS.items():
        if getattr(arch, fact) and method in refused:
            return "does not apply to this model"
    if arch.logit_soft_cap and method in ("alti_logit", "logat", "normxlogit"):
        return "soft-caps its logits"
    return None


def _method_names() -> list[str]:
    from lens_attrib.methods.registry import METHODS

    return list(METHODS)


@pytest.mark.parametrize("method", _method_names())
@pytest.mark.parametrize("family", METHOD_FAMILIES)
def test_method_runs_batched_equal_single_or_refuses(models64, family, method):
    """The method runs (the padded row equals its unbatched run, the model is unchanged) or
    raises an error naming a registered method that does run on this model."""
    from lens_attrib import attribute
    from lens_attrib.hooks.guard import model_state_fingerprint
    from lens_attrib.methods.registry import METHODS

    model = models64[family]
    options = FAST_OPTIONS.get(method, {})
    before = model_state_fingerprint(model)
    why = refusal(model, method)
    if why is not None:
        with pytest.raises(Exception, match=why) as err:
            attribute(model, IDS_BATCH, method=method, **options)
        assert model_state_fingerprint(model) == before
        named = [m for m in METHODS if f"'{m}'" in str(err.value) and m != method]
        assert named, f"the error names no other method: {err.value}"
        assert any(refusal(model, m) is None for m in named), named  # one that applies
        return
    batched = attribute(model, IDS_BATCH, method=method, **options)
    assert model_state_fingerprint(model) == before
    assert torch.isfinite(batched.scores).all()
    assert bool(batched.mask[1, 0]) is False  # the short row is left-padded
    single = attribute(model, IDS_BATCH[1:], method=method, **options)
    ours, ref = batched.scores[1][batched.mask[1]], single.scores[0]
    assert ours.shape == ref.shape == (len(IDS_BATCH[1]),)
    if method not in ("random", "reagent"):  # random draws per call
        gap = float((ours - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
        assert gap <= 1e-8, f"batched != single: {gap:.2e}"


# --------------------------------------------------------------------------- oracles per family
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", ["mistral", "qwen3", "phi3", "gemma", "mixtral"])
def test_lrp_conserves_without_biases(models64, family):
    """CP-LRP with the exact identity rule: with no biases (these families have none) the
    detached network is linear, so the relevances sum to the explained logit. In Mixtral this
    holds only because the routing weights are detached like a gate (a router that passed
    relevance on would add its share)."""
    from lens_attrib import attribute

    a = attribute(models64[family], IDS_BATCH, method="lrp", identity_eps=0.0)
    value = a.meta["explained_value"]
    assert _rel(a.scores.sum(-1), value) <= 1e-10


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3", "gemma", "mixtral"])
def test_alti_logit_decomposition_is_exact(models64, family):
    """Token, MLP (Mixtral: the experts' weighted sum at the target position, a token-wise map
    like any MLP), bias and embedding terms add up to the model's own logit."""
    from lens_attrib import attribute

    model = models64[family]
    a = attribute(model, IDS_BATCH, method="alti_logit")
    p = a.parts
    total = a.scores.sum(-1) + p["mlp"].sum(-1) + p["attn_bias"].sum(-1) + p["embedding"]
    total = total + p["bias"]
    with torch.no_grad():
        logits = model(a.token_ids, attention_mask=a.mask.long())
    rows = logits[torch.arange(2), a.target.positions]
    logit = rows[torch.arange(2), a.target.token_ids]
    assert _rel(p["logit"], logit) <= 1e-12
    assert _rel(total, logit) <= 1e-10


@hooked_only("calls a HookedTransformer MoE module directly with hooks")
def test_attnlrp_moe_rule_is_the_gate_rule_through_the_router(models64):
    """AttnLRP through one Mixtral MoE block equals an independent statement of the rule:

    ``out = Σ_e w_e · E_e(x)`` with the uniform rule on each product ``w_e · E_e`` (half of the
    relevance through the router, half through the expert) and, inside the expert, the uniform
    rule on ``φ(g) ⊙ u`` with the identity rule through ``φ`` — written here with detaches only,
    as ``½ w_e·Ẽ_e(x) + ½ w_e(x)·E_e`` where ``Ẽ_e = W_out(½ g·[φ(g)/g] ⊙ u + ½ φ(g) ⊙ u)``
    (bracketed and unmarked factors are constants of the forward pass). Relevance of the input
    is ``x ⊙ ∂(c·out)/∂x`` for a random readout ``c``."""
    from lens_attrib.hooks.lrp import lrp_hooks

    model = models64["mixtral"]
    moe = model.blocks[0].mlp
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, model.cfg.d_model, generator=gen, dtype=F64)
    readout = torch.randn(1, 5, model.cfg.d_model, generator=gen, dtype=F64)
    every = lrp_hooks(model, "attnlrp", identity_eps=0.0)
    hooks = [(n, h) for n, h in every if n.startswith("blocks.0.mlp")]
    assert any(n.endswith("hook_expert_weights") for n, _ in hooks)
    ours_x = x.clone().requires_grad_(True)
    with model.hooks(fwd_hooks=hooks):
        out = moe(ours_x)
    (out * readout).sum().backward()
    ours = ours_x * ours_x.grad

    ref_x = x.clone().requires_grad_(True)
    rows = ref_x.reshape(-1, model.cfg.d_model)
    probs = torch.softmax(moe.W_gate(rows), dim=-1)
    top, chosen = torch.topk(probs, model.cfg.experts_per_token, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    via_expert, via_router = torch.zeros_like(rows), torch.zeros_like(rows)
    for e, expert in enumerate(moe.experts):
        token, slot = torch.where(chosen == e)
        h = rows[token]
        g, u = expert.W_gate(h), expert.W_in(h)
        act = torch.nn.functional.silu(g)
        linear_act = g * (act / g).detach()  # identity rule through φ
        inner = 0.5 * linear_act * u.detach() + 0.5 * act.detach() * u
        w = weights[token, slot, None]
        expert_out = expert.W_out(act * u)
        via_expert = via_expert.index_add(0, token, 0.5 * w.detach() * expert.W_out(inner))
        via_router = via_router.index_add(0, token, 0.5 * w * expert_out.detach())
    total = (via_expert + via_router).reshape(1, 5, -1)
    assert _rel(total.detach(), out.detach()) <= 1e-13  # the same forward value
    ref = ref_x * torch.autograd.grad((total * readout).sum(), ref_x, retain_graph=True)[0]
    assert _rel(ours.detach(), ref.detach()) <= 1e-12
    # the router's half is far above the tolerance: detaching the router would fail the check
    router = ref_x * torch.autograd.grad((via_router.reshape(1, 5, -1) * readout).sum(), ref_x)[0]
    assert float(router.detach().abs().sum()) > 1e-3 * float(ref.detach().abs().sum())


def test_gemma2_target_is_the_soft_capped_logit(models64):
    """The default head applies Gemma 2's final soft-cap ``c·tanh(u/c)``: the explained value is
    the model's own logit difference; methods that need no linear head still take token targets."""
    from lens_attrib import Target, attribute

    model = models64["gemma2"]
    cap = model.cfg.output_logits_soft_cap
    a = attribute(model, IDS_BATCH, Target(token=5, foil=7), method="grad_x_input")
    with torch.no_grad():
        logits = model(a.token_ids, attention_mask=a.mask.long())
    rows = logits[torch.arange(2), a.target.positions]
    assert _rel(a.meta["explained_value"], rows[:, 5] - rows[:, 7]) <= 1e-12
    with torch.no_grad():
        uncapped = model(a.token_ids, attention_mask=a.mask.long(), return_type="logits")
    assert float(uncapped.abs().max()) < cap  # tanh saturates below the cap
    norms = attribute(model, IDS_BATCH, Target(token=5), method="embed_norm")
    assert torch.isfinite(norms.scores).all()


LOW_PRECISION = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["phi3", "gemma", "gemma2", "mixtral"])
def test_low_precision_as_accurate_as_transformers(folders, family, dtype):
    """Built in bf16/fp16, the model is as close to the float64 reference as transformers' own
    model in that dtype (rounding differs in order, not in size: at most 4× its error)."""
    model = load_model(str(folders[family]), dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    exact = reference_logits(reference(folders[family], F64), IDS)
    theirs = reference_logits(reference(folders[family], dtype), IDS).to(F64)
    with torch.no_grad():
        ours = model(IDS).to(F64)
    assert _rel(ours, exact) <= 4 * _rel(theirs, exact)


@hooked_only("only 3.9's converter refuses Qwen2-MoE (the bridge loads it)")
def test_unsupported_family_is_a_clear_error(folders):
    from lens_attrib.errors import ModelError

    with pytest.raises(ModelError, match=r"Qwen2MoeForCausalLM .*not supported.*Mixtral"):
        load_model(str(folders["qwen2_moe"]))
