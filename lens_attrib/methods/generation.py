"""Generation turned into a batch of step targets: generated tokens (``Target(generate=N)``,
greedy or seeded sampling) or forced decoding of a given continuation
(``Target(continuation=...)``, optionally against a contrastive continuation, ``contrast=``), for
one prompt or a batch of prompts (every prompt with its own continuation).

For a prompt ``x_1..x_P`` the model generates ``y_1..y_S`` (``S ≤ N``; generation stops after an
end-of-sequence token; greedy, or sampled: :func:`sample_generate`). Step ``s`` explains the logit
of ``y_s`` at position ``P − 1 + s`` (0-based ``s``) of the sequence ``x_1..x_P y_1..y_{S−1}``.
Every step row of the returned batch holds that same full sequence: causal attention makes the
tokens after a step's position irrelevant to it, so every step equals its prefix explained on its
own. Methods share the work across the rows of one sequence
(:func:`lens_attrib.forward.step_groups`): gradient methods run the sequence once and take the
``S`` step gradients as batched vector–Jacobian products
(:func:`lens_attrib.methods.backprop.step_gradients_at`), ALTI computes its mixing matrices once,
LogAt/NormXLogit read one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.errors import InputError, TargetError
from lens_attrib.forward import no_grad_context, resid_of
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch, pad_id_of, special_token_mask, str_tokens_of
from lens_attrib.target import Target


def greedy_generate(model: Any, tokens: Int[Tensor, "pos"], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``tokens`` (argmax of the model's own logits, no sampling).

    One full forward per step (no key–value cache), inside ``model_guard`` and
    ``torch.inference_mode``: no hook added here outlives the call and no graph is built.
    Stops after the tokenizer's end-of-sequence token.
    """
    return decode(model, tokens, steps, lambda logits: int(logits.argmax(-1)))


def decode(
    model: Any, tokens: Int[Tensor, "pos"], steps: int, pick: Callable[[Tensor], int]
) -> list[int]:
    """The decoding loop of :func:`greedy_generate` and :func:`sample_generate`: ``pick`` turns
    the logits at the last position into the next token; stops after ``steps`` tokens or the
    tokenizer's end-of-sequence token."""
    eos = getattr(model.tokenizer, "eos_token_id", None) if model.tokenizer is not None else None
    n_ctx = int(model.cfg.n_ctx)
    generated: list[int] = []
    seq = tokens.reshape(1, -1)
    with model_guard(model), torch.inference_mode():
        for _ in range(steps):
            if seq.shape[1] >= n_ctx:
                raise InputError(
                    f"Generating {steps} tokens after a prompt of {tokens.numel()} tokens exceeds "
                    f"the model's context n_ctx={n_ctx}: ask for fewer steps."
                )
            nxt = pick(model(seq)[0, -1])
            generated.append(nxt)
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
            if eos is not None and nxt == int(eos):
                break
    return generated


