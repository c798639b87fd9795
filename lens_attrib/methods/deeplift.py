"""DeepLIFT with the Rescale rule (Shrikumar et al. 2017), as a modified-gradient pass.

For input embeddings ``e^k`` (token, and positional/token-type with ``embeddings="full"``), their
baselines ``b^k`` (the same non-degenerate baselines as Integrated Gradients) and the explained
scalar ``f``:

    R_i = Σ_k Σ_d (e^k − b^k)_{i,d} · ∂̃f/∂e^k_{i,d}

where ``∂̃`` is the gradient in which every element-wise nonlinearity ``a = φ(h)`` passes the
Rescale multiplier ``(φ(h) − φ(h₀))/(h − h₀)`` instead of ``φ'(h)``, ``h₀`` being its input on a
reference forward pass of the baseline (see :mod:`lens_attrib.hooks.deeplift`), inside the
model and inside a ``Target.head`` module (a classifier's pooler Tanh, …). Norms, the
attention softmax and the products ``A·v``, ``q·k``, ``φ(gate)·up`` keep their gradient at the
explained input, as in Captum's ``DeepLift`` (Ancona et al. 2018's gradient formulation).

Summation to delta: ``Σ_i R_i = f(e) − f(b)`` holds exactly when the network from the embeddings
to ``f`` is a composition of affine maps and element-wise nonlinearities (each multiplier makes
``Δa = m·Δh`` exact, affine maps carry differences exactly). Norms (``x/σ(x)``), softmax attention
and gating are multi-input nonlinearities differentiated at ``e``, so in a real transformer the sum
is only approximate: ``meta["completeness_gap"] = f(e) − f(b) − Σ_i R_i`` reports it per item.

Precision: the multipliers are computed in float64 whatever the model's dtype (see
:mod:`lens_attrib.hooks.deeplift`), so float32 DeepLIFT departs from float64 DeepLIFT by float32
rounding, as Gradient×Input does (``tests/test_deeplift_float32.py``,
``benchmarks/bench_deeplift_float32.py``).

Three passes: the embeddings alone (to build the baselines), the reference forward (no graph), and
the explained forward with one backward pass; all through TransformerLens hooks, so the user's own
hooks act in both forwards.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_attrib.backend import embedding_forward, embedding_hooks
from lens_attrib.forward import resid_of, run, target_rows
from lens_attrib.hooks.deeplift import (
    ACTIVATIONS,
    RESCALE_EPS,
    head_rescale,
    mlm_head_rescale,
    reference_hooks,
    rescale_applies,
    rescale_hooks,
)
from lens_attrib.inputs import Batch, pad_id_of
from lens_attrib.methods.backprop import (
    EMBEDDING_OPTION,
    TOKEN_POOLING_OPTION,
    grad_x_input_scores,
    gradients_at,
)
from lens_attrib.methods.baselines import (
    SINK_MODES,
    baseline_check,
    default_baseline,
    embedding_baselines,
    sink_needed,
    sink_positions,
    sink_token_id,
)
from lens_attrib.methods.registry import MethodOutput, Option, register
from lens_attrib.target import ResolvedTarget, Target


def _eps_check(value: Any) -> str | None:
    ok = isinstance(value, float | int) and not isinstance(value, bool) and 0 <= value < 1
    return None if ok else "a number in [0, 1)"


def _capture(store: dict[str, Tensor], name: str) -> Any:
    """Keep the activation under ``name`` (not ``hook.name``: a TransformerBridge's differs)."""

    def hook(x: Tensor, hook: Any) -> None:
        store[name] = x.detach()

    return hook


def _replace(value: Tensor) -> Any:
    def hook(x: Tensor, hook: Any) -> Tensor:
        return value.to(x.device, x.dtype)

    return hook


def with_sinks(model: Any, batch: Batch, needs: list[bool]) -> Batch:
    """``batch`` with one more column on the left, the sink token there for items in ``needs``.

    Decoders are padded on the left, so every item's column ``j`` becomes ``j + 1``; an item
    that gets a sink has it just before its first real token.
    """
    if batch.padding_side != "left":
        raise ValueError("keep_sink='special' needs a left-padded decoder batch.")
    sink = sink_token_id(model)
    pad = batch.tokens.new_full((batch.size, 1), pad_id_of(model.tokenizer))
    tokens = torch.cat([pad, batch.tokens], 1)
    mask = torch.cat([torch.zeros_like(batch.mask[:, :1]), batch.mask], 1)
    special = torch.cat([torch.zeros_like(batch.special[:, :1]), batch.special], 1)
    str_tokens = [list(s) for s in batch.str_tokens]
    for b, add in enumerate(needs):
        if add:
            column = int(batch.first_real[b])
            tokens[b, column] = sink
            mask[b, column] = True
            special[b, column] = True
            str_tokens[b] = [model.tokenizer.decode([sink]), *str_tokens[b]]
    return Batch(tokens, mask, str_tokens, special, batch.arch, "left", dict(batch.extra))


def _fixed_target(
    target: Target, batch: Batch, resolved: ResolvedTarget, shift: list[int]
) -> Target:
    """The resolved target as a Target, positions shifted by ``shift`` real tokens per item."""
    mask = batch.mask.cpu()
    positions = [
        int(mask[b, : int(resolved.positions[b])].sum()) + shift[b] for b in range(batch.size)
    ]
    return Target(
        token=resolved.token_ids.cpu(),
        foil=None if resolved.foil_ids is None else resolved.foil_ids.cpu(),
        position=positions,
        head=target.head,
        regression=target.regression,
    )


def baselines_of(
    model: Any, batch: Batch, names: list[str], baseline: str | Tensor, keep_sink: str | bool
) -> list[Tensor]:
    """The baseline of every embedding component (one embedding-only forward for the inputs)."""
    embeds: dict[str, Tensor] = {}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, _capture(embeds, n)) for n in names]):
        embedding_forward(
            model, batch.arch, batch.tokens, batch.mask, batch.padded, batch.token_types
        )
    xs = [embeds[n] for n in names]
    keep = {"special": batch.special, True: sink_positions(batch), False: None}[keep_sink]
    return embedding_baselines(model, batch.arch, names, xs, baseline, keep)


