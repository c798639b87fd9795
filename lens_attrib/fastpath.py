"""Forward passes without per-call weight copies: store each matrix in the layout its kernel reads.

TransformerLens 3.9 keeps its weights in the "mathematical" layout (``W_U: [d_model, d_vocab]``,
``W_Q: [head, d_model, d_head]``, ``W_O: [head, d_head, d_model]``, gated-MLP ``W_in: [d_model,
d_mlp]``) but multiplies them with ``F.linear``, which wants Hugging Face's ``[out, in]`` layout.
So every forward re-lays them out into a fresh contiguous tensor: ``W_U.T.contiguous()``
(``Unembed``), ``W_gate/W_in/W_out.T.contiguous()`` (``GatedMLP``), ``rearrange(W_Q, "h m d ->
(h d) m")`` (``simple_attn_linear``, also for ``W_K``/``W_V``) and ``rearrange(W_O, "h d m -> m
(h d)").contiguous()`` (attention output). On SmolLM2-135M that is 211 weight copies per forward
(the 113 MB ``W_U`` copy alone on every unembedding) and about a fifth of the forward's CPU time.

:func:`enable_fast_forward` changes none of the code: it re-stores each such parameter so that the
tensor the forward builds is a *view* of the parameter's memory, already in ``[out, in]`` order::

    W_U      [d_model, d_vocab]      = storage[d_vocab, d_model].T
    W_in     [d_model, d_mlp]        = storage[d_mlp, d_model].T       (W_gate likewise)
    W_out    [d_mlp, d_model]        = storage[d_model, d_mlp].T
    W_Q      [head, d_model, d_head] = storage[head, d_head, d_model].transpose(1, 2)  (K, V alike)
    W_O      [head, d_head, d_model] = storage[d_model, head, d_head].permute(1, 2, 0)

Then ``W_U.T.contiguous()`` returns the storage itself and ``rearrange`` only reshapes, so the
forward hands ``F.linear`` the very values, in the very layout, that it copied before: outputs are
bit-for-bit those of the unpatched model. The parameters stay the same ``nn.Parameter`` objects
with the same names, shapes and values (``model.W_U``, ``state_dict()``, hooks, gradients, the
model guard all see nothing new); only their strides change (``is_contiguous()`` is ``False``;
``torch.save`` keeps the layout, ``safetensors`` needs ``.contiguous()`` on save).
``Module.to(dtype/device)`` keeps the layout (``preserve_format``); a ``load_state_dict(...,
assign=True)`` replaces it with the loaded tensors' layout, which is correct but slower again
(call :func:`enable_fast_forward` after it).

Attention scores. TransformerLens' eager attention makes six passes over every ``[batch, head,
query, key]`` tensor besides the two products (divide by ``sqrt(d_head)``, ``where`` for the causal
mask, softmax, then ``isnan``/``zeros_like``/``where`` to zero fully masked rows); at 512 tokens
that is about a quarter of SmolLM2's forward. :func:`enable_fast_forward` also gives each plain
attention module (no KV cache, no ALiBi/relative bias, soft-cap, sinks, QK-norm, split inputs or
per-head results) an instance-level ``forward`` (:func:`_lean_attention_forward`) that computes the
same values with fewer passes: the scale is applied to ``q`` when it is a power of two (exact in
floating point, so bit-identical; otherwise to the scores, as before), the causal mask is filled
in place, and NaN rows are zeroed in place in the softmax output (a softmax output is in
``[0, 1]`` or NaN, so this equals the ``where``) by an autograd function that saves only that
output for the backward (:func:`softmax_zeroing_nan`; PyTorch's softmax backward kernel, so
gradients are bit-identical too): the eager path keeps both the softmax output and the ``where``
result, two ``[batch, head, query, key]`` tensors per layer (540 MB over SmolLM2's 30 layers at
512 tokens).
When ``hook_pattern`` has a hook, the pattern stays a tensor of its own (a hook may edit it in
place, which must not touch what the softmax backward reads).

Fused attention. When nothing observes the scores or the pattern (no hook on
``hook_attn_scores`` or ``hook_pattern``, no additive mask: Gradient×Input, AttnLRP, IG, plain
forwards), the lean forward hands ``q``, ``k``, ``v`` to ``scaled_dot_product_attention`` instead
(:func:`_fused_attention_output`): no ``[batch, head, query, key]`` tensor is kept for the
backward at all, and the attention's memory passes shrink to the kernel's. Its values equal the
eager ones to float rounding (not bit for bit); every other hook (``hook_q/k/v``,
``hook_rot_q/k``, ``hook_z``) fires as before. Methods and users that hook the scores or the
pattern (attention baselines, ALTI, CP-LRP, fixed routing, ``run_with_cache``) get the eager
branch, bit-identical to TransformerLens, where every hook point fires with the same tensor as
before (``hook_q/k/v``, ``hook_rot_q/k``, ``hook_attn_scores``, ``hook_pattern``, ``hook_z``); other
configurations run TransformerLens' own ``forward``.

Hooks that edit in place. A user hook may edit its tensor in place at any hook point
(``z[:, :, h] = 0`` at ``hook_z``), with the result of a clone-then-edit hook, also through the
backward pass. Autograd refuses such an edit ("modified by an inplace operation") wherever the
edited tensor was saved for the backward before the hook ran. The fast path never hands a hook
such a tensor: the fused kernel saves its output, so ``hook_z`` gets a copy of it whenever
autograd records and ``hook_z`` has a hook (:func:`_fused_attention_output`); the lean softmax
saves its output, so with a hook on ``hook_pattern`` the pattern is a tensor of its own (above);
``q``, ``k``, ``v`` and the scores pass their hooks before anything saves them. TransformerLens
itself hands two hook points a saved tensor (every norm's ``hook_scale`` and a ReLU MLP's
``hook_post``, :func:`saved_output_hook_points`): :func:`enable_fast_forward` makes those
:class:`CopyingHookPoint`s (and the model guard does so for the length of a call on any model),
which copy only while a hook is on them and autograd records. Nothing is copied without hooks.
Backward hooks that edit the *gradient* in place are outside this promise, as in PyTorch ("the
hook should not modify its arguments"): where an addition hands the same gradient to both of its
inputs (``hook_attn_out``, ``hook_mlp_out``, ``hook_embed``), such an edit reaches both.
"""

