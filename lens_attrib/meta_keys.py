"""Every key of ``Attribution.meta``: what it means, and who writes it (the one place they are
documented; ``tests/test_meta_keys.py`` runs every method and fails on an undocumented key).

``written_by`` names registered methods, or :data:`EVERY_METHOD` (the registry's wrapper writes
it for every method), or :data:`AGGREGATE` (:func:`lens_attrib.aggregate.to_words` and
:func:`~lens_attrib.aggregate.to_spans`). ``when`` is the condition under which the key is
present; empty means always (for its writers). "per item" values are lists or batch-first
tensors, sliced by ``attr[i]``.

One quantity, one key: the sum-rule gap ``(f − f_ref) − Σ_i R_i`` of the methods that have a
sum rule is ``completeness_gap`` everywhere (Integrated Gradients and DeepLIFT: reference
``f(b)`` of the baseline; LRP/AttnLRP: reference 0).
"""

from __future__ import annotations

from dataclasses import dataclass

EVERY_METHOD = "every method"
"""``written_by`` value: the registry's wrapper writes the key, whatever the method."""
AGGREGATE = "lens_attrib.aggregate"
"""``written_by`` value: the key is added when an Attribution is aggregated to words or spans."""

_IG_DL = ("integrated_gradients", "deeplift")
_SUM_RULE = ("integrated_gradients", "deeplift", "lrp", "attnlrp")


@dataclass(frozen=True)
class MetaKey:
    """One ``meta`` key: its meaning (one line), its writers, and when it is present."""

    meaning: str
    written_by: tuple[str, ...]
    when: str = ""


