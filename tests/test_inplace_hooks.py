"""A user hook that edits its tensor in place acts exactly like one that clones, then edits.

The standard head ablation ``def zero_head(z, hook): z[:, :, 0] = 0.0; return z`` used to break
every backward pass on a model from ``load_model`` ("modified by an inplace operation": the fused
attention kernel saves its output, a view of which ``hook_z`` hands out), and an in-place edit of
a norm's ``hook_scale`` breaks it even on a plain TransformerLens model (``sqrt`` saves its
result). See ``lens_attrib/fastpath.py`` ("Hooks that edit in place").

Oracle: the same edit in a hook that first clones its tensor. On tiny float64 models with the fast
path enabled as ``load_model`` enables it (:func:`enable_fast_forward`), for every hook point of
one block that fires, two edits (halve a slice; zero a head where the tensor has a head axis), and
every gradient method of ``METHODS`` (with ``heads=True`` where it exists) plus the user's own
``.backward()`` (unpadded: the fused kernel without a mask; padded: with one), every returned array
and every parameter gradient agrees to 1e-12 of its largest magnitude, and the model is left as it
was (state dict, guard fingerprint, the user's hook, the hook points' classes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest
import torch
from transformer_lens.hook_points import HookPoint

from lens_attrib import METHODS, Target, attribute
from lens_attrib.fastpath import (
    CopyingHookPoint,
    enable_fast_forward,
    saved_output_hook_points,
    unprotect_saved_outputs,
)
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama
from tests.tl_versions import BRIDGE

F64 = torch.float64
RTOL = 1e-12
LAYER = 1
PROMPTS = ["the keys to the cabinet", "the author near the doors is"]  # left-padded batch
TARGET = Target(token=["are", "is"], foil=["is", "are"])

BUILDERS: dict[str, Callable[..., Any]] = {
    "gpt2": tiny_gpt2,  # LayerNorm, learned positions, GELU
    "llama": tiny_llama,  # RMSNorm, rotary, grouped-query attention, gated SiLU MLP
    "gpt2_relu": partial(tiny_gpt2, act_fn="relu"),  # ReLU saves its output: mlp.hook_post
}
RELU_POINTS = ("mlp.hook_pre", "mlp.hook_post", "hook_mlp_out")  # the ReLU model adds only these

# Every gradient method, with its head relevances where it has them; IG with few steps.
METHOD_CASES: list[tuple[str, dict[str, Any]]] = [
    ("gradient", {}),
    ("grad_x_input", {}),
    ("grad_x_input", {"heads": True}),
    ("integrated_gradients", {"n_steps": 4}),
    ("deeplift", {}),
    ("grad_ellm", {"n_layers": 3}),
    ("lrp", {}),
    ("lrp", {"heads": True}),
    ("attnlrp", {}),
    ("attnlrp", {"heads": True}),
]
FIELDS = ("scores", "layer_scores", "head_scores", "head_token_scores")


def _head_axis(name: str) -> int | None:
    """Axis of the heads in the tensor at hook point ``name`` (``None``: no head axis)."""
    if name.endswith(("hook_q", "hook_k", "hook_v", "hook_z", "hook_rot_q", "hook_rot_k")):
        return 2  # [batch, pos, head, d_head]
    if name.endswith(("hook_attn_scores", "hook_pattern")):
        return 1  # [batch, head, query, key]
    return None


def _halve_slice(x: torch.Tensor, name: str) -> None:
    x[..., :1] *= 0.5


def _zero_head(x: torch.Tensor, name: str) -> None:
    axis = _head_axis(name)
    assert axis is not None
    x.select(axis, 0).zero_()


EDITS: dict[str, Callable[[torch.Tensor, str], None]] = {
    "halve": _halve_slice,
    "zero_head": _zero_head,
}


def in_place(edit: Callable[[torch.Tensor, str], None], point: str) -> Callable[..., torch.Tensor]:
    """The user's hook at ``point`` (the name bound here: a bridge's ``hook.name`` is its own)."""

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        edit(x, point)
        return x

    return hook


def clone_then_edit(
    edit: Callable[[torch.Tensor, str], None], point: str
) -> Callable[..., torch.Tensor]:
    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        x = x.clone()
        edit(x, point)
        return x

    return hook


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest (and the budget is < 60 s on one core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_models: dict[str, Any] = {}


# The hook points of a block under TransformerLens 3.9's names (a bridge resolves them as aliases
# and adds its own names for the same modules: ``hook_in``/``hook_out``, ``attn.q.hook_out``, …).
HOOKED_POINTS = (
    "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k",
    "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores",
    "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "ln2.hook_scale",
    "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
    "hook_mlp_out", "hook_resid_post",
)  # fmt: skip


def model_named(name: str) -> Any:
    """The tiny float64 model ``name`` as ``load_model`` returns models: on TransformerLens 3.9
    with the fast path on; a TransformerBridge runs Hugging Face's forward as it is."""
    if name not in _models:
        model = BUILDERS[name](seed=1, dtype=F64)
        _models[name] = model if BRIDGE else enable_fast_forward(model)
    return _models[name]


