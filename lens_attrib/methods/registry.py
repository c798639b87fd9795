"""The method registry: a :class:`MethodSpec` per method, and the wrapper that runs every one.

A method is one *core* function ``core(model, batch, target, **options) -> MethodOutput``
registered with its spec::

    @register("grad_x_input", label="Gradient×Input", uses_gradient=True,
              options={"embeddings": Option("full", choices=EMBEDDINGS)})
    def grad_x_input(model, batch, target, *, embeddings):
        ...
        return MethodOutput(scores, forward.resolved)

``register`` returns the public function ``(model, inputs, target=None, *, attention_mask=None,
**options) -> Attribution``. The wrapper does, for every method alike: option validation (unknown
names and disallowed values are errors naming the allowed ones), the architecture check (naming
the method that applies instead), input preparation (strings, ids, masks → :class:`Batch`; the
default target; generation steps), the model guard and autograd mode, timing, finiteness checks,
and packaging into an :class:`~lens_attrib.attribution.Attribution`. ``METHODS`` maps names to
specs (a spec is callable like its public function).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.backend import Arch, arch_of, check_applies_to, processing_signatures
from lens_attrib.chat import chat_inputs, chat_meta
from lens_attrib.classifiers.checkpoint_head import with_model_head
from lens_attrib.errors import (
    InputError,
    ModelError,
    NonFiniteError,
    OptionError,
    TargetError,
)
from lens_attrib.finite import check_score_weights, raise_if_weights_nonfinite
from lens_attrib.forward import grad_context, no_grad_context
from lens_attrib.inputs import Batch, StartTokenLike, start_token_meta, to_batch
from lens_attrib.progress import bars_closed_after
from lens_attrib.target import ResolvedTarget, Target, warn_about_spaces


@dataclass(frozen=True)
class Option:
    """A method option: its default, and either the allowed values or a check.

    ``check(value)`` returns ``None`` when the value is fine, else a phrase saying what is
    allowed (e.g. ``"a positive integer"``).
    """

    default: Any
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    help: str = ""

    def validate(self, method: str, name: str, value: Any) -> None:
        if self.choices is not None and not any(
            value is c or (not isinstance(value, Tensor) and value == c) for c in self.choices
        ):
            raise OptionError(
                f"{method}: {name}={value!r} is not allowed; choose one of {list(self.choices)}."
            )
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise OptionError(
                    f"{method}: {name}={value!r} is not allowed; it must be {problem}."
                )


def positive_int_or_none(value: Any) -> str | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    return None if ok else "a positive integer or None"


def positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "a positive integer"


def integer(value: Any) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"


def is_bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else "True or False"


@dataclass
class MethodOutput:
    """What a core function returns (the wrapper packages it into an Attribution).

    ``layers``: the real layer numbers of the rows of ``layer_scores`` (default ``0..L−1``);
    ``options``: option values the core resolved itself (e.g. a default baseline chosen from the
    architecture), recorded in ``meta["options"]`` instead of the given ``None``.
    """

    scores: Tensor
    resolved: ResolvedTarget
    layer_scores: Tensor | None = None
    head_scores: Tensor | None = None
    head_token_scores: Tensor | None = None
    parts: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    layers: list[int] | None = None
    options: dict[str, Any] = field(default_factory=dict)


CoreFn = Callable[..., MethodOutput]


@dataclass(frozen=True)
class MethodSpec:
    """Everything the library knows about a method besides its core computation.

    decoder/encoder:  where it applies (``instead``: the method to suggest where it does not);
    per_layer:        fills ``layer_scores``; head_relevances: takes ``heads=True`` and fills
    ``head_scores``/``head_token_scores``; uses_gradient: runs a backward pass;
    target_free:      its scores do not depend on the target token or foil (only on the
    position), so a contrastive label is meaningless for it; needs_head: without a head on top
    (an encoder without MLM head) it cannot run, otherwise it runs position-only;
    parametrization: its scores change when TransformerLens processes the weights (folding
    norms, centring) beyond the float rounding of that processing (see
    :func:`warn_if_processed`; ``center_unembed`` changes every non-contrastive target's logit,
    :func:`warn_if_logits_centred`).
    """

    name: str
    core: CoreFn
    label: str
    summary: str = ""
    decoder: bool = True
    encoder: bool = True
    per_layer: bool = False
    head_relevances: bool = False
    uses_gradient: bool = False
    target_free: bool = False
    needs_head: bool = True
    parametrization: bool = False
    instead: str | None = None
    options: Mapping[str, Option] = field(default_factory=dict)

    def __call__(
        self,
        model: Any,
        inputs: Any,
        target: Target | None = None,
        *,
        attention_mask: Any = None,
        **options: Any,
    ) -> Attribution:
        return run_method(self, model, inputs, target, attention_mask=attention_mask, **options)

    def applies_to(self, *, encoder: bool) -> bool:
        """Whether it runs on an encoder (``encoder=True``) or a decoder; the finer limits of
        particular architectures are :func:`lens_attrib.backend.architecture_limit`'s."""
        return self.encoder if encoder else self.decoder

    def resolve_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in; unknown names and disallowed values raise :class:`OptionError`."""
        unknown = [k for k in given if k not in self.options]
        if unknown:
            raise unknown_option_error(self, unknown[0], given[unknown[0]])
        resolved = {name: opt.default for name, opt in self.options.items()}
        resolved.update(given)
        for name, value in given.items():
            self.options[name].validate(self.name, name, value)
        return resolved


METHODS: dict[str, MethodSpec] = {}
"""Registered methods: name -> :class:`MethodSpec` (callable like the public function)."""

TARGET_FIELDS = (
    "token",
    "foil",
    "position",
    "head",
    "regression",
    "generate",
    "continuation",
    "labels",
    "sample",
    "seed",
    "temperature",
    "top_k",
    "top_p",
    "contrast",
    "contrast_alignments",
)


def unknown_option_error(spec: MethodSpec, name: str, value: Any) -> OptionError:
    """An error for an option ``spec`` does not take, with the fix (Target fields, heads=True,
    a close spelling)."""
    options = sorted(spec.options) or "none"
    if name == "heads":
        have = {n: s for n, s in METHODS.items() if s.head_relevances}  # from the specs only
        takes = sorted(n for n, s in have.items() if "heads" in s.options)
        always = sorted(n for n, s in have.items() if "heads" not in s.options)
        if spec.head_relevances:
            return OptionError(
                f"{spec.name} always returns per-head relevances (attr.head_scores): it takes "
                f"no heads= option, drop heads={value!r}. Its options: {options}."
            )
        return OptionError(
            f"{spec.name} has no per-head relevances (heads={value!r}); methods that have "
            f"them: {takes} (with heads=True) and {always} (always, in attr.head_scores)."
        )
    if name in TARGET_FIELDS:
        return OptionError(
            f"{spec.name} has no option {name!r}: {name} belongs to the Target, which is the "
            f"third argument: attribute(model, inputs, Target({name}={value!r}), "
            f"method={spec.name!r}). Its options: {options}."
        )
    close = difflib.get_close_matches(name, list(spec.options), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return OptionError(f"{spec.name} has no option {name!r}; its options: {options}.{hint}")


def register(
    name: str,
    *,
    label: str,
    options: Mapping[str, Option] | None = None,
    **facts: Any,
) -> Callable[[CoreFn], Callable[..., Attribution]]:
    """Register ``core`` under ``name`` with the spec ``facts``; return the public function."""

    def wrap(core: CoreFn) -> Callable[..., Attribution]:
        opts = dict(options or {})
        params = inspect.signature(core).parameters
        keywords = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        if keywords != set(opts):
            raise TypeError(
                f"{name}: the core's keyword-only parameters {sorted(keywords)} must be the "
                f"spec's options {sorted(opts)}."
            )
        doc = inspect.getdoc(core) or ""
        spec = MethodSpec(name, core, label, summary=doc.split("\n", 1)[0], options=opts, **facts)
        METHODS[name] = spec

        public = functools.wraps(core)(functools.partial(run_method, spec))
        public.spec = spec  # type: ignore[attr-defined]
        return public  # type: ignore[return-value]

    return wrap


def unregister(name: str) -> None:
    """Remove a method (tests that register temporary methods)."""
    METHODS.pop(name, None)


# --------------------------------------------------------------------------- the wrapper
def prepare(
    model: Any,
    inputs: Any,
    target: Target | None,
    *,
    attention_mask: Any = None,
    prepend_bos: bool | None = None,
    token_type_ids: Any = None,
    start_token: StartTokenLike = None,
) -> tuple[Batch, Target]:
    """Batch the inputs and default the target (generation becomes one row per step)."""
    if target is not None and not isinstance(target, Target):
        raise TargetError(
            f"target must be a lens_attrib.Target, got {type(target).__name__} {target!r}: "
            f"write Target({target!r}) for a token, and pass the method by name "
            "(method='...')."
        )
    inputs, chats = chat_inputs(inputs)  # ChatPrompt(s): their ids, segments kept for meta
    texts = prompt_texts(inputs)
    if texts is not None and getattr(model, "tokenizer", None) is None:
        raise InputError(
            f"The model has no tokenizer, so the text {texts[0]!r} cannot be split into tokens "
            "(a checkpoint folder without tokenizer files loads without one). Pass token ids, "
            "or give it one: model.tokenizer = AutoTokenizer.from_pretrained(folder_with_it)."
        )
    batch = to_batch(
        model,
        inputs,
        start_token=start_token,
        prepend_bos=prepend_bos,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
    )
    if chats is not None:
        batch.extra["chat"] = chats
    target = with_model_head(model, target or Target())
    warn_about_spaces(model, batch, target, texts)
    if target.generate > 0 or target.continuation is not None:  # one row per step (generation.py)
        from lens_attrib.methods.generation import generation_batch

        batch, target, _ = generation_batch(model, batch, target)
    return batch, target


def prompt_texts(inputs: Any) -> list[str] | None:
    """The prompt strings of ``inputs`` (``None`` for ids, tokenizer outputs and tuples, which
    may be sentence pairs)."""
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        return list(inputs)
    return None


def check_model(model: Any) -> None:
    """A clear error for something that is not a TransformerLens model (None, a name, a
    tokenizer, a Hugging Face model)."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "cfg") and hasattr(model, "hooks"):
        return
    kind = type(model).__name__
    if model is None:
        problem = "model is None"
    elif isinstance(model, str):
        problem = f"model is the string {model!r}; load it first: model = load_model({model!r})"
    elif hasattr(model, "convert_tokens_to_ids") or hasattr(model, "encode_batch"):
        problem = (
            f"model is a tokenizer ({kind}), not a model; pass the model: a model from "
            "load_model(...) carries its tokenizer as model.tokenizer"
        )
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        problem = (
            f"model is a Hugging Face {kind}, not a TransformerLens model; load the checkpoint "
            "with lens_attrib.load_model(folder_or_name)"
        )
    else:
        problem = f"model is a {kind}"
    raise ModelError(
        f"{problem}. The first argument must be a TransformerLens HookedTransformer or "
        "HookedEncoder, e.g. lens_attrib.load_model('smollm2-135m')."
    )