def reference_rows(
    model: Any,
    batch: Batch,
    target: Target,
    names: list[str],
    starts: list[Tensor],
    reference: dict[str, Tensor],
) -> Float[Tensor, "batch d_model"]:
    """The reference forward (embeddings replaced by ``starts``, no graph): records the MLP
    activations in ``reference`` and returns the final residual at the target rows."""
    hooks = [(n, _replace(s)) for n, s in zip(names, starts)] + reference_hooks(model, reference)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return target_rows(resid_of(model, batch), target.positions(batch))


@register(
    "deeplift",
    label="DeepLIFT",
    uses_gradient=True,
    options={
        "baseline": Option(None, check=baseline_check),
        "embeddings": Option("partial", choices=EMBEDDING_OPTION.choices),
        "keep_sink": Option(True, choices=SINK_MODES),
        "activations": Option(
            "all",
            choices=ACTIVATIONS,
            help="'all': Rescale at every MLP activation; 'captum': only where Captum has a rule",
        ),
        "eps": Option(
            RESCALE_EPS,
            check=_eps_check,
            help="|h − h₀| below it uses φ'(h) (Captum's 1e-10)",
        ),
        "pooling": TOKEN_POOLING_OPTION,
    },
)
def deeplift(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    baseline: str | Tensor | None,
    embeddings: str,
    keep_sink: str | bool,
    activations: str,
    eps: float,
    pooling: str,
) -> MethodOutput:
    """DeepLIFT (Rescale rule; Shrikumar et al. 2017) against an embedding baseline.

    ``R_i = Σ_k Σ_d (e^k − b^k)_{i,d} ∂̃f/∂e^k_{i,d}``, ``∂̃`` with the Rescale multiplier
    ``(φ(h) − φ(h₀))/(h − h₀)`` at every element-wise activation (module docstring).

    baseline, embeddings, keep_sink: as in :func:`~lens_attrib.methods.integrated_gradients.
               integrated_gradients` (default baseline ``"zero"`` where positional embeddings keep
               the input away from zero, else the pad-token embedding; special tokens and the first
               real token keep their embedding and get no relevance).
    activations: ``"all"`` (default): the Rescale rule at every MLP activation (and the GELU of
               BERT's MLM head, and every element-wise activation module of ``Target.head``),
               DeepLIFT as published. ``"captum"``: only at activations Captum 0.9 gives a rule
               (``nn.ReLU`` in the body; ``nn.ReLU``/``ELU``/``Sigmoid``/``Tanh`` modules of the
               head, e.g. a sequence classifier's pooler Tanh); elsewhere the plain gradient,
               which equals Captum's ``DeepLift`` (and Inseq's ``deeplift``) on GELU/SiLU models
               such as GPT-2, Llama, Mistral or BERT (with its classifier head).
    eps:       below ``|h − h₀| < eps`` the multiplier is ``φ'(h)`` (Captum's default 1e-10).
    pooling:   ``"sum"`` (default, signed, the form whose total is ``f(e) − f(b)`` up to the
               gap), or the ``"l1"``/``"l2"`` norm over ``d`` of each token's vector
               ``Σ_k (e − b)^k_i ⊙ ∂̃f/∂e^k_i`` (Inseq pools its gradient methods, DeepLIFT
               included, by the ℓ2 norm by default); ``meta``'s sums stay the signed ones.

    ``meta``: ``explained_value`` ``f(e)``, ``baseline_value`` ``f(b)``, ``relevance_sum``,
    ``completeness_gap = f(e) − f(b) − Σ_i R_i`` (0 only where the network is affine maps and
    element-wise functions), ``prepended_sink`` and ``input_value`` (as for IG).
    """
    arch = batch.arch
    baseline_used: str | Tensor = (
        default_baseline(arch, embeddings) if baseline is None else baseline
    )
    named = isinstance(baseline_used, str)
    needs = [named and sink_needed(batch, b, keep_sink) for b in range(batch.size)]
    input_value: Tensor | None = None
    xbatch, xtarget, shift = batch, target, 0
    if any(needs):
        with torch.no_grad():
            real = run(model, batch, target)
        assert real.value is not None
        input_value = real.value.detach().cpu()
        xbatch, shift = with_sinks(model, batch, needs), 1
        xtarget = _fixed_target(target, batch, real.resolved, [int(n) for n in needs])
    names = embedding_hooks(arch, embeddings)

    starts = baselines_of(model, xbatch, names, baseline_used, keep_sink)
    reference: dict[str, Tensor] = {}
    rows0 = reference_rows(model, xbatch, xtarget, names, starts, reference)
    # the explained forward with Rescale multipliers, one backward pass
    head_patch = arch.encoder and xtarget.head is None and rescale_applies("gelu", activations)
    patches = rescale_hooks(model, reference, activations=activations, eps=eps)
    with (
        mlm_head_rescale(model, rows0 if head_patch else None, eps=eps),
        head_rescale(xtarget.head, rows0, activations=activations, eps=eps),
    ):
        # the Rescale patches hold one reference row per batch row: no sharing across steps
        grads_xs, grads, result = gradients_at(
            model, xbatch, xtarget, names, patches, share_steps=False
        )
    assert result.value is not None
    deltas = [x - s for x, s in zip(grads_xs, starts)]
    item_scores = grad_x_input_scores(deltas, grads)
    item_scores = item_scores.masked_fill(~xbatch.mask.to(item_scores.device), 0.0)
    with torch.no_grad():
        base_value = result.resolved.select(xtarget.head_fn(model)(rows0))
    value = result.value.detach()
    relevance_sum = item_scores.sum(-1)
    if pooling != "sum":
        item_scores = grad_x_input_scores(deltas, grads, pooling)
        item_scores = item_scores.masked_fill(~xbatch.mask.to(item_scores.device), 0.0)
    scores = item_scores[:, shift:]
    resolved = result.resolved
    if shift:
        resolved = ResolvedTarget(
            resolved.positions - shift, resolved.token_ids, resolved.foil_ids, resolved.regression
        )
    return MethodOutput(
        scores,
        resolved,
        options={"baseline": baseline_used if named else "tensor"},
        meta={
            "explained_value": value.cpu(),
            "baseline_value": base_value.detach().cpu(),
            "relevance_sum": relevance_sum.detach().cpu(),
            "completeness_gap": (value - base_value - relevance_sum).detach().cpu(),
            "prepended_sink": needs,
            "input_value": value.cpu() if input_value is None else input_value,
        },
    )
