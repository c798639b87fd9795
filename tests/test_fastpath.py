"""The copy-free weight layout (lens_attrib/fastpath.py) changes speed only.

Oracle: the same tiny model (same seed) without the patch. In float64 the patched model gives the
same logits, the same activation at every hook point, the same state_dict (same Parameter objects),
the same guard fingerprint and the same attribution scores; user hooks fire with the same shapes;
no forward copies a weight any more (profiler); disabling gives the ordinary layout back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import einops
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lens_attrib.fastpath import (
    CopyingHookPoint,
    disable_fast_forward,
    enable_fast_forward,
    is_fast_forward,
)
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.methods.registry import attribute
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia

F64 = torch.float64
PROMPTS = ["the dog sees the cat near the house", "a man likes books"]
BUILDERS: dict[str, Callable[..., Any]] = {
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "pythia": tiny_pythia,
    "bert": tiny_bert,
}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0.0, atol=1e-12)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    """(name, unpatched model, patched model): two copies of the same float64 weights."""
    build = BUILDERS[request.param]
    return request.param, build(dtype=F64), enable_fast_forward(build(dtype=F64))


def _tok(model: Any) -> torch.Tensor:
    enc = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return enc["input_ids"]


def _run_with_cache(model: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Padded batch with its attention mask (exercises the padding branch of the masks)."""
    batch = to_batch(model, PROMPTS)
    assert not batch.mask.all()
    logits, cache = model.run_with_cache(batch.tokens, **batch.model_kwargs())
    return logits, dict(cache.items())


def test_layout_is_copy_free(pair) -> None:
    """The tensors the forward builds from the weights are views of the parameters' memory."""
    _, _, fast = pair
    assert is_fast_forward(fast)
    if hasattr(fast, "unembed"):
        w_u = fast.unembed.W_U
        assert w_u.T.contiguous().data_ptr() == w_u.data_ptr()
    for block in fast.blocks:
        attn = block.attn
        for name in ("W_Q", "_W_K", "_W_V", "W_K", "W_V"):
            w = attn._parameters.get(name)
            if w is not None:
                fused = einops.rearrange(w, "h m d -> (h d) m")
                assert fused.is_contiguous() and fused.data_ptr() == w.data_ptr(), name
        w_o = einops.rearrange(attn.W_O, "h d m -> m (h d)")
        assert w_o.is_contiguous() and w_o.data_ptr() == attn.W_O.data_ptr()
        for name in ("W_gate", "W_in", "W_out"):
            w = block.mlp._parameters.get(name)
            if w is not None and "Gated" in type(block.mlp).__name__:
                assert w.T.contiguous().data_ptr() == w.data_ptr(), name


def _weight_copies(model: Any, tokens: torch.Tensor) -> int:
    """Number of ``aten::copy_`` calls in one forward whose shape is a weight's [out, in] shape."""
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if "W" in n.split(".")[-1]}
    shapes |= {tuple(reversed(s)) for s in shapes}
    shapes |= {(s[0] * s[2], s[1]) for s in list(shapes) if len(s) == 3}
    shapes |= {(s[1], s[0] * s[2]) for s in list(shapes) if len(s) == 3}
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(tokens)
    return sum(
        e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key == "aten::copy_" and e.input_shapes and tuple(e.input_shapes[0]) in shapes
    )


def test_no_weight_copies_per_forward(pair) -> None:
    name, slow, fast = pair
    # one prompt of 6-7 tokens: no activation shape coincides with a weight shape
    tokens = slow.tokenizer(["the dog sees the cat"], return_tensors="pt")["input_ids"]
    assert _weight_copies(slow, tokens) > 0, "the oracle should see the unpatched copies"
    assert _weight_copies(fast, tokens) == 0, name


def test_outputs_and_every_activation_unchanged(pair) -> None:
    _, slow, fast = pair
    logits_slow, cache_slow = _run_with_cache(slow)
    logits_fast, cache_fast = _run_with_cache(fast)
    _close(logits_fast, logits_slow)
    assert cache_fast.keys() == cache_slow.keys()
    assert len(cache_slow) >= 10 * slow.cfg.n_layers
    for key, value in cache_slow.items():
        _close(cache_fast[key], value)


def test_user_hooks_fire_with_same_shapes(pair) -> None:
    _, slow, fast = pair
    tokens = _tok(slow)

    def shapes_seen(model: Any) -> list[tuple[str, tuple[int, ...]]]:
        seen: list[tuple[str, tuple[int, ...]]] = []

        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            seen.append((hook.name, tuple(x.shape)))
            return x * 1.0

        model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, hook)])
        return seen

    seen_slow, seen_fast = shapes_seen(slow), shapes_seen(fast)
    assert seen_fast == seen_slow
    assert len({n for n, _ in seen_fast}) >= 10 * fast.cfg.n_layers