def generation_batch(
    model: Any, batch: Batch, target: Target
) -> tuple[Batch, Target, dict[str, Any]]:
    """Generated tokens (``Target(generate=N)``, greedy or sampled) or a given continuation
    (with per-step foils or a contrastive continuation) as a batch of steps.

    Returns ``(steps_batch, step_target, info)``: ``steps_batch`` has one row per step, every row
    of a prompt the sequence prompt + continuation[:-1]; ``step_target`` explains at that prompt's
    row ``s`` the token ``continuation[s]`` at position ``prompt_length − 1 + s``; ``info`` holds
    ``prompt_length``, ``generated_ids``, ``generated_tokens`` and ``steps`` (per prompt lists for
    a batch of prompts), ``step_prompt`` / ``step_index`` (per row: whose step it is),
    ``sampling`` (sampled generations: seed and options) and ``step_scores``
    (:func:`step_scores`; with a contrast also :func:`add_contrast_info`'s entries); it is also
    stored in ``steps_batch.extra["generation"]``, from where it reaches ``Attribution.meta``.
    """
    forced = target.continuation is not None
    what = "Target(continuation=...)" if forced else "Target(generate=N)"
    if not forced and target.generate <= 0:
        raise TargetError("generation_batch needs Target(generate=N) with N > 0.")
    if batch.arch.encoder:
        raise TargetError(
            f"{what} needs a decoder (HookedTransformer): an encoder does not generate."
        )
    fixed = {"token": target.token, "position": target.position, "head": target.head}
    if not forced:
        fixed["foil"] = target.foil
    set_fields = [k for k, v in fixed.items() if v is not None] + (
        ["regression"] if target.regression else []
    )
    if set_fields:
        own = "the given continuation" if forced else "the model's own greedy tokens"
        raise TargetError(
            f"{what} explains {own} with its LM head; {set_fields} cannot be combined with it."
        )
    prompts = [batch.tokens[b][batch.mask[b]] for b in range(batch.size)]
    contrasts: list[list[int]] | None = None
    sampling: dict[str, Any] | None = None
    if forced:
        continuations = continuation_ids(model, target.continuation, batch.size)
        foils: list[str | int] | None
        if target.contrast is not None:
            contrasts = continuation_ids(model, target.contrast, batch.size, "contrast")
            foils, aligned = contrast_foils(continuations, contrasts, target.contrast_alignments)
        else:
            foils = step_foils(target.foil, [len(c) for c in continuations])
    else:
        continuations, sampling = generate_continuations(model, prompts, target)
        foils = None
    steps_batch, step_target, info = steps_of(model, batch, prompts, continuations, foils, forced)
    if sampling is not None:
        info["sampling"] = sampling
    if contrasts is not None:
        add_contrast_info(model, batch, prompts, continuations, contrasts, aligned, info)
    return steps_batch, step_target, info


def continuation_ids(
    model: Any, spec: Any, n_prompts: int, what: str = "continuation"
) -> list[list[int]]:
    """Token ids of every prompt's continuation.

    A string is tokenized **on its own**, without special tokens
    (``tokenizer(text, add_special_tokens=False)``), and its ids are appended to the prompt's ids
    as the model sees them (start token included, ``inputs.start_token_of``). Where joining the
    texts would tokenize differently at the seam (e.g. a continuation without a leading space
    that merges with the prompt's last word), the standalone tokenization is the one explained;
    pass token ids to choose the split yourself.
    """
    specs = spec if isinstance(spec, list) and spec and not isinstance(spec[0], int) else [spec]
    if len(specs) != n_prompts:
        raise TargetError(
            f"Target({what}=...) got {len(specs)} {what}(s) for {n_prompts} "
            f"prompt(s): pass one {what} per prompt (a list of strings or id lists)."
        )
    vocab = int(model.cfg.d_vocab)
    out: list[list[int]] = []
    for i, one in enumerate(specs):
        if isinstance(one, str):
            if getattr(model, "tokenizer", None) is None:
                raise InputError(
                    f"The model has no tokenizer, so the continuation {one!r} cannot be split "
                    "into tokens: pass token ids."
                )
            ids = [int(t) for t in model.tokenizer(one, add_special_tokens=False)["input_ids"]]
            if not ids:
                raise TargetError(
                    f"The continuation {one!r} of prompt {i} tokenizes to no tokens: pass text "
                    "that has at least one token."
                )
        else:
            ids = list(one)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TargetError(
                f"The continuation of prompt {i} holds token ids {bad[:5]} outside the "
                f"vocabulary [0, {vocab}): pass ids from this model's tokenizer."
            )
        out.append(ids)
    return out


def step_foils(foil: Any, steps: list[int]) -> list[str | int] | None:
    """One foil per step row (prompt by prompt), from a single foil for every step, a list
    aligned with a single prompt's steps, or a list per prompt."""
    if foil is None:
        return None
    if isinstance(foil, str | int):
        return [foil] * sum(steps)
    if isinstance(foil, Tensor):
        foil = foil.flatten().tolist() if foil.ndim <= 1 else foil.tolist()
        if isinstance(foil, int):
            return [foil] * sum(steps)
    nested = bool(foil) and isinstance(foil[0], list | Tensor)
    per_prompt = [f.tolist() if isinstance(f, Tensor) else f for f in foil] if nested else [foil]
    if len(per_prompt) != len(steps):
        raise TargetError(
            f"Target(continuation=..., foil=[...]) got {len(per_prompt)} foil list(s) for "
            f"{len(steps)} prompt(s): pass one foil list per prompt, aligned with its steps."
        )
    out: list[str | int] = []
    for i, (foils, n) in enumerate(zip(per_prompt, steps, strict=True)):
        if len(foils) != n:
            raise TargetError(
                f"The foil list of prompt {i} has {len(foils)} entries but its continuation has "
                f"{n} steps: pass one foil per continuation token (or a single foil for all)."
            )
        out.extend(foils)
    return out