from __future__ import annotations

import math
import types
from typing import Any

import einops
import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from lens_attrib.backend import has_hooks, is_bridge

# Storage order (logical dimensions, outermost first) of each re-laid parameter, by module kind.
_MATRIX_T = (1, 0)
_QKV_ORDER = (0, 2, 1)  # [head, d_model, d_head] stored as [head, d_head, d_model]
_OUT_ORDER = (2, 0, 1)  # [head, d_head, d_model] stored as [d_model, head, d_head]


def _layouts(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parameters of ``module`` to re-lay and their storage orders (empty: leave as is)."""
    from transformer_lens.components import AbstractAttention, Unembed
    from transformer_lens.components.mlps.gated_mlp import GatedMLP

    if isinstance(module, Unembed):
        return {"W_U": _MATRIX_T}
    if isinstance(module, GatedMLP):
        return {"W_in": _MATRIX_T, "W_gate": _MATRIX_T, "W_out": _MATRIX_T}
    if isinstance(module, AbstractAttention) and not module.cfg.load_in_4bit:
        return {
            "W_Q": _QKV_ORDER,
            "W_K": _QKV_ORDER,
            "W_V": _QKV_ORDER,
            "_W_K": _QKV_ORDER,  # grouped-query attention stores K/V weights privately
            "_W_V": _QKV_ORDER,
            "W_O": _OUT_ORDER,
        }
    return {}


def _relaid_parameters(model: nn.Module) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    found: list[tuple[nn.Parameter, tuple[int, ...]]] = []
    for module in model.modules():
        for name, order in _layouts(module).items():
            param = module._parameters.get(name)
            if isinstance(param, nn.Parameter) and param.ndim == len(order):
                found.append((param, order))
    return found


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


def _in_storage_order(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    return tensor.permute(order).is_contiguous()


def _check_model(model: Any) -> None:
    try:
        from transformer_lens import HookedEncoder, HookedTransformer
    except ImportError:  # TransformerLens 4: only the TransformerBridge
        raise TypeError(
            f"enable_fast_forward re-lays TransformerLens 3.9's HookedTransformer/HookedEncoder "
            f"weights; got {type(model).__name__}, and TransformerLens >= 4 (no HookedTransformer) "
            "is installed. A TransformerBridge runs Hugging Face's own forward: leave it as is."
        ) from None
    if not isinstance(model, HookedTransformer | HookedEncoder):
        raise TypeError(
            f"enable_fast_forward expects a TransformerLens HookedTransformer or HookedEncoder, "
            f"got {type(model).__name__}."
        )


# --------------------------------------------------------------------------- lean attention
def _lean_supported(attn: Any) -> bool:
    """Whether ``attn``'s configuration is one :func:`_lean_attention_forward` reproduces."""
    from transformer_lens.components import Attention, GroupedQueryAttention
    from transformer_lens.utilities.activation_functions import softcap_enabled

    cfg = attn.cfg
    return (
        type(attn) in (Attention, GroupedQueryAttention)
        and cfg.positional_embedding_type in ("standard", "rotary", "shortformer")
        and not (cfg.load_in_4bit or cfg.use_split_qkv_input or cfg.use_attn_in)
        and not (cfg.use_attn_result or cfg.use_qk_norm or cfg.use_attention_sinks)
        and not (cfg.use_logn_attn or cfg.use_dynamic_ntk_rope)
        and cfg.clip_qkv is None
        and not softcap_enabled(cfg.attn_scores_soft_cap)
        and getattr(attn, "q_norm", None) is None
        and (attn._attention_dir_override or cfg.attention_dir) in ("causal", "bidirectional")
    )


def _is_power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


class _SoftmaxZeroingNaN(torch.autograd.Function):
    """``softmax(x)`` over the last dimension with NaN rows set to 0, saving only its output.

    Values and gradients are those of TransformerLens' ``where(isnan(p), 0, p)`` after
    ``p = softmax(x)``: the backward is PyTorch's own softmax backward kernel on the saved output
    (so bit-identical where rows are finite), and a zeroed row (fully masked) passes no gradient
    — as there, where the ``where`` blocks it. Autograd sees one ``[.., q, k]`` tensor saved per
    layer instead of two (softmax output and the ``where`` result the next product keeps).
    """

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        pattern = F.softmax(scores, dim=-1).nan_to_num_(nan=0.0)
        ctx.save_for_backward(pattern)
        ctx.input_dtype = scores.dtype
        return pattern

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (pattern,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, pattern, -1, ctx.input_dtype)


def softmax_zeroing_nan(scores: torch.Tensor) -> torch.Tensor:
    """``softmax(scores, -1)``, fully masked (NaN) rows zeroed (:class:`_SoftmaxZeroingNaN`)."""
    if not (torch.is_grad_enabled() and scores.requires_grad):
        return F.softmax(scores, dim=-1).nan_to_num_(nan=0.0)
    return _SoftmaxZeroingNaN.apply(scores)  # type: ignore[no-any-return]


def _lean_attention_forward(
    self: Any,
    query_input: torch.Tensor,
    key_input: torch.Tensor,
    value_input: torch.Tensor,
    past_kv_cache_entry: Any = None,
    additive_attention_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """TransformerLens' eager attention (same values, same hooks) with fewer ``[q, k]`` passes."""
    if past_kv_cache_entry is not None or position_bias is not None or not _lean_supported(self):
        return type(self).forward(  # type: ignore[no-any-return]
            self,
            query_input,
            key_input,
            value_input,
            past_kv_cache_entry=past_kv_cache_entry,
            additive_attention_mask=additive_attention_mask,
            attention_mask=attention_mask,
            position_bias=position_bias,
        )
    q, k, v = self.calculate_qkv_matrices(query_input, key_input, value_input)
    if self.cfg.positional_embedding_type == "rotary":
        q = self.hook_rot_q(self.apply_rotary(q, 0, attention_mask))
        k = self.hook_rot_k(self.apply_rotary(k, 0, attention_mask))
    repeats = getattr(self, "repeat_kv_heads", 1)
    if repeats > 1 and not self.cfg.ungroup_grouped_query_attention:
        k = torch.repeat_interleave(k, dim=2, repeats=repeats)
        v = torch.repeat_interleave(v, dim=2, repeats=repeats)
    q_ = einops.rearrange(q, "batch pos head d_head -> batch head pos d_head")
    if additive_attention_mask is None and not (
        has_hooks(self.hook_attn_scores) or has_hooks(self.hook_pattern)
    ):
        return _fused_attention_output(self, q_, v, k, attention_mask)
    k_ = einops.rearrange(k, "batch pos head d_head -> batch head d_head pos")
    scale = float(self.attn_scale)
    if _is_power_of_two(scale):  # (q / 2^n)·k == (q·k) / 2^n exactly
        scores = (q_ / scale) @ k_
    else:
        scores = q_ @ k_ / scale
    if (self._attention_dir_override or self.cfg.attention_dir) == "causal":
        allowed = self._make_causal_mask(scores.size(-2), scores.size(-1), 0, scores.device)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill_(~allowed, float("-inf"))
    if additive_attention_mask is not None:
        scores = scores + additive_attention_mask
    scores = self.hook_attn_scores(scores)
    if has_hooks(self.hook_pattern):  # a hook may edit the pattern in place: keep it unsaved
        pattern = torch.nan_to_num(F.softmax(scores, dim=-1), nan=0.0)
    else:
        pattern = softmax_zeroing_nan(scores)  # fully masked rows → 0, one tensor saved
    pattern = self.hook_pattern(pattern).to(device=v.device, dtype=v.dtype)
    v_ = einops.rearrange(v, "batch pos head d_head -> batch head pos d_head")
    return _output(self, pattern @ v_)


def _output(attn: Any, z_heads: torch.Tensor) -> torch.Tensor:
    """``hook_z`` on the mixed values ``[batch, head, pos, d_head]``, then ``W_O`` and ``b_O``."""
    z = attn.hook_z(einops.rearrange(z_heads, "batch head pos d_head -> batch pos head d_head"))
    w_o = einops.rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)").contiguous()
    return F.linear(z.reshape(z.shape[0], z.shape[1], -1).to(w_o.dtype), w_o, attn.b_O)


def _fused_attention_output(
    attn: Any,
    q_: torch.Tensor,
    v: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Scores, mask, softmax and mixing in one ``scaled_dot_product_attention`` call.

    Taken when nothing observes the scores or the pattern (no hook on ``hook_attn_scores`` or
    ``hook_pattern``): no ``[batch, head, query, key]`` tensor is built or kept for the backward
    (the kernel recomputes it), which at 512 tokens saves 270 MB on SmolLM2-135M and most of the
    attention's memory traffic. Same function as the eager path up to float rounding (``≈ 1e-7``
    relative in float32, ``1e-16`` in float64); fully masked rows (left padding) give 0, as there.

    The kernel saves its output (and ``q``, ``k``, ``v``) for the backward. ``q``/``k``/``v``
    have passed their hooks before the call; the output reaches ``hook_z`` after it, so when
    autograd records and ``hook_z`` has any hook (forward, pre, backward or global), the hook gets
    a copy (``[batch, pos, d_model]``-sized, nothing otherwise) and an in-place edit there is the
    same as a clone-then-edit.
    """
    causal = (attn._attention_dir_override or attn.cfg.attention_dir) == "causal"
    k_ = einops.rearrange(k, "batch pos head d_head -> batch head pos d_head")
    v_ = einops.rearrange(v, "batch pos head d_head -> batch head pos d_head")
    allowed: torch.Tensor | None = None
    n_q, n_k = q_.shape[-2], k_.shape[-2]
    if attention_mask is not None:
        allowed = attention_mask[:, None, None, :].bool()
        if causal:
            allowed = allowed & attn._make_causal_mask(n_q, n_k, 0, q_.device)
    elif causal and getattr(attn, "attn_type", "global") == "local":
        # sliding window (Mistral, Phi-3): the kernel's is_causal knows no window
        allowed = attn._make_causal_mask(n_q, n_k, 0, q_.device)
    mixed = F.scaled_dot_product_attention(
        q_,
        k_,
        v_.to(q_.dtype),
        attn_mask=allowed,
        is_causal=causal and allowed is None,
        scale=1.0 / float(attn.attn_scale),
    )
    if mixed.requires_grad and has_hooks(attn.hook_z):
        # The kernel keeps its output for the backward, and ``hook_z`` hands a view of it to
        # hooks that may edit it in place (``z[:, :, h] = 0``): give them a copy instead.
        mixed = mixed.clone()
    return _output(attn, mixed.to(v.dtype))


# --------------------------------------------------------------------- hooks that edit in place
def saved_output_hook_points(model: nn.Module) -> list[nn.Module]:
    """Hook points where TransformerLens 3.9 hands hooks a tensor autograd keeps for the backward.

    A hook that edits its tensor in place there (``x.mul_(0.5)``, ``x[..., 0] = 0``) breaks
    every backward pass with "modified by an inplace operation", on a plain TransformerLens model
    too, because the operation that made the tensor saved its own output:

    - every norm's ``hook_scale`` (LayerNorm, RMSNorm and their ``Pre`` forms): ``σ =
      sqrt(mean(x²) + ε)``, and ``sqrt`` saves its result;
    - ``mlp.hook_post`` of an ungated MLP with ``act_fn="relu"``: ``relu`` saves its result.

    Every other hook point of a block gets a tensor that nothing has saved yet (later operations
    save it only after its hooks ran), so edits there are already safe. A TransformerLens 4
    bridge also hands hooks the softmax's own output at ``attn.hook_pattern`` (its eager
    attention) and a view of ``scaled_dot_product_attention``'s output at ``attn.hook_z`` (the
    fused attention, :func:`lens_attrib.backend_bridge.enable_fused_attention`), and the ReLU's
    output at ``mlp.hook_post`` of its ungated MLP bridge: those points are listed too (a point
    reached under two names, TransformerLens 3.9's alias and the bridge's own, once).
    """
    named: dict[str, nn.Module] | None = getattr(model, "hook_dict", None)
    if named is None:
        named = {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}
    relu = getattr(getattr(model, "cfg", None), "act_fn", None) == "relu"
    bridge = is_bridge(model)
    points: dict[int, nn.Module] = {}
    for name, point in named.items():
        if name.endswith("hook_scale"):
            points[id(point)] = point
        elif bridge and name.endswith(("attn.hook_pattern", "attn.hook_z")):
            points[id(point)] = point
        elif relu and name.endswith("mlp.hook_post"):
            mlp = model.get_submodule(name.rsplit(".", 1)[0])
            if _is_tl3_mlp(mlp) or (bridge and type(mlp).__name__ == "MLPBridge"):
                points[id(point)] = point
    return list(points.values())


def _is_tl3_mlp(module: nn.Module) -> bool:
    """A TransformerLens 3.9 ``MLP`` (TransformerLens 4 has no ``components`` package)."""
    try:
        from transformer_lens.components.mlps.mlp import MLP
    except ImportError:
        return False
    return isinstance(module, MLP)


class CopyingHookPoint(HookPoint):
    """A ``HookPoint`` whose hooks get a copy of the tensor when autograd keeps the original.

    Used at :func:`saved_output_hook_points` only. When autograd records through ``x`` and any
    hook (forward, pre, backward or global) is on the point, the call proceeds with
    ``x.clone()``: values and gradients are unchanged (a copy's backward is the identity), and a
    hook that edits its tensor in place acts exactly like a clone-then-edit hook. Without hooks,
    or without autograd, ``x`` itself goes through, as in ``HookPoint``.
    """

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(x, "requires_grad", False) and torch.is_grad_enabled() and has_hooks(self):
            x = x.clone()
        return nn.Module.__call__(self, x, *args, **kwargs)


def protect_saved_outputs(model: nn.Module) -> list[nn.Module]:
    """Make in-place hook edits safe at :func:`saved_output_hook_points`; returns the points
    changed here (those already protected are skipped), for :func:`unprotect_saved_outputs`.

    Each such point becomes a :class:`CopyingHookPoint` (same object, same hooks and name; its
    class is swapped), so that a ``[batch, pos, 1]``-sized copy (norms) is made only while a hook
    is on the point and autograd records.
    """
    changed: list[nn.Module] = []
    for point in saved_output_hook_points(model):
        if type(point) is HookPoint:
            point.__class__ = CopyingHookPoint
            changed.append(point)
    return changed


def unprotect_saved_outputs(points: list[nn.Module]) -> None:
    """Undo :func:`protect_saved_outputs` on ``points`` (the list it returned)."""
    for point in points:
        if type(point) is CopyingHookPoint:
            point.__class__ = HookPoint  # type: ignore[assignment]


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from transformer_lens.components import AbstractAttention

    return [m for m in model.modules() if isinstance(m, AbstractAttention)]


def enable_fast_forward(model: Any) -> Any:
    """Re-store ``model``'s matrices so that no forward copies a weight; returns ``model``.

    In place and idempotent. Outputs, hooks, gradients and ``state_dict`` are unchanged (see the
    module docstring); parameters already in the fast layout are left alone. Hook points where
    TransformerLens hands hooks a tensor autograd saved become copying hook points
    (:func:`protect_saved_outputs`), so that in-place hook edits work there too.
    """
    _check_model(model)
    with torch.no_grad():
        for param, order in _relaid_parameters(model):
            if _in_storage_order(param, order):
                continue
            stored = param.detach().permute(order).contiguous()
            param.data = stored.permute(_inverse(order))
    for attn in _attention_modules(model):
        if _lean_supported(attn):
            attn.forward = types.MethodType(_lean_attention_forward, attn)
    protect_saved_outputs(model)
    return model


def disable_fast_forward(model: Any) -> Any:
    """Give every re-laid parameter back its ordinary contiguous layout, TransformerLens' own
    attention forward and plain hook points; returns ``model``."""
    _check_model(model)
    with torch.no_grad():
        for param, _ in _relaid_parameters(model):
            if not param.is_contiguous():
                param.data = param.detach().contiguous()
    for attn in _attention_modules(model):
        attn.__dict__.pop("forward", None)
    unprotect_saved_outputs(saved_output_hook_points(model))
    return model


def is_fast_forward(model: Any) -> bool:
    """Whether every matrix :func:`enable_fast_forward` handles is in its copy-free layout and
    every supported attention module runs the lean forward."""
    lean = all(
        "forward" in attn.__dict__ for attn in _attention_modules(model) if _lean_supported(attn)
    )
    return lean and all(_in_storage_order(p, order) for p, order in _relaid_parameters(model))
