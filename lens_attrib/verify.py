"""``verify(model)``: the checks to run on *your* model before trusting an attribution.

Every check runs the registered methods (:func:`lens_attrib.attribute`) on this model and these
inputs and compares what they report with what must hold, independently recomputed:

- **LRP conservation** (``lrp``, CP-LRP): on a *copy* of the model with every bias zeroed
  (:func:`lens_attrib.tiny_models.zero_biases`, the head copied with it), the network is linear in
  its embeddings along the patched graph, so ``Σ_i R_i = f`` with ``f`` the explained logit of
  the copy (a plain forward). Run with the exact identity rule (``identity_eps=0``; LXT's default
  stabiliser ``1e-10`` moves each activation's share by ``ε/h``, not a rounding error).
- **AttnLRP gap** (``attnlrp``): its softmax rule is not conservative, so it reports
  ``meta["completeness_gap"]``; checked: ``Σ_i R_i + gap = f`` on the same bias-free copy (the
  gap is the true one). The gap's size is shown, as information.
- **IG completeness** (``integrated_gradients``): ``Σ_i R_i = f(x) − f(b)`` within IG's own
  tolerance (default 1 % of ``|f(x) − f(b)|``, the adaptive rule), and the reported
  ``meta["completeness_gap"]`` is the true ``f(x) − f(b) − Σ_i R_i``. It is the slowest check,
  so it runs on the first input only (every item's path is integrated alone anyway), with
  ``keep_sink=True`` (the first real token, the attention sink, stays fixed: on SmolLM2 64–128
  evaluations instead of 416–560 for the default ``"special"``, same rule and tolerance); pass
  ``options={"integrated_gradients": {...}}`` for other settings, e.g. ``n_steps=64`` for a
  fixed budget.
- **DeepLIFT summation** (``deeplift``): ``Σ_i R_i + gap = f(x) − f(b)`` with the reported gap.
  The Rescale rule sums to the difference exactly only through affine maps and element-wise
  activations; norms, softmax attention and gates leave a gap that DeepLIFT reports (shown).
- **ALTI-Logit decomposition** (``alti_logit``, decoders): token contributions + MLP + attention
  bias + embedding + bias (+ what the user's hooks add) reconstruct the explained logit of a
  plain forward, and without user hooks the hooks part is 0.
- **batched == single**: two inputs of different lengths batched (padded) against each alone.
- **float32 ≈ float64**: the model's own dtype against a float64 copy (n/a for float64 models).
- **model unchanged**: ``state_dict`` hashes, hooks, ``requires_grad``, ``.grad``, training mode,
  dtypes and devices before and after all checks (:mod:`lens_attrib.hooks.guard`).

A check that does not apply (ALTI-Logit on an encoder, a method that refuses the architecture,
no head to explain) is ``n/a`` with the method's own reason, never a failure.

Tolerances. ``u`` is the unit roundoff of the model's dtype (``finfo.eps / 2``: 1.1e-16 in
float64, 6.0e-8 in float32, 3.9e-3 in bfloat16), ``L`` the number of layers and ``d`` the width.
A sum identity (conservation, decomposition, reported gaps) is exact in real arithmetic; in
floating point each layer's matrix products sum ``d`` terms whose rounding errors add up like a
random walk (``≈ √d · u`` relative per product) and the ``L`` layers add them in sequence, so

    sum tolerance = 8 · √d · L · u,   relative to the scale  |f| + Σ_i |R_i|  (+ the parts),

(float32 SmolLM2: 3.4e-4; float64 tiny models: 1.5e-14; at most 0.05). Batched and single runs
differ only by the padding, which changes the blocking of products and reductions: per item the
largest score difference over the largest score must be within ``4 ×`` that. A float64 copy
removes the model dtype's rounding, of the same order, so float32 ≈ float64 uses the same
``4 ×`` bound (in the model's ``u``). IG's completeness is held to IG's own ``tolerance`` option.
The unchanged check is exact (tolerance 0). Measured on the bundled models (one CPU core):
SmolLM2 float32 errors 1e-8 to 1e-5 against tolerances 3.4e-4 / 1.4e-3, IG 0.6 % of 1 %, about
50 s in all; MiniLM about 6 s.

Memory: the copies are made one at a time and dropped after their checks; at most the model
plus one copy in float64 (three times a float32 model) is held.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.attribution import Attribution
from lens_attrib.backend import arch_of, deep_copy, has_hooks
from lens_attrib.errors import ModelError, OptionError, TargetError
from lens_attrib.forward import no_grad_context, run
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.inputs import to_batch
from lens_attrib.methods import METHODS, attribute
from lens_attrib.target import Target
from lens_attrib.tiny_models import zero_biases
from lens_attrib.verify_report import CheckRow, VerificationError, VerifyReport

DECODER_PROMPTS = ("The keys to the cabinet", "The author that the friends like is")
ENCODER_SENTENCES = ("the movie is very good", "the keys to the cabinet are on the table")
CHECKS = (
    "lrp_conservation",
    "attnlrp_gap",
    "ig_completeness",
    "deeplift_summation",
    "alti_logit_decomposition",
    "batched_equals_single",
    "float32_vs_float64",
    "model_unchanged",
)
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "lrp": {"identity_eps": 0.0},
    "integrated_gradients": {"keep_sink": True},
}
"""Options verify passes to methods unless ``options`` overrides them (see module docstring)."""
PROBE_SEED = 0


# ------------------------------------------------------------------------------- tolerances
def unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


def sum_tolerance(dtype: torch.dtype, n_layers: int, d_model: int) -> float:
    """``8 · √d · L · u`` (module docstring), at most 0.05."""
    return min(0.05, 8 * math.sqrt(d_model) * n_layers * unit_roundoff(dtype))


# ------------------------------------------------------------------------------- helpers
class _Context:
    """What every check needs: the model, its inputs as id lists, the target, the options."""

    def __init__(
        self,
        model: Any,
        items: list[list[int]],
        target: Target | None,
        options: Mapping[str, Mapping[str, Any]],
    ) -> None:
        self.model = model
        self.items = items
        self.target = target
        self.options = options
        self.arch = arch_of(model)
        self.tol = sum_tolerance(self.arch.dtype, self.arch.n_layers, self.arch.d_model)
        self.cache: dict[str, Attribution] = {}
        self.copies: dict[str, Any] = {}

    @property
    def head(self) -> Any:
        return None if self.target is None else self.target.head

    def opts(self, method: str) -> dict[str, Any]:
        return {**DEFAULT_OPTIONS.get(method, {}), **self.options.get(method, {})}

    def items_for(self, method: str) -> list[list[int]]:
        """The inputs ``method`` runs on: all, or the first only for IG (the slowest check)."""
        return self.items[:1] if method == "integrated_gradients" else self.items

    def attribute(self, method: str, model: Any = None, target: Any = "same") -> Attribution:
        """``method`` on the batched items (cached for the user's model and target)."""
        own = model is None and target == "same"
        if own and method in self.cache:
            return self.cache[method]
        result = attribute(
            self.model if model is None else model,
            self.items_for(method),
            self.target if target == "same" else target,
            method=method,
            **self.opts(method),
        )
        if own:
            self.cache[method] = result
        return result


def explained_value(model: Any, items: list[list[int]], attr: Attribution, head: Any) -> Tensor:
    """``f`` of every item by a plain forward of ``model``, for the target ``attr`` resolved."""
    batch = to_batch(model, items)
    target = fixed_target(attr, batch.mask, head)
    with no_grad_context(model):
        result = run(model, batch, target)
    assert result.value is not None
    return result.value.detach().cpu().to(torch.float64)


def fixed_target(attr: Attribution, mask: Tensor, head: Any = None) -> Target:
    """``attr``'s resolved target as a :class:`Target` (real-token positions), for re-runs."""
    resolved = attr.target
    mask = mask.cpu()
    positions = [int(mask[b, : int(resolved.positions[b])].sum()) for b in range(len(mask))]
    return Target(
        token=resolved.token_ids.cpu(),
        foil=None if resolved.foil_ids is None else resolved.foil_ids.cpu(),
        position=positions,
        head=head,
        regression=resolved.regression,
    )


def relevance_sums(attr: Attribution) -> Float[Tensor, "batch"]:
    return attr.scores.to(torch.float64).sum(-1)


def scale_of(*terms: Tensor) -> Tensor:
    """Per item ``Σ |term|`` (terms ``[batch]`` or ``[batch, n]``): the size of a sum identity."""
    total = torch.zeros(terms[0].shape[0], dtype=torch.float64)
    for t in terms:
        t = t.detach().to(torch.float64).abs()
        total = total + (t.sum(-1) if t.ndim > 1 else t)
    return total.clamp_min(torch.finfo(torch.float64).tiny)


def item_relative_difference(a: Attribution, b: Attribution, item: int, item_b: int = 0) -> float:
    """``max |a − b| / max |b|`` over the real tokens of one item of each."""
    x = a.item_scores(item).to(torch.float64)
    y = b.item_scores(item_b).to(torch.float64)
    if x.shape != y.shape:
        return math.inf
    scale = float(y.abs().max())
    diff = float((x - y).abs().max())
    return diff / scale if scale > 0 else diff


def copy_model(model: Any, head: Any, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A deep copy of ``model`` and ``head`` together (a head holding the model's modules, like
    :class:`lens_attrib.classifiers.LinearHead`'s ``ln_final``, then holds the copy's), the
    tokenizer shared; cast to ``dtype`` when given."""
    memo: dict[int, Any] = {}
    if getattr(model, "tokenizer", None) is not None:
        memo[id(model.tokenizer)] = model.tokenizer
    with torch.no_grad():
        model_copy, head_copy = deep_copy(model, (model, head), memo)
        if dtype is not None:
            model_copy.to(dtype, print_details=False)
            model_copy.cfg.dtype = dtype
            if isinstance(head_copy, nn.Module):
                head_copy.to(dtype)
    model_copy.eval()
    return model_copy, head_copy


def copyable_head(target: Target | None) -> str | None:
    """Why the target's head cannot be copied with the model (``None`` when it can)."""
    head = target.head if target is not None else None
    if head is None or isinstance(head, nn.Module):
        return None
    return (
        f"the target's head is a plain {type(head).__name__}, which cannot be copied with the "
        "model; pass an nn.Module head (e.g. lens_attrib.classifiers.LinearHead) to run this check"
    )


def tensor_digest(t: Tensor) -> str:
    data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def model_state(model: Any) -> dict[str, Any]:
    """The guard's fingerprint plus a hash of every ``state_dict`` entry and the config."""
    return {
        **model_state_fingerprint(model),
        "state_dict": {k: tensor_digest(v) for k, v in model.state_dict().items()},
        "cfg": repr(model.cfg),
    }


def differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Names of what changed between two :func:`model_state` snapshots."""
    changed = []
    for key in before:
        a, b = before[key], after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            changed += [f"{key}: {n}" for n in names]
        elif a != b:
            changed.append(key)
    return changed


def user_has_hooks(model: Any) -> bool:
    return any(has_hooks(point) for point in model.hook_dict.values())


def probe_head(model: Any) -> nn.Module:
    """A seeded random bias-free linear map ``[n, d_model] -> [n, 2]`` (headless encoders)."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    d = int(model.cfg.d_model)
    head = nn.Linear(d, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(2, d, generator=gen, dtype=torch.float64) / math.sqrt(d))
    return head.to(device=model.cfg.device, dtype=next(model.parameters()).dtype)


# ------------------------------------------------------------------------------- rows
def _row(
    check: str,
    method: str | None,
    error: float,
    tolerance: float,
    detail: str,
    extra_fail: str | None = None,
) -> CheckRow:
    ok = math.isfinite(error) and error <= tolerance and extra_fail is None
    detail = detail if extra_fail is None else f"{extra_fail}; {detail}"
    return CheckRow(check, method, "pass" if ok else "fail", error, tolerance, detail)


def _na(check: str, method: str | None, reason: str) -> CheckRow:
    return CheckRow(check, method, "n/a", None, None, reason)


def bias_free_copy(ctx: _Context) -> tuple[Any, Target | None, Any]:
    """A copy of the model (and of the target's head) with every bias zeroed, made once."""
    if "bias_free" not in ctx.copies:
        head = ctx.head
        model_copy, head_copy = copy_model(ctx.model, head)
        zero_biases(model_copy)
        if isinstance(head_copy, nn.Module):
            zero_biases(head_copy)
        target = ctx.target if ctx.target is None else ctx.target.with_(head=head_copy)
        ctx.copies["bias_free"] = (model_copy, target, head_copy)
    return ctx.copies["bias_free"]


def check_lrp_conservation(ctx: _Context) -> CheckRow:
    reason = copyable_head(ctx.target)
    if reason:
        return _na("lrp_conservation", "lrp", reason)
    model_copy, target, head = bias_free_copy(ctx)
    attr = ctx.attribute("lrp", model=model_copy, target=target)
    f = explained_value(model_copy, ctx.items, attr, head)
    sums = relevance_sums(attr)
    scale = scale_of(f, attr.scores)
    rel = (f - sums).abs() / scale
    reported = attr.meta["completeness_gap"].to(torch.float64)
    honest = (f - sums - reported).abs() / scale  # the method's own gap is the true one
    worst = int(rel.argmax())
    return _row(
        "lrp_conservation",
        "lrp",
        float(torch.maximum(rel, honest).max()),
        ctx.tol,
        f"Σ R = f on a bias-free copy (identity_eps={ctx.opts('lrp').get('identity_eps')}): "
        f"item {worst}: f = {float(f[worst]):.4g}, Σ R = {float(sums[worst]):.4g}",
    )


def check_attnlrp_gap(ctx: _Context) -> CheckRow:
    reason = copyable_head(ctx.target)
    if reason:
        return _na("attnlrp_gap", "attnlrp", reason)
    model_copy, target, head = bias_free_copy(ctx)
    attr = ctx.attribute("attnlrp", model=model_copy, target=target)
    f = explained_value(model_copy, ctx.items, attr, head)
    sums = relevance_sums(attr)
    gap = attr.meta["completeness_gap"].to(torch.float64)
    rel = (f - sums - gap).abs() / scale_of(f, attr.scores, gap)
    share = float((gap.abs() / f.abs().clamp_min(1e-300)).max())
    return _row(
        "attnlrp_gap",
        "attnlrp",
        float(rel.max()),
        ctx.tol,
        f"Σ R + reported gap = f on a bias-free copy; the softmax rule is not conservative: "
        f"reported gap up to {share:.1%} of |f|",
    )


def _difference_check(ctx: _Context, check: str, method: str, tolerance: float | None) -> CheckRow:
    """IG / DeepLIFT: ``Σ R + reported gap = f(x) − f(b)``, ``f(x)`` from a plain forward."""
    attr = ctx.attribute(method)
    f_input = explained_value(ctx.model, ctx.items_for(method), attr, ctx.head)
    meta = attr.meta
    value = meta["explained_value"].to(torch.float64)
    base = meta["baseline_value"].to(torch.float64)
    reported = meta["completeness_gap"].to(torch.float64)
    sums = relevance_sums(attr)
    delta = value - base
    actual = delta - sums
    scale = scale_of(value, base, attr.scores)
    honest = (actual - reported).abs() / scale
    # f(x) as the user's model computes it (IG's prepended sink changes f: compare input_value)
    drift = (meta["input_value"].to(torch.float64) - f_input).abs() / scale_of(f_input)
    bookkeeping = float(torch.maximum(honest, drift).max())
    problem = None
    if not bookkeeping <= ctx.tol:
        problem = (
            f"the reported gap or f(x) is not the true one (error {bookkeeping:.1e} > "
            f"{ctx.tol:.1e})"
        )
    relative_gap = actual.abs() / delta.abs().clamp_min(1e-300)
    worst = int(relative_gap.argmax())
    shown = f"item {worst}: f(x) − f(b) = {float(delta[worst]):.4g}, Σ R = {float(sums[worst]):.4g}"
    if tolerance is None:  # DeepLIFT: the gap is information, the bookkeeping is the check
        return _row(
            check,
            method,
            bookkeeping,
            ctx.tol,
            f"Σ R + reported gap = f(x) − f(b); Rescale is exact only through affine maps and "
            f"element-wise activations: gap up to {float(relative_gap.max()):.1%} of "
            f"|f(x) − f(b)| ({shown})",
            problem,
        )
    steps = meta.get("n_steps")
    given = ", ".join(f"{k}={v!r}" for k, v in ctx.opts(method).items())
    return _row(
        check,
        method,
        float(relative_gap.max()),
        tolerance,
        f"|f(x) − f(b) − Σ R| / |f(x) − f(b)| ({shown}; {steps} evaluations per item; "
        f"{given or 'default options'})",
        problem,
    )


def check_ig_completeness(ctx: _Context) -> CheckRow:
    opts = ctx.opts("integrated_gradients")
    tolerance = float(
        opts.get("tolerance", METHODS["integrated_gradients"].options["tolerance"].default)
    )
    return _difference_check(ctx, "ig_completeness", "integrated_gradients", tolerance)


def check_deeplift_summation(ctx: _Context) -> CheckRow:
    return _difference_check(ctx, "deeplift_summation", "deeplift", None)


def check_alti_logit(ctx: _Context) -> CheckRow:
    attr = ctx.attribute("alti_logit")
    f = explained_value(ctx.model, ctx.items, attr, ctx.head)
    p = {k: v.to(torch.float64) for k, v in attr.parts.items()}
    terms = [attr.scores.to(torch.float64), p["mlp"], p["attn_bias"], p["embedding"], p["bias"]]
    total = sum(t.sum(-1) if t.ndim > 1 else t for t in terms)
    scale = scale_of(f, *terms, p["hooks"])
    hooked = user_has_hooks(ctx.model)
    error = (f - total - p["hooks"]).abs() / scale
    detail = "tokens + MLP + attention bias + embedding + bias + hooks = f"
    if not hooked:  # without user hooks the blocks' outputs are the whole residual stream
        error = torch.maximum(error, p["hooks"].abs() / scale)
        detail += "; no user hooks, so the hooks part is 0"
    else:
        detail += f"; the user's hooks add {float(p['hooks'].abs().max()):.3g}"
    return _row("alti_logit_decomposition", "alti_logit", float(error.max()), ctx.tol, detail)


def single_target(attr: Attribution, mask: Tensor, b: int, head: Any) -> Target:
    """The resolved target of item ``b`` alone."""
    resolved = attr.target
    position = int(mask[b, : int(resolved.positions[b])].sum())
    return Target(
        token=int(resolved.token_ids[b]),
        foil=None if resolved.foil_ids is None else int(resolved.foil_ids[b]),
        position=position,
        head=head,
        regression=resolved.regression,
    )


def check_batched(ctx: _Context, method: str) -> CheckRow:
    batched = ctx.attribute(method)
    mask = to_batch(ctx.model, ctx.items).mask.cpu()
    head = ctx.head
    errors = []
    for b, ids in enumerate(ctx.items):
        alone = attribute(
            ctx.model,
            [ids],
            single_target(batched, mask, b, head),
            method=method,
            **ctx.opts(method),
        )
        errors.append(item_relative_difference(batched, alone, b))
    lengths = "/".join(str(len(i)) for i in ctx.items)
    return _row(
        "batched_equals_single",
        method,
        max(errors),
        4 * ctx.tol,
        f"max |batched − single| / max |single| per item (lengths {lengths})",
    )


def check_float64(ctx: _Context, method: str) -> CheckRow:
    if ctx.arch.dtype == torch.float64:
        return _na("float32_vs_float64", method, "the model is already float64")
    reason = copyable_head(ctx.target)
    if reason:
        return _na("float32_vs_float64", method, reason)
    head = ctx.head
    mine = ctx.attribute(method)
    mask = to_batch(ctx.model, ctx.items).mask.cpu()
    if "float64" not in ctx.copies:
        ctx.copies.pop("bias_free", None)  # one copy at a time
        ctx.copies["float64"] = copy_model(ctx.model, head, torch.float64)
    model64, head64 = ctx.copies["float64"]
    target = fixed_target(mine, mask, head64)
    ref = attribute(model64, ctx.items, target, method=method, **ctx.opts(method))
    errors = [item_relative_difference(mine, ref, b, b) for b in range(len(ctx.items))]
    return _row(
        "float32_vs_float64",
        method,
        max(errors),
        4 * ctx.tol,
        f"max |{str(ctx.arch.dtype).replace('torch.', '')} − float64 copy| / max |float64| "
        "per item",
    )


# ------------------------------------------------------------------------------- driver
def check_weights_finite(model: Any) -> None:
    """A model with NaN/inf weights cannot be verified: say which parameters hold them.

    Heads that no attribution reads are skipped: an encoder's next-sentence head (``nsp_head``,
    ``pooler``), and for an encoder loaded without its masked-LM head (MiniLM) the uninitialised
    ``mlm_head``/``unembed`` parameters TransformerLens keeps.
    """
    arch = arch_of(model)
    unused: tuple[str, ...] = ("nsp_head.", "pooler.") if arch.encoder else ()
    if not arch.lm_head:
        unused += ("mlm_head.", "unembed.")
    bad = [
        n
        for n, p in model.named_parameters()
        if not n.startswith(unused) and not bool(torch.isfinite(p).all())
    ]
    if bad:
        raise ModelError(
            f"verify: the model's parameters {bad[:5]} hold NaN or inf values, so no attribution "
            "of it can be trusted; reload or repair the weights."
        )


def check_target(model: Any, items: list[list[int]], target: Target | None) -> None:
    """Resolve the target once on a plain forward, so that a wrong target is an error here
    rather than an n/a row in every check (inside the checks such errors are the methods'
    refusals)."""
    if target is not None and not isinstance(target, Target):
        raise TargetError(
            f"verify: target must be a lens_attrib.Target, got {type(target).__name__}."
        )
    if target is not None and target.generate:
        raise TargetError(
            f"verify checks one target per input; Target(generate={target.generate}) is not "
            "supported: pass the generated text as the input and explain its last token."
        )
    with no_grad_context(model):
        run(model, to_batch(model, items), target or Target())


def default_inputs(model: Any) -> tuple[str, ...]:
    return ENCODER_SENTENCES if arch_of(model).encoder else DECODER_PROMPTS


def _items_of(model: Any, inputs: Any) -> list[list[int]]:
    batch = to_batch(model, inputs)
    return [batch.tokens[b][batch.mask[b]].tolist() for b in range(batch.size)]


@contextmanager
def _recording() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _timed(check: str, method: str | None, fn: Callable[[], CheckRow]) -> CheckRow:
    """Run one check; n/a where the method refuses this model, fail on any other exception."""
    started = time.perf_counter()
    with _recording() as caught:
        try:
            row = fn()
        except (ModelError, TargetError) as err:
            row = _na(check, method, str(err))
        except VerificationError:
            raise
        except Exception as err:  # a crash is a failed check, reported as such
            row = CheckRow(check, method, "fail", None, None, f"raised {type(err).__name__}: {err}")
    notes = tuple(dict.fromkeys(str(w.message).split("\n")[0] for w in caught))
    return CheckRow(
        row.check,
        row.method,
        row.status,
        row.error,
        row.tolerance,
        row.detail,
        time.perf_counter() - started,
        notes,
    )


def verify(
    model: Any,
    inputs: Any = None,
    *,
    target: Target | None = None,
    checks: Sequence[str] = CHECKS,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    verbose: bool = False,
) -> VerifyReport:
    """Check the methods' guarantees on ``model`` (module docstring): a :class:`VerifyReport`.

    inputs:  anything :func:`lens_attrib.attribute` takes, at least two items of different lengths
             for the batched check (default: two short built-in prompts, or sentences for an
             encoder).
    target:  a :class:`Target` (default: the model's prediction at the last real token; for an
             encoder without a masked-LM head, a seeded random linear probe on ``[CLS]``, so that
             the encoder's own numerics are checked: pass your class head to check it too).
    checks:  which of :data:`CHECKS` to run (``model_unchanged`` always compares before/after).
    options: per-method options, e.g. ``{"integrated_gradients": {"n_steps": 64}}`` (a stated
             budget instead of the adaptive rule); they override :data:`DEFAULT_OPTIONS`.
    verbose: print each row as it is done (otherwise nothing is printed).

    The model is never changed: checks that edit weights (zeroed biases, float64) run on copies;
    the last row says whether anything changed.
    """
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"verify: unknown checks {unknown}; choose from {list(CHECKS)}.")
    for name, given in (options or {}).items():
        if name not in METHODS:
            raise OptionError(f"verify: options for unknown method {name!r}; {sorted(METHODS)}.")
        METHODS[name].resolve_options(given)  # bad names and values are errors here
    started = time.perf_counter()
    before = model_state(model)
    arch = arch_of(model)
    check_weights_finite(model)
    if inputs is None:
        inputs = list(default_inputs(model))
    items = _items_of(model, inputs)
    target_label = "the model's prediction at the last real token"
    if target is None and arch.encoder and not arch.lm_head:
        target = Target(head=probe_head(model), position=0)
        target_label = (
            f"a seeded random linear probe on [CLS] (seed {PROBE_SEED}; the encoder has no "
            "masked-LM head: pass target=Target(head=...) to check yours)"
        )
    elif target is not None:
        target_label = repr(target)
    check_target(model, items, target)
    ctx = _Context(model, items, target, options or {})
    report = VerifyReport(
        model=str(getattr(model.cfg, "model_name", type(model).__name__)),
        dtype=str(arch.dtype).replace("torch.", ""),
        target=target_label,
        inputs=[list(map(str, t)) for t in to_batch(model, items).str_tokens],
    )
    pair = ("alti", "grad_x_input") if arch.encoder else ("grad_x_input", "alti_logit")
    plan: list[tuple[str, str | None, Callable[[], CheckRow]]] = [
        ("lrp_conservation", "lrp", partial(check_lrp_conservation, ctx)),
        ("attnlrp_gap", "attnlrp", partial(check_attnlrp_gap, ctx)),
        ("ig_completeness", "integrated_gradients", partial(check_ig_completeness, ctx)),
        ("deeplift_summation", "deeplift", partial(check_deeplift_summation, ctx)),
        ("alti_logit_decomposition", "alti_logit", partial(check_alti_logit, ctx)),
    ]
    plan += [("batched_equals_single", m, partial(check_batched, ctx, m)) for m in pair]
    plan += [("float32_vs_float64", m, partial(check_float64, ctx, m)) for m in pair]
    for check, method, fn in plan:
        if check not in checks:
            continue
        if len(items) < 2 and check == "batched_equals_single":
            row = _na(check, method, "needs at least two inputs")
        elif check == "batched_equals_single" and len({len(i) for i in items}) < 2:
            row = _na(check, method, "needs inputs of different lengths (padding)")
        else:
            row = _timed(check, method, fn)
        if check == "attnlrp_gap":
            ctx.copies.clear()  # the bias-free copy is no longer needed
        report.rows.append(row)
        if verbose:
            print(f"{row.check} ({row.method}): {row.status} {row.detail}", flush=True)
    changed = differences(before, model_state(model))
    report.rows.append(
        CheckRow(
            "model_unchanged",
            None,
            "pass" if not changed else "fail",
            float(len(changed)),
            0.0,
            "state_dict hashes, hooks, requires_grad, .grad, training mode, dtype, device"
            if not changed
            else f"changed: {', '.join(changed[:8])}",
        )
    )
    report.seconds = time.perf_counter() - started
    if verbose:
        print(report, flush=True)
    return report


__all__ = [
    "CHECKS",
    "CheckRow",
    "VerificationError",
    "VerifyReport",
    "sum_tolerance",
    "verify",
]