def steps_of(
    model: Any,
    batch: Batch,
    prompts: list[Tensor],
    continuations: list[list[int]],
    foils: list[str | int] | None,
    forced: bool,
) -> tuple[Batch, Target, dict[str, Any]]:
    """The batch of step rows of every prompt (see :func:`generation_batch`).

    Rows of different prompts have different lengths and are padded like any batch (left for
    decoders); positions are indices among each row's real tokens.
    """
    n_ctx = int(model.cfg.n_ctx)
    sequences: list[list[int]] = []
    specials: list[Tensor] = []
    for b, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        seq = prompt.tolist() + cont[:-1]
        if len(seq) > n_ctx:
            raise InputError(
                f"Prompt {b} ({prompt.numel()} tokens) with its {len(cont)}-token continuation "
                f"needs {len(seq)} positions, more than the model's context n_ctx={n_ctx}: "
                "shorten the prompt or the continuation."
            )
        sequences.append(seq)
        special = batch.special[b][batch.mask[b]]
        # continuation tokens are special by the prompt's rule (a chat turn's <|im_end|>), so
        # that every step equals its prefix explained alone (IG's keep_sink="special")
        cont_special = special_token_mask(model, cont[:-1]).to(special.device)
        specials.append(torch.cat([special, cont_special]))
    row_prompt = [b for b, cont in enumerate(continuations) for _ in cont]
    row_step = [s for cont in continuations for s in range(len(cont))]
    length = max(len(seq) for seq in sequences)
    device = batch.tokens.device
    tokens = torch.full((len(row_prompt), length), pad_id_of(model.tokenizer), dtype=torch.long)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    special_rows = torch.zeros_like(mask)
    left = batch.padding_side == "left"
    for r, b in enumerate(row_prompt):
        n = len(sequences[b])
        cols = slice(length - n, length) if left else slice(0, n)
        tokens[r, cols] = torch.tensor(sequences[b], dtype=torch.long)
        mask[r, cols] = True
        special_rows[r, cols] = specials[b].cpu()
    str_tokens = [str_tokens_of(model, seq) for seq in sequences]
    single = len(prompts) == 1
    lengths = [int(p.numel()) for p in prompts]
    info: dict[str, Any] = {
        "prompt_length": lengths[0] if single else lengths,
        "generated_ids": continuations[0] if single else continuations,
        "generated_tokens": (
            str_tokens_of(model, continuations[0])
            if single
            else [str_tokens_of(model, c) for c in continuations]
        ),
        "steps": len(continuations[0]) if single else [len(c) for c in continuations],
    }
    steps_batch = Batch(
        tokens.to(device),
        mask.to(device),
        [list(str_tokens[b]) for b in row_prompt],
        special_rows.to(device),
        batch.arch,
        padding_side=batch.padding_side,
        extra={**batch.extra, "generation": info},
    )
    step_target = Target(
        token=torch.tensor(
            [continuations[b][s] for b, s in zip(row_prompt, row_step, strict=True)],
            device=device,
        ),
        foil=foils,
        position=[lengths[b] - 1 + s for b, s in zip(row_prompt, row_step, strict=True)],
    )
    info["step_prompt"] = row_prompt
    info["step_index"] = row_step
    if forced:
        info["continuation"] = True
    info["step_scores"] = step_scores(model, steps_batch, step_target, row_prompt)
    return steps_batch, step_target, info