def points_of_block(name: str) -> list[str]:
    """Every hook point of block ``LAYER`` (TransformerLens 3.9's names) that fires in a forward
    of ``name``."""
    model = model_named(name)
    prefix = f"blocks.{LAYER}."
    _, cache = model.run_with_cache(
        to_batch(model, PROMPTS).tokens, names_filter=lambda n: n.startswith(prefix)
    )
    points = sorted(p for p in cache.keys() if p.removeprefix(prefix) in HOOKED_POINTS)
    if BRIDGE:  # a bridge's hook_resid_mid is ln2's input only (backend_bridge's docstring): an
        # in-place edit also reaches the residual that shares the tensor, a returned one not
        points.remove(prefix + "hook_resid_mid")
    if name == "gpt2_relu":
        points = [p for p in points if p.endswith(RELU_POINTS)]
    return points


def _cases() -> list[Any]:
    cases = []
    for model_name in BUILDERS:
        for point in points_of_block(model_name):
            for edit in EDITS:
                if edit == "zero_head" and _head_axis(point) is None:
                    continue
                cases.append(
                    pytest.param(model_name, point, edit, id=f"{model_name}-{point}-{edit}")
                )
    return cases


def _max_relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |value − reference| / max |reference|`` (an all-zero reference must be matched
    exactly: inf for any difference)."""
    assert value.shape == reference.shape
    diff = float((value - reference).abs().max()) if value.numel() else 0.0
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


@contextmanager
def user_hook(model: Any, point: str, hook: Callable[..., Any]) -> Iterator[None]:
    """The user's own hook, added with ``model.add_hook`` (not a context of the library)."""
    model.add_hook(point, hook)
    try:
        yield
    finally:
        model.reset_hooks()