def token_labels(model: Any, target: Target, ids: Tensor | None) -> list[str] | None:
    """Display names of the explained outputs: tokens, or classes of a class head."""
    if ids is None:
        return None
    if target.head is not None:
        names = list(target.labels) if target.labels is not None else None
        return [
            names[i] if names is not None and i < len(names) else f"class {i}" for i in ids.tolist()
        ]
    if model.tokenizer is None:
        return None
    return [model.tokenizer.decode([int(i)]) for i in ids.tolist()]


def zero_after_target(t: Tensor | None, positions: Tensor, pos_dim: int) -> Tensor | None:
    """Set entries at positions after each item's target position to 0 (causal models)."""
    if t is None:
        return None
    idx = torch.arange(t.shape[pos_dim], device=t.device)
    after = idx[None, :] > positions.to(t.device)[:, None]  # [batch, pos]
    shape = [after.shape[0]] + [1] * (t.ndim - 1)
    shape[pos_dim] = after.shape[1]
    return t.masked_fill(after.reshape(shape), 0.0)


def check_finite(name: str, tensor: Tensor, model: Any = None) -> None:
    """Relevances are finite; else the non-finite weight is named (when ``model`` is given),
    or the likely overflow."""
    if not torch.isfinite(tensor).all():
        if model is not None:
            raise_if_weights_nonfinite(model)
        raise NonFiniteError(
            f"{name} produced non-finite relevances (NaN/inf). In float32/bf16 this is usually an "
            "overflow: retry in float64 (model.to(torch.float64)) or with another baseline."
        )