def step_scores(
    model: Any, steps_batch: Batch, step_target: Target, row_prompt: list[int]
) -> dict[str, Float[Tensor, "row"]]:
    """Scores of every step's token from **one** no-grad forward of the full sequences.

    For step row ``r`` with logits ``z = head(x[p_r])`` (the model's LM head at the step's
    position, read from one forward of each prompt's sequence prompt + continuation[:-1]):
    ``probability = softmax(z)[y_r]``, ``log_probability = log_softmax(z)[y_r]``,
    ``entropy = −Σ_v softmax(z)_v log_softmax(z)_v`` (nats, of the next-token distribution),
    ``logit = z[y_r]`` and, with a foil ``y'_r``, ``logit_difference = z[y_r] − z[y'_r]``.
    Each is a float tensor with one value per step row, in the model's dtype.
    """
    first = [row_prompt.index(b) for b in sorted(set(row_prompt))]
    sequences = Batch(
        steps_batch.tokens[first],
        steps_batch.mask[first],
        [steps_batch.str_tokens[r] for r in first],
        steps_batch.special[first],
        steps_batch.arch,
        padding_side=steps_batch.padding_side,
    )
    with no_grad_context(model):
        resid = resid_of(model, sequences)
        rows = resid[
            torch.tensor(row_prompt, device=resid.device), step_target.positions(steps_batch)
        ]
        logits = step_target.head_fn(model)(rows)
        resolved = step_target.resolve(model, steps_batch, logits)
        log_p = logits.log_softmax(-1)
        idx = torch.arange(len(row_prompt), device=logits.device)
        tok = resolved.token_ids.to(logits.device)
        scores = {
            "probability": log_p[idx, tok].exp(),
            "log_probability": log_p[idx, tok],
            "entropy": -(log_p.exp() * log_p).sum(-1),
            "logit": logits[idx, tok],
        }
        if resolved.foil_ids is not None:
            scores["logit_difference"] = resolved.select(logits)
    return {k: v.detach().cpu() for k, v in scores.items()}