def test_state_dict_parameters_and_fingerprint_unchanged() -> None:
    for build in BUILDERS.values():
        model = build(dtype=F64)
        params = dict(model.named_parameters())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        fingerprint = model_state_fingerprint(model)
        enable_fast_forward(model)
        assert model_state_fingerprint(model) == fingerprint
        assert all(p is params[n] for n, p in model.named_parameters())
        after = model.state_dict()
        assert after.keys() == state.keys()
        assert all(torch.equal(after[k], v) for k, v in state.items())
        assert any(not p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize("method", ["grad_x_input", "attnlrp"])
def test_attribution_scores_unchanged(pair, method) -> None:
    _, slow, fast = pair
    a_slow = attribute(slow, PROMPTS, method=method)
    a_fast = attribute(fast, PROMPTS, method=method)
    _close(a_fast.scores, a_slow.scores)
    assert torch.equal(a_fast.mask, a_slow.mask)


def test_parameter_gradients_unchanged() -> None:
    """Back-propagation to the re-laid weights themselves gives the same gradients."""
    grads = []
    for patch in (False, True):
        model = tiny_llama(dtype=F64)
        if patch:
            enable_fast_forward(model)
        model.zero_grad()
        model(_tok(model)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        _close(grads[1][n], g)


def test_idempotent_and_disable_restores() -> None:
    model = tiny_gpt2(dtype=F64)
    tokens = _tok(model)
    with torch.no_grad():
        before = model(tokens)
    enable_fast_forward(model)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    enable_fast_forward(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    assert all("forward" in block.attn.__dict__ for block in model.blocks)
    disable_fast_forward(model)
    assert not is_fast_forward(model)
    assert all(p.is_contiguous() for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(isinstance(m, CopyingHookPoint) for m in model.modules())
    with torch.no_grad():
        _close(model(tokens), before)


def test_dtype_change_keeps_layout() -> None:
    model = enable_fast_forward(tiny_llama(dtype=F64)).to(torch.float32)
    assert is_fast_forward(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match="HookedTransformer"):
        enable_fast_forward(torch.nn.Linear(2, 2))


def test_unsupported_attention_settings_fall_back_to_transformer_lens() -> None:
    """Per-head results (``use_attn_result``) switched on after enabling: TL's own forward runs."""
    slow, fast = tiny_gpt2(dtype=F64), enable_fast_forward(tiny_gpt2(dtype=F64))
    for model in (slow, fast):
        model.set_use_attn_result(True)
    logits_slow, cache_slow = _run_with_cache(slow)
    logits_fast, cache_fast = _run_with_cache(fast)
    assert "blocks.0.attn.hook_result" in cache_fast
    _close(logits_fast, logits_slow)
    for key, value in cache_slow.items():
        _close(cache_fast[key], value)


def _observe(x: torch.Tensor, hook: Any) -> None:
    """A hook that only looks: it makes the lean attention take its eager (scores) branch."""


def _saved_pattern_storages(
    model: Any, tokens: torch.Tensor, mask: torch.Tensor, hooks: list[Any]
) -> int:
    """Distinct per-head ``[batch, head, q, k]`` tensors autograd keeps for the backward of one
    forward (the fused kernel keeps the padding mask, ``[batch, 1, q, k]``, which is not one)."""
    n, n_heads = tokens.shape[1], model.cfg.n_heads
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 4 and tuple(t.shape[1:]) == (n_heads, n, n):
            storages.add(t.untyped_storage().data_ptr())
        return t

    embed = model.embed.W_E.detach().requires_grad_(True)
    hooks = [("hook_embed", lambda x, hook: embed[tokens]), *hooks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with model.hooks(fwd_hooks=hooks):
            model(tokens, attention_mask=mask)
    return len(storages)


SCORES_OBSERVED = [(lambda name: name.endswith("hook_attn_scores"), _observe)]


def test_attention_keeps_at_most_one_pattern_per_layer_for_the_backward() -> None:
    """Eager TL saves the softmax output and its NaN-zeroed copy; the lean branch one tensor; the
    fused branch (nothing observes scores or pattern) none."""
    slow, fast = tiny_llama(dtype=F64), enable_fast_forward(tiny_llama(dtype=F64))
    batch = to_batch(slow, PROMPTS)
    n_layers = slow.cfg.n_layers
    assert _saved_pattern_storages(slow, batch.tokens, batch.mask, []) == 2 * n_layers
    assert _saved_pattern_storages(fast, batch.tokens, batch.mask, SCORES_OBSERVED) == n_layers
    assert _saved_pattern_storages(fast, batch.tokens, batch.mask, []) == 0


def test_a_hook_on_z_keeps_the_fused_branch() -> None:
    """An (in-place) hook on ``hook_z`` gets a copy of the kernel's output; the attention stays
    fused (no ``[batch, head, q, k]`` tensor kept), it does not fall back to the eager branch."""
    fast = enable_fast_forward(tiny_llama(dtype=F64))
    batch = to_batch(fast, PROMPTS)

    def zero_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z[:, :, 0] = 0.0
        return z

    z_hooked = [(lambda name: name.endswith("hook_z"), zero_head)]
    assert _saved_pattern_storages(fast, batch.tokens, batch.mask, z_hooked) == 0


def _clones_per_forward(model: Any, tokens: torch.Tensor, hooked: str | None = None) -> int:
    """``aten::clone`` calls in one differentiable forward (leaf at ``blocks.0.hook_resid_pre``)
    minus the number of calls of the points whose name ends with ``hooked`` (observed by a hook)."""
    calls = [0]

    def leaf(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x.detach().requires_grad_(True)

    def count(x: torch.Tensor, hook: Any) -> None:
        calls[0] += 1

    hooks: list[Any] = [("blocks.0.hook_resid_pre", leaf)]
    if hooked is not None:
        hooks.append((lambda name: name.endswith(hooked), count))
    with model.hooks(fwd_hooks=hooks):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(tokens)
    assert (calls[0] > 0) == (hooked is not None)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::clone") - calls[0]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_copies_for_in_place_safety_only_with_hooks(name: str) -> None:
    """The copies that make in-place hook edits safe are made only where a hook is: one per call
    of a hooked ``hook_z`` (fused kernel output) or ``hook_scale`` (TransformerLens calls ``ln1``
    once for each of q, k, v), none otherwise."""
    fast = enable_fast_forward(BUILDERS[name](dtype=F64))
    tokens = _tok(fast)[:1]
    base = _clones_per_forward(fast, tokens)
    assert _clones_per_forward(fast, tokens, "hook_z") == base
    assert _clones_per_forward(fast, tokens, "hook_scale") == base
    assert _clones_per_forward(fast, tokens, "hook_normalized") == base - _norm_calls(fast, tokens)


def _norm_calls(model: Any, tokens: torch.Tensor) -> int:
    """Calls of ``hook_normalized`` in one forward (no copies are made there)."""
    seen = [0]

    def count(x: torch.Tensor, hook: Any) -> None:
        seen[0] += 1

    with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_normalized"), count)]):
        model(tokens)
    return seen[0]


def _input_gradient(name: str, model: Any, padding_side: str, hooks: list[Any]) -> torch.Tensor:
    model.tokenizer.padding_side = padding_side
    enc = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    tokens, mask = enc["input_ids"], enc["attention_mask"]
    assert not mask.all()
    leaf: dict[str, torch.Tensor] = {}

    def make_leaf(x: torch.Tensor, hook: Any) -> torch.Tensor:
        leaf["x"] = x.detach().requires_grad_(True)
        return leaf["x"]

    mask_kwarg = "one_zero_attention_mask" if name == "bert" else "attention_mask"
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", make_leaf), *hooks]):
        out = model(tokens, **{mask_kwarg: mask})
    (grad,) = torch.autograd.grad((out[:, -1] * mask[:, -1, None]).square().sum(), leaf["x"])
    assert torch.isfinite(grad).all()
    return grad


@pytest.mark.parametrize("name", ["llama", "bert"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_input_gradients_with_padding(name: str, padding_side: str) -> None:
    """Lean softmax (scores observed): TL's gradients bit for bit, fully masked rows included;
    fused attention (nothing observed): equal to float64 rounding."""
    build = BUILDERS[name]
    slow, fast = build(dtype=F64), enable_fast_forward(build(dtype=F64))
    reference = _input_gradient(name, slow, padding_side, [])
    assert torch.equal(_input_gradient(name, fast, padding_side, SCORES_OBSERVED), reference)
    _close(_input_gradient(name, fast, padding_side, []), reference)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fused_attention_outputs_and_z_match(name: str) -> None:
    """Without hooks on scores or pattern, logits and ``hook_z`` equal the eager model's."""
    build = BUILDERS[name]
    slow, fast = build(dtype=F64), enable_fast_forward(build(dtype=F64))
    batch = to_batch(slow, PROMPTS)
    seen: list[dict[str, torch.Tensor]] = [{}, {}]
    for model, store in zip((slow, fast), seen):

        def keep(x: torch.Tensor, hook: Any, store: dict[str, torch.Tensor] = store) -> None:
            store[hook.name] = x.detach().clone()

        with torch.no_grad(), model.hooks(fwd_hooks=[(lambda n: n.endswith("hook_z"), keep)]):
            store["logits"] = model(batch.tokens, **batch.model_kwargs())
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == slow.cfg.n_layers + 1
    for key, value in seen[0].items():
        keep_rows = batch.mask.reshape(batch.mask.shape + (1,) * (value.ndim - 2))
        _close(seen[1][key] * keep_rows, value * keep_rows)


def test_in_place_pattern_edits_keep_gradients() -> None:
    """A head-ablation hook that zeroes a head's pattern in place still back-propagates."""
    grads = []

    def ablate(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        pattern[:, 0] = 0.0
        return pattern

    for patch in (False, True):
        model = tiny_llama(dtype=F64)
        if patch:
            enable_fast_forward(model)
        tokens = _tok(model)[:1]
        embed = model.embed.W_E[tokens].detach().requires_grad_(True)
        hooks = [
            ("hook_embed", lambda x, hook, embed=embed: embed),
            ("blocks.0.attn.hook_pattern", ablate),
        ]
        with model.hooks(fwd_hooks=hooks):
            out = model(tokens)
        (grad,) = torch.autograd.grad(out[:, -1].square().sum(), embed)
        grads.append(grad)
    _close(grads[1], grads[0])