def package(
    model: Any,
    batch: Batch,
    target: Target,
    spec: MethodSpec,
    out: MethodOutput,
    options: dict[str, Any],
    started: float,
) -> Attribution:
    """An Attribution of ``out``: detached, on the CPU, zero at padding and, for causal models,
    at every position after the explained one (it cannot influence the explained scalar)."""
    mask = batch.mask.to(out.scores.device)
    masked: Tensor | None = out.scores.detach().masked_fill(~mask, 0.0)
    signed: Tensor | None = out.meta.get("signed_scores")
    if signed is not None:
        signed = signed.detach().masked_fill(~mask.to(signed.device), 0.0)
    layer_scores, head_token_scores = out.layer_scores, out.head_token_scores
    if batch.arch.causal:
        positions = out.resolved.positions
        masked = zero_after_target(masked, positions, 1)
        signed = zero_after_target(signed, positions, 1)
        layer_scores = zero_after_target(layer_scores, positions, 2)
        head_token_scores = zero_after_target(head_token_scores, positions, 3)
    assert masked is not None
    scores: Tensor = masked
    used = {**options, **out.options}
    meta: dict[str, Any] = {
        "dtype": str(scores.dtype),
        "seconds": time.perf_counter() - started,
        "options": {k: ("tensor" if isinstance(v, Tensor) else v) for k, v in used.items()},
        "model": getattr(model.cfg, "model_name", None),
        "label": spec.label,
        "target_free": spec.target_free,
        "causal": batch.arch.causal,
        "model_dtype": str(batch.arch.dtype),
    }
    if batch.arch.dtype in (torch.bfloat16, torch.float16) and scores.dtype != batch.arch.dtype:
        meta["upcast_to"] = str(scores.dtype)  # computed in higher precision than the model
    resolved = out.resolved
    if not resolved.regression:
        meta["target_tokens"] = token_labels(model, target, resolved.token_ids)
        meta["foil_tokens"] = token_labels(model, target, resolved.foil_ids)
    meta.update(start_token_meta(batch))  # per item, and the policy (inputs.start_token_of)
    meta.update(batch.extra.get("generation", {}))  # prompt_length, generated ids (generate>0)
    meta.update(chat_meta(batch.extra, batch.size))  # role segments of ChatPrompt inputs
    if out.layer_scores is not None:
        meta["layers"] = (
            out.layers if out.layers is not None else list(range(int(out.layer_scores.shape[1])))
        )
    meta.update(out.meta)
    if signed is not None:
        meta["signed_scores"] = signed.cpu()  # masked as the scores are

    def cpu(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().cpu()

    return Attribution(
        scores=scores.cpu(),
        tokens=batch.str_tokens,
        token_ids=batch.tokens.cpu(),
        mask=batch.mask.cpu(),
        target=resolved.to("cpu"),
        method=spec.name,
        layer_scores=cpu(layer_scores),
        head_scores=cpu(out.head_scores),
        head_token_scores=cpu(head_token_scores),
        parts={k: v.detach().cpu() for k, v in out.parts.items()},
        meta=meta,
        token_types=cpu(batch.token_types),
    )


_WARNED_PROCESSED: weakref.WeakSet[Any] = weakref.WeakSet()
_CHECKED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], ...]] = weakref.WeakKeyDictionary()