META_KEYS: dict[str, MetaKey] = {
    # ------------------------------------------------------------- the wrapper, every method
    "dtype": MetaKey("dtype of the scores (str)", (EVERY_METHOD,)),
    "seconds": MetaKey("wall-clock seconds of the call", (EVERY_METHOD,)),
    "options": MetaKey(
        "the options used, defaults filled in and resolved (a tensor as 'tensor')", (EVERY_METHOD,)
    ),
    "model": MetaKey("the model's cfg.model_name", (EVERY_METHOD,)),
    "label": MetaKey("the method's display label (MethodSpec.label)", (EVERY_METHOD,)),
    "target_free": MetaKey(
        "the scores do not depend on the target token or foil (MethodSpec.target_free)",
        (EVERY_METHOD,),
    ),
    "causal": MetaKey(
        "the model is a causal decoder (positions after the target are 0)", (EVERY_METHOD,)
    ),
    "model_dtype": MetaKey("dtype of the model's weights (str)", (EVERY_METHOD,)),
    "upcast_to": MetaKey(
        "dtype the scores were computed in, above the model's half precision",
        (EVERY_METHOD,),
        when="a bfloat16/float16 model whose method computes in higher precision",
    ),
    "target_tokens": MetaKey(
        "per item, the explained token as a string (None: no label)",
        (EVERY_METHOD,),
        when="the target is not a regression",
    ),
    "foil_tokens": MetaKey(
        "per item, the foil token as a string, or None without a foil",
        (EVERY_METHOD,),
        when="the target is not a regression",
    ),
    "start_token": MetaKey(
        "per item, the start token added in front of the input (None: none added)", (EVERY_METHOD,)
    ),
    "start_token_policy": MetaKey(
        "the start-token rule applied (inputs.start_token_of) and whether inputs were text or ids",
        (EVERY_METHOD,),
    ),
    "layers": MetaKey(
        "the real layer numbers of the rows of layer_scores",
        (EVERY_METHOD,),
        when="the method fills layer_scores",
    ),
    # ----------------------------------------------- generation (Target(generate=N) / continuation)
    "prompt_length": MetaKey(
        "prompt length in tokens (a list: one per prompt)",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "generated_ids": MetaKey(
        "the generated (or forced) token ids (a list per prompt)",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "generated_tokens": MetaKey(
        "the generated (or forced) tokens as strings (a list per prompt)",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "steps": MetaKey(
        "number of explained steps (a list: one per prompt)",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "continuation": MetaKey(
        "True: the steps are a forced continuation, not greedy generation",
        (EVERY_METHOD,),
        when="Target(continuation=...)",
    ),
    "step_prompt": MetaKey(
        "per step row, the index of its prompt",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "step_index": MetaKey(
        "per step row, its step number within its prompt's continuation",
        (EVERY_METHOD,),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "step_scores": MetaKey(
        "per step row: probability, log_probability, entropy, logit (logit_difference with foils)",
        (EVERY_METHOD,),
        when="Target(continuation=...)",
    ),
    "sampling": MetaKey(
        "how generated tokens were drawn: seed (the one drawn when none was given) and options",
        (EVERY_METHOD,),
        when="Target(generate=N, sample=True)",
    ),
    "contrast_ids": MetaKey(
        "the contrastive continuation's token ids (a list per prompt)",
        (EVERY_METHOD,),
        when="Target(continuation=..., contrast=...)",
    ),
    "contrast_tokens": MetaKey(
        "the contrastive continuation's tokens as strings (a list per prompt)",
        (EVERY_METHOD,),
        when="Target(continuation=..., contrast=...)",
    ),
    "contrast_alignments": MetaKey(
        "per prompt, the contrast index a(s) aligned with every step s",
        (EVERY_METHOD,),
        when="Target(continuation=..., contrast=...)",
    ),
    "chat": MetaKey(
        "per row, the role segments (role, turn, token range) of its chat prompt",
        (EVERY_METHOD,),
        when="the inputs are ChatPrompt(s) from lens_attrib.chat_prompt",
    ),
    # ------------------------------------------------------------------ method-specific facts
    "explained_value": MetaKey(
        "per item, the explained scalar f on the explained input",
        ("alti_logit", "grad_ellm", "grad_x_input", "decompx", *_SUM_RULE),
        when="decompx: only with a Target.head (a classifier head)",
    ),
    "relevance_sum": MetaKey("per item, Σ_i R_i over real tokens", _SUM_RULE),
    "completeness_gap": MetaKey(
        "per item, the sum-rule gap (f − f_ref) − Σ_i R_i (f_ref = f(b), or 0 for LRP/AttnLRP)",
        _SUM_RULE,
    ),
    "baseline_value": MetaKey("per item, f(b) at the baseline b", _IG_DL),
    "input_value": MetaKey(
        "per item, f on the prompt as given (differs from explained_value with a prepended sink)",
        _IG_DL,
    ),
    "prepended_sink": MetaKey(
        "per item, whether a sink token was prepended for the explanation", _IG_DL
    ),
    "signed_scores": MetaKey(
        "[batch, pos] the signed Σ_d scores of the same pass (what pooling='sum' returns)",
        ("integrated_gradients",),
        when="pooling='l1' or 'l2'",
    ),
    "n_steps": MetaKey("per item, integrand evaluations spent", ("integrated_gradients",)),
    "panels": MetaKey("per item, quadrature panels of the final rule", ("integrated_gradients",)),
    "step_batch": MetaKey(
        "per item, interpolation rows per forward (n_steps='auto': the largest forward holding "
        "the item's rows, which items advancing together share)",
        ("integrated_gradients",),
    ),
    "target_position_only": MetaKey(
        "True: the model has no head, so only the target position was resolved (no token)",
        ("alti", "attention", "rollout", "globenc", "decompx", "value_zeroing"),
    ),
    "layer": MetaKey("the layer whose attention was read", ("attention",)),
    "hooks": MetaKey(
        "the residual hook names read, one per row of layer_scores",
        (
            "logat",
            "normxlogit",
        ),
    ),
    "no_label": MetaKey(
        "True: the model has no head at all, so the record carries no target label",
        ("embed_norm",),
        when="a model without any head",
    ),
    "through": MetaKey(
        "what the decomposition was carried through on top (norms or head)", ("decompx",)
    ),
    "step_aggregate": MetaKey(
        "the mean of the step maps [pos] (prompt tokens: [:prompt_length])",
        ("grad_ellm",),
        when="Target(generate=N) or Target(continuation=...)",
    ),
    "probe_steps": MetaKey("per item, probe steps taken", ("reagent",)),
    "stopped_probes": MetaKey("per item, probes that met the stopping condition", ("reagent",)),
    # ------------------------------------------------------------------------- aggregation
    "aggregation": MetaKey(
        "how tokens were aggregated: unit, reduce, the parts dropped", (AGGREGATE,)
    ),
    "unit_tokens": MetaKey("per item, the token positions of every unit (word/span)", (AGGREGATE,)),
    "unit_chars": MetaKey(
        "per item, the character span of every unit",
        (AGGREGATE,),
        when="aggregated to words or spans (not to roles)",
    ),
    "explained_token": MetaKey(
        "per item, the real-token position of the explained token (its unit is the target unit)",
        (AGGREGATE,),
    ),
}
"""``meta`` key → :class:`MetaKey` (meaning, writers, condition)."""


__all__ = ["AGGREGATE", "EVERY_METHOD", "META_KEYS", "MetaKey"]