def method_results(model: Any, point: str, hook: Callable[..., Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with user_hook(model, point, hook):
        for method, options in METHOD_CASES:
            attr = attribute(model, PROMPTS, TARGET, method=method, **options)
            for field in FIELDS:
                value = getattr(attr, field)
                if value is not None:
                    out[f"{method}{options}/{field}"] = value
    return out


def user_backward(model: Any, point: str, hook: Callable[..., Any]) -> dict[str, torch.Tensor]:
    """Parameter gradients of the user's own ``logit(are) − logit(is)`` backward: one prompt
    unpadded (fused kernel, ``is_causal``), then the padded batch (fused kernel with a mask)."""
    are, is_ = (model.tokenizer.convert_tokens_to_ids(t) for t in ("are", "is"))
    grads: dict[str, torch.Tensor] = {}
    unused = unused_parameters(model)
    with user_hook(model, point, hook):
        for kind, batch in (
            ("single", to_batch(model, PROMPTS[:1])),
            ("padded", to_batch(model, PROMPTS)),
        ):
            assert batch.padded == (kind == "padded")
            logits = model(batch.tokens, **batch.model_kwargs())
            (logits[:, -1, are] - logits[:, -1, is_]).sum().backward()
            for name, param in model.named_parameters():
                if name in unused:
                    assert param.grad is None, name
                    continue
                assert param.grad is not None, name
                grads[f"{kind}/{name}"] = param.grad
                param.grad = None
    return grads


def unused_parameters(model: Any) -> set[str]:
    """Parameters no forward reads: none on TransformerLens 3.9; on a GPT-2 bridge the fused
    ``c_attn`` (``attn.qkv``) weight and bias it keeps beside the split q/k/v it runs."""
    tokens = to_batch(model, PROMPTS[:1]).tokens
    model(tokens)[:, -1].square().sum().backward()
    unused = {n for n, p in model.named_parameters() if p.grad is None}
    model.zero_grad(set_to_none=True)
    assert all(".attn.qkv." in n for n in unused) if BRIDGE else not unused, unused
    return unused


def _model_state(model: Any) -> dict[str, Any]:
    return {
        "fingerprint": model_state_fingerprint(model),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "classes": {n: type(m) for n, m in model.named_modules()},
    }


def _assert_same_state(model: Any, before: dict[str, Any]) -> None:
    after = _model_state(model)
    assert after["fingerprint"] == before["fingerprint"]
    assert after["classes"] == before["classes"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())


def test_method_cases_cover_every_gradient_method() -> None:
    gradient_methods = {name for name, spec in METHODS.items() if spec.uses_gradient}
    assert {method for method, _ in METHOD_CASES} == gradient_methods


def test_every_kind_of_hook_point_is_covered() -> None:
    """The grid below is not vacuous: the points the issue names are in it."""
    gpt2, llama = set(points_of_block("gpt2")), set(points_of_block("llama"))
    block = f"blocks.{LAYER}."
    for suffix in (
        "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k",
        "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
        "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized",
        "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
    ):  # fmt: skip
        if BRIDGE and suffix == "hook_resid_mid":
            continue
        assert block + suffix in gpt2 and block + suffix in llama, suffix
    assert {
        block + s for s in ("attn.hook_rot_q", "attn.hook_rot_k", "mlp.hook_pre_linear")
    } <= llama
    if not BRIDGE:  # the 3.9 fast path's copying hook point where a kernel saves its output
        assert type(model_named("gpt2_relu").blocks[LAYER].mlp.hook_post) is CopyingHookPoint


@pytest.mark.parametrize(("model_name", "point", "edit"), _cases())
def test_in_place_edit_equals_clone_then_edit(model_name: str, point: str, edit: str) -> None:
    model = model_named(model_name)
    before = _model_state(model)
    edited, reference = in_place(EDITS[edit], point), clone_then_edit(EDITS[edit], point)
    got, want = method_results(model, point, edited), method_results(model, point, reference)
    _assert_same_state(model, before)
    got |= user_backward(model, point, edited)
    want |= user_backward(model, point, reference)
    _assert_same_state(model, before)
    assert got.keys() == want.keys()
    errors = {key: _max_relative(got[key], want[key]) for key in want}
    assert max(errors.values()) <= RTOL, {k: e for k, e in errors.items() if e > RTOL}


def test_the_edit_is_not_a_no_op() -> None:
    """The oracle has teeth: the edits change the results they are compared on."""
    model = model_named("llama")
    point = f"blocks.{LAYER}.attn.hook_z"
    plain = method_results(model, point, lambda x, hook: None)
    edited = method_results(model, point, in_place(_zero_head, point))
    key = "grad_x_input{}/scores"
    assert _max_relative(edited[key], plain[key]) > 1e-3


def _backward_with(model: Any, register: Callable[[Any], Any]) -> dict[str, torch.Tensor]:
    """Parameter gradients of one unpadded backward with the hook that ``register`` installs."""
    tokens = to_batch(model, PROMPTS[:1]).tokens
    unused = unused_parameters(model)
    handle = register(model)
    try:
        model(tokens)[:, -1].square().sum().backward()
    finally:
        handle.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if n not in unused}
    assert all(g is not None for g in grads.values())
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("point", [f"blocks.{LAYER}.attn.hook_z", f"blocks.{LAYER}.ln1.hook_scale"])
@pytest.mark.parametrize("kind", ["pre", "global_forward", "global_pre"])
def test_pre_and_global_hooks_may_edit_in_place(point: str, kind: str) -> None:
    """Raw PyTorch forward pre-hooks and global (module) hooks, not only TransformerLens' own."""
    model = model_named("llama")
    hook_point = model.hook_dict[point]
    grads = []
    for clone in (False, True):

        def edit(x: torch.Tensor, clone: bool = clone) -> torch.Tensor:
            x = x.clone() if clone else x
            x[..., :1] *= 0.5
            return x

        def register(model: Any, clone: bool = clone) -> Any:
            if kind == "pre":
                return hook_point.register_forward_pre_hook(lambda m, args: (edit(args[0]),))
            if kind == "global_pre":
                return torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda m, args: (edit(args[0]),) if m is hook_point else None  # type: ignore[arg-type]
                )
            return torch.nn.modules.module.register_module_forward_hook(
                lambda m, args, out: edit(out) if m is hook_point else None  # type: ignore[arg-type]
            )

        grads.append(_backward_with(model, register))
    assert max(_max_relative(grads[0][n], g) for n, g in grads[1].items()) <= RTOL


def test_plain_transformer_lens_model_is_protected_inside_a_call() -> None:
    """Without the fast path, the model guard makes ``hook_scale`` safe for the call only."""
    model = tiny_llama(seed=1, dtype=F64)
    if BRIDGE:  # load_model protects a bridge's points for good: as a user's own bridge, without
        unprotect_saved_outputs(saved_output_hook_points(model))
    point = f"blocks.{LAYER}.ln2.hook_scale"
    assert type(model.hook_dict[point]) is HookPoint
    before = _model_state(model)
    results = []
    for hook in (in_place(_halve_slice, point), clone_then_edit(_halve_slice, point)):
        with user_hook(model, point, hook):
            results.append(attribute(model, PROMPTS, TARGET, method="grad_x_input").scores)
    assert _max_relative(results[0], results[1]) <= RTOL
    _assert_same_state(model, before)
    assert type(model.hook_dict[point]) is HookPoint