def _weights_version(model: Any) -> tuple[tuple[int, int], ...]:
    """Storage and in-place version of every parameter: changes when the weights change."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


_SIGNATURES: weakref.WeakKeyDictionary[Any, tuple[Any, list[str]]] = weakref.WeakKeyDictionary()


def _processing_found(model: Any, arch: Arch) -> list[str]:
    """:func:`processing_signatures` read once per weight version (it reduces the embedding and
    unembedding matrices: seconds on a 50k-token vocabulary, more than a short attribution)."""
    version = _weights_version(model)
    cached = _SIGNATURES.get(model)
    if cached is not None and cached[0] == version:
        return cached[1]
    found = processing_signatures(model, arch)
    _SIGNATURES[model] = (version, found)
    return found


def processing_effect(phrase: str, normalization: str | None) -> str:
    """What one TransformerLens 3.9 processing step (a phrase of ``processing_signatures``)
    changes, for a model whose norms are now ``normalization`` (``"LNPre"``, ``"RMSPre"``, ...).

    Checked against TransformerLens' ``ProcessWeights`` and in ``tests/test_tl_operations.py``.
    """
    layer_norm = normalization in ("LN", "LNPre")
    step = phrase.split(" ", 1)[0]
    if step == "fold_ln" and layer_norm:
        return (
            "fold_ln folded each LayerNorm's scale and bias into the weights and biases that read "
            "it and centred those weights over d_model (LayerNormPre now only centres and "
            "scales): outputs equal the unprocessed model's in exact arithmetic only, and the "
            "normalised vectors and reading weights are not the checkpoint's."
        )
    if step == "fold_ln":
        return (
            "fold_ln folded each RMSNorm's scale into the weights that read it (RMSNormPre now "
            "only scales): outputs equal the unprocessed model's in exact arithmetic only, and "
            "the normalised vectors and reading weights are not the checkpoint's."
        )
    if step == "center_writing_weights" and layer_norm:
        return (
            "center_writing_weights centred W_E, W_pos, W_O, W_out and their biases over d_model, "
            "moving every residual vector along the all-ones direction, which each LayerNorm "
            "removes: outputs are unchanged in exact arithmetic, residual vectors, embeddings and "
            "their norms are not."
        )
    if step == "center_writing_weights":
        return (
            "the embedding is centred over d_model although the model's norms do not remove the "
            "mean (TransformerLens never centres an RMSNorm model's writing weights): its outputs "
            "may differ from the checkpoint's."
        )
    if step == "center_unembed":
        return (
            "center_unembed centred W_U and b_U over the vocabulary, moving every logit at a "
            "position by the same amount: probabilities and logit differences (a Target with a "
            "foil) are unchanged in exact arithmetic, raw logits are not, so every method that "
            "explains a single logit (no foil), gradient methods included, explains a different "
            "number."
        )
    if step == "fold_value_biases":
        return (
            "fold_value_biases moved the value biases into b_O: each layer's attention output is "
            "unchanged in exact arithmetic (attention rows sum to 1), each head's output is not."
        )
    return f"{phrase}."


def warn_if_processed(model: Any, arch: Arch) -> None:
    """Warn once per model when its weights were processed by TransformerLens.

    The warning says what each detected step changes (:func:`processing_effect`) and that
    TransformerLens 3.9 processes in float32 (``ProcessWeights.process_weights`` casts every
    floating tensor that is not float32 to float32 and back). The weights are read once per
    weight version, not on every call.
    """
    if model in _WARNED_PROCESSED:
        return
    version = _weights_version(model)
    if _CHECKED.get(model) == version:
        return
    _CHECKED[model] = version
    found = _processing_found(model, arch)
    if not found:
        return
    _WARNED_PROCESSED.add(model)
    affected = sorted(n for n, s in METHODS.items() if s.parametrization)
    effects = " ".join(processing_effect(phrase, arch.normalization) for phrase in found)
    warnings.warn(
        f"This model's weights were processed by TransformerLens: {'; '.join(found)}. {effects} "
        "TransformerLens 3.9 processes every weight in float32: a float64 model's weights (and "
        "rotary tables) are rounded to float32 precision, a bfloat16/float16 model's folded "
        f"weights are rounded back to its dtype. The methods {affected} read norms, residual "
        "vectors, embeddings, biases or per-head outputs, which the steps above change, so their "
        "scores can change beyond that rounding. Load it without processing: "
        "lens_attrib.load_model(...), or HookedTransformer.from_pretrained_no_processing(...).",
        UserWarning,
        stacklevel=4,
    )


_WARNED_CENTRED: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_if_logits_centred(model: Any, arch: Arch, method: str) -> None:
    """Warn once per model when ``center_unembed`` moved the logit a non-contrastive target
    explains: every method explains that number, so every method's scores change with it
    (a foil cancels the shift: logit differences are unchanged)."""
    if model in _WARNED_CENTRED or model in _WARNED_PROCESSED:
        return
    if not any(p.startswith("center_unembed") for p in _processing_found(model, arch)):
        return
    _WARNED_CENTRED.add(model)
    warnings.warn(
        f"{method}: this model's unembedding was centred by TransformerLens (center_unembed), "
        "which moves every logit at a position by the same amount, so the logit a target "
        "without foil explains is not the checkpoint's and every method's scores change with "
        "it. Pass a foil (Target(token, foil=...): logit differences are unchanged), or load "
        "the model without processing (lens_attrib.load_model(...)).",
        UserWarning,
        stacklevel=4,
    )


def run_method(
    spec: MethodSpec,
    model: Any,
    inputs: Any,
    target: Target | None = None,
    *,
    attention_mask: Any = None,
    token_type_ids: Any = None,
    start_token: StartTokenLike = None,
    prepend_bos: bool | None = None,
    **options: Any,
) -> Attribution:
    """Validate, prepare, guard, run ``spec.core``, check and package (module docstring)."""
    check_model(model)
    opts = spec.resolve_options(options)
    arch = arch_of(model)
    check_applies_to(spec.name, arch, spec.decoder, spec.encoder, spec.instead)
    check_score_weights(model)
    if spec.parametrization:
        warn_if_processed(model, arch)
    elif not (isinstance(target, Target) and target.contrastive):
        warn_if_logits_centred(model, arch, spec.name)
    started = time.perf_counter()
    batch, target = prepare(
        model,
        inputs,
        target,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        start_token=start_token,
        prepend_bos=prepend_bos,
    )
    context = grad_context if spec.uses_gradient else no_grad_context
    try:
        with context(model), bars_closed_after():
            out = spec.core(model, batch, target, **opts)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "memory" not in str(err).lower():
            raise
        raise memory_error(spec, batch, err) from err
    check_finite(spec.name, out.scores, model)
    if out.layer_scores is not None:
        check_finite(spec.name, out.layer_scores, model)
    return package(model, batch, target, spec, out, opts, started)


def memory_error(spec: MethodSpec, batch: Batch, err: BaseException) -> MemoryError:
    """An out-of-memory error that says what the method needed and what to do instead."""
    lean = sorted(n for n, s in METHODS.items() if not s.uses_gradient)
    chunked = sorted(n for n, s in METHODS.items() if {"chunk_size", "step_batch"} & set(s.options))
    need = (
        "a backward pass that keeps every layer's activations"
        if spec.uses_gradient
        else ("its activations")
    )
    return MemoryError(
        f"{spec.name} ran out of memory on a batch of {batch.size} item(s) × {batch.length} "
        f"tokens ({err}); it needs {need}, which grows with batch × tokens (× tokens for "
        f"attention). Pass fewer or shorter inputs, use a method without gradients ({lean}), "
        f"or one with chunking options ({chunked}: chunk_size / step_batch)."
    )


def attribute(
    model: Any,
    inputs: Any,
    target: Target | None = None,
    method: str = "grad_x_input",
    *,
    attention_mask: Any = None,
    token_type_ids: Any = None,
    start_token: StartTokenLike = None,
    prepend_bos: bool | None = None,
    **options: Any,
) -> Attribution:
    """Explain ``target`` for ``inputs`` with the registered ``method``.

    ``inputs``: a prompt, a list of prompts, token ids (tensor, array or lists, with an optional
    ``attention_mask``), or a tokenizer output; for encoders also a sentence pair
    ``(first, second)`` or a list of pairs. ``token_type_ids``: an encoder's segment ids in the
    layout of the ids (a ``BatchEncoding``'s own are used when not given); ``target``: a
    :class:`Target` (default: the model's prediction at the last real token). Options go to the
    method (see ``METHODS[name]``).

    Start token (:func:`lens_attrib.inputs.start_token_of`, the same for every entry point):
    a decoder prompt given as text gets the tokenizer's BOS where the model's config prepends
    one, else ``<|endoftext|>`` where the tokenizer has it (SmolLM2), so that the attention
    sink is a token of its own and not the first word. ``start_token=`` chooses another special
    token for this call (``False``: none; ``prepend_bos=`` is TransformerLens' flag); token ids
    are used exactly as given. Positions count the start token (real token 0).
    ``meta["start_token"]`` (per item) and ``meta["start_token_policy"]`` record what was used.
    """
    if not isinstance(method, str) or method not in METHODS:
        raise KeyError(unknown_method_message(method))
    return run_method(
        METHODS[method],
        model,
        inputs,
        target,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        start_token=start_token,
        prepend_bos=prepend_bos,
        **options,
    )


def unknown_method_message(method: Any) -> str:
    """``Unknown method 'altilogit'. Did you mean 'alti_logit'? Registered: [...]``."""
    hint = ""
    if isinstance(method, str):
        key = method.strip().lower().replace("-", "_").replace(" ", "_")
        close = [key] if key in METHODS else difflib.get_close_matches(key, list(METHODS), n=3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    elif isinstance(method, Target):
        hint = " The method is the fourth argument (or method='...'); the Target the third."
    return f"Unknown method {method!r}.{hint} Registered: {sorted(METHODS)}"


__all__ = [
    "METHODS",
    "MethodOutput",
    "MethodSpec",
    "Option",
    "attribute",
    "check_finite",
    "integer",
    "is_bool",
    "package",
    "positive_int",
    "positive_int_or_none",
    "prepare",
    "register",
    "run_method",
    "unregister",
]