# --------------------------------------------------------------------------- sampling
def next_token_distribution(
    logits: Float[Tensor, "vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Float[Tensor, "vocab"]:
    """The float64 distribution a sampled step draws from (on the CPU).

    ``p = softmax(z / temperature)`` over the tokens kept by, in this order (Hugging Face
    ``generate``'s order and rules): ``top_k`` — the tokens whose scaled logit is at least the
    ``k``-th largest (ties at the boundary kept); ``top_p`` — of those, the most likely tokens
    in descending order up to and including the first at which their cumulative probability
    reaches ``top_p`` (at least one token). Removed tokens get probability 0 and the kept ones
    are renormalised.
    """
    z = logits.detach().to(device="cpu", dtype=torch.float64) / float(temperature)
    if top_k is not None and top_k < z.numel():
        kth = torch.topk(z, int(top_k)).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, -1)
    if top_p is not None and top_p < 1.0:
        order = torch.argsort(p, descending=True, stable=True)
        sorted_p = p[order]
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < float(top_p)
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def draw_token(p: Float[Tensor, "vocab"], generator: torch.Generator) -> int:
    """Inverse-CDF draw: ``u ~ U[0, 1)`` from ``generator`` (float64), then the first token
    ``v`` (in vocabulary order) with ``Σ_{w ≤ v} p_w > u · Σ_w p_w`` (never a token of
    probability 0)."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(p, 0)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(p.numel() - 1))


def sample_generate(
    model: Any,
    tokens: Int[Tensor, "pos"],
    steps: int,
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> list[int]:
    """``steps`` sampled tokens after ``tokens``: step by step, a draw (:func:`draw_token`) from
    :func:`next_token_distribution` of the model's logits at the last position, with a CPU
    ``torch.Generator`` seeded with ``seed`` (the same seed gives the same tokens).

    One full forward per step, inside ``model_guard`` and ``torch.inference_mode`` (as
    :func:`greedy_generate`); stops after the tokenizer's end-of-sequence token.
    """
    generator = torch.Generator().manual_seed(int(seed))
    return decode(
        model,
        tokens,
        steps,
        lambda logits: draw_token(
            next_token_distribution(logits, temperature, top_k, top_p), generator
        ),
    )


def generate_continuations(
    model: Any, prompts: list[Tensor], target: Target
) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Every prompt's generated tokens: greedy, or sampled (``Target(sample=True)``) with one
    generator per prompt seeded with ``target.seed`` (drawn from torch's global generator when
    ``None``). Returns the tokens and, when sampling, ``meta["sampling"]`` (seed and options)."""
    steps = int(target.generate)
    if not target.sample:
        return [greedy_generate(model, p, steps) for p in prompts], None
    seed = target.seed
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    tokens = [
        sample_generate(
            model,
            p,
            steps,
            seed=seed,
            temperature=target.temperature,
            top_k=target.top_k,
            top_p=target.top_p,
        )
        for p in prompts
    ]
    options = {"temperature": target.temperature, "top_k": target.top_k, "top_p": target.top_p}
    return tokens, {"sample": True, "seed": seed, **options}


# --------------------------------------------------------------------------- contrast
def _alignment_lists(alignments: Any, n_prompts: int) -> list[list[tuple[int, int]]]:
    """``contrast_alignments`` as one list of ``(step, contrast index)`` pairs per prompt."""
    if alignments is None:
        return [[] for _ in range(n_prompts)]

    def is_pair(x: Any) -> bool:
        return (
            isinstance(x, list | tuple)
            and len(x) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
        )

    given = list(alignments)
    if all(is_pair(x) for x in given):
        per_prompt = [given]
    elif all(isinstance(x, list | tuple) and all(is_pair(y) for y in x) for x in given):
        per_prompt = [list(x) for x in given]
    else:
        raise TargetError(
            f"contrast_alignments must be a list of (step, contrast index) pairs (one list per "
            f"prompt for a batch), got {alignments!r}."
        )
    if len(per_prompt) != n_prompts:
        raise TargetError(
            f"contrast_alignments has {len(per_prompt)} list(s) of pairs for {n_prompts} "
            "prompt(s): pass one list per prompt."
        )
    return [[(int(a), int(b)) for a, b in pairs] for pairs in per_prompt]


def align_contrast(n_steps: int, n_contrast: int, pairs: list[tuple[int, int]]) -> list[int]:
    """The contrast index ``a(s)`` of every step (Inseq's rule for ``contrast_targets``).

    Given pairs are sorted and deduplicated; a step with several pairs takes the first whose
    contrast index is not yet taken (else the first). A step without a pair is aligned right to
    left: ``a(s) = n_contrast − (n_steps − s)`` (the last step with the last contrast token;
    for equal lengths ``a(s) = s``). Pairs outside the two sequences, and steps that the rule
    would align before the contrast's first token, are errors.
    """
    bad = [(a, b) for a, b in pairs if not (0 <= a < n_steps and 0 <= b < n_contrast)]
    if bad:
        raise TargetError(
            f"contrast_alignments pairs {bad[:4]} fall outside the continuation ({n_steps} "
            f"steps) or the contrast ({n_contrast} tokens): pairs are (step, contrast index), "
            "0-based."
        )
    ordered = sorted(set(pairs))
    aligned: list[int] = []
    for s in range(n_steps):
        matches = [b for a, b in ordered if a == s]
        if matches:
            free = [b for b in matches if b not in aligned]
            aligned.append(free[0] if free else matches[0])
            continue
        b = n_contrast - (n_steps - s)
        if b < 0:
            raise TargetError(
                f"Step {s} of a {n_steps}-token continuation has no contrast token: the "
                f"contrast has {n_contrast} tokens, and steps without a pair in "
                "contrast_alignments are aligned right to left. Pass "
                "contrast_alignments=[(step, contrast index), ...] for these steps."
            )
        aligned.append(b)
    return aligned


def contrast_foils(
    continuations: list[list[int]], contrasts: list[list[int]], alignments: Any
) -> tuple[list[str | int], list[list[int]]]:
    """One foil per step row (prompt by prompt): the aligned contrast token
    ``contrast[a(s)]`` (:func:`align_contrast`); also returns every prompt's ``a``."""
    pairs = _alignment_lists(alignments, len(continuations))
    foils: list[str | int] = []
    aligned: list[list[int]] = []
    for cont, contrast, given in zip(continuations, contrasts, pairs, strict=True):
        a = align_contrast(len(cont), len(contrast), given)
        aligned.append(a)
        foils.extend(contrast[i] for i in a)
    return foils, aligned


def contrast_step_scores(
    model: Any,
    batch: Batch,
    prompts: list[Tensor],
    contrasts: list[list[int]],
    aligned: list[list[int]],
) -> dict[str, Float[Tensor, "row"]]:
    """Scores of every step's contrast token under the contrast's **own** prefix.

    For step ``s`` of prompt ``x`` with contrast ``c`` and alignment ``a``:
    ``z' = head(x' [P − 1 + a(s)])`` from one no-grad forward of ``x + c[:max a]`` (``P`` the
    prompt's length), and ``contrast_logit = z'[c[a(s)]]``, ``contrast_probability =
    softmax(z')[c[a(s)]]``, ``contrast_log_probability`` (Inseq's ``contrast_logits`` /
    ``contrast_prob`` step scores with ``contrast_targets``).
    """
    from lens_attrib.inputs import to_batch

    sequences = [
        p.tolist() + c[: max(a)] for p, c, a in zip(prompts, contrasts, aligned, strict=True)
    ]
    contrast_batch = to_batch(model, sequences)
    rows = [b for b, a in enumerate(aligned) for _ in a]
    positions = [int(prompts[b].numel()) - 1 + i for b, a in enumerate(aligned) for i in a]
    ids = [contrasts[b][i] for b, a in enumerate(aligned) for i in a]
    with no_grad_context(model):
        resid = resid_of(model, contrast_batch)
        device = resid.device
        index = torch.tensor(
            [contrast_batch.real_index(b, p) for b, p in zip(rows, positions, strict=True)],
            device=device,
        )
        logits = Target().head_fn(model)(resid[torch.tensor(rows, device=device), index])
        log_p = logits.log_softmax(-1)
        idx = torch.arange(len(ids), device=device)
        tok = torch.tensor(ids, device=device)
        scores = {
            "contrast_logit": logits[idx, tok],
            "contrast_probability": log_p[idx, tok].exp(),
            "contrast_log_probability": log_p[idx, tok],
        }
    return {k: v.detach().cpu() for k, v in scores.items()}


def add_contrast_info(
    model: Any,
    batch: Batch,
    prompts: list[Tensor],
    continuations: list[list[int]],
    contrasts: list[list[int]],
    aligned: list[list[int]],
    info: dict[str, Any],
) -> None:
    """Record the contrast in ``info`` (→ ``meta``): ``contrast_ids``, ``contrast_tokens``,
    ``contrast_alignments`` (``a`` of every step, per prompt) and the step scores of
    :func:`contrast_step_scores` with ``contrast_logit_difference = logit − contrast_logit``
    and ``contrast_probability_difference = probability − contrast_probability`` (Inseq's
    ``contrast_logits_diff`` / ``contrast_prob_diff`` step scores: each token under its own
    prefix). ``logit_difference`` stays the explained scalar (both logits on the original
    prefix)."""
    single = len(prompts) == 1
    info["contrast_ids"] = contrasts[0] if single else contrasts
    info["contrast_tokens"] = (
        str_tokens_of(model, contrasts[0])
        if single
        else [str_tokens_of(model, c) for c in contrasts]
    )
    info["contrast_alignments"] = aligned[0] if single else aligned
    scores = info["step_scores"]
    extra = contrast_step_scores(model, batch, prompts, contrasts, aligned)
    extra["contrast_logit_difference"] = scores["logit"] - extra["contrast_logit"]
    extra["contrast_probability_difference"] = scores["probability"] - extra["contrast_probability"]
    scores.update(extra)


__all__ = [
    "align_contrast",
    "continuation_ids",
    "contrast_foils",
    "contrast_step_scores",
    "decode",
    "draw_token",
    "generate_continuations",
    "generation_batch",
    "greedy_generate",
    "next_token_distribution",
    "sample_generate",
    "step_scores",
]
