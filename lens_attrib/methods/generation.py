"""Generation turned into a batch of step targets: greedy (``Target(generate=N)``) or forced
decoding of a given continuation (``Target(continuation=...)``, one per prompt of a batch).

For a prompt ``x_1..x_P`` the model greedily generates ``y_1..y_S`` (``S ≤ N``; generation stops
after an end-of-sequence token). Step ``s`` explains the logit of ``y_s`` at position
``P − 1 + s`` (0-based ``s``) of the sequence ``x_1..x_P y_1..y_{S−1}``. Every step row of the
returned batch holds that same full sequence: causal attention makes the tokens after a step's
position irrelevant to it, so every step equals its prefix explained on its own. Methods share the
work across the rows of one sequence (:func:`lens_attrib.forward.step_groups`): gradient methods
run the sequence once and take the ``S`` step gradients as batched vector–Jacobian products
(:func:`lens_attrib.methods.backprop.step_gradients_at`), ALTI computes its mixing matrices once,
LogAt/NormXLogit read one forward.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.errors import InputError, TargetError
from lens_attrib.forward import no_grad_context, resid_of
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch, pad_id_of, str_tokens_of
from lens_attrib.target import Target


def greedy_generate(model: Any, tokens: Int[Tensor, "pos"], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``tokens`` (argmax of the model's own logits, no sampling).

    One full forward per step (no key–value cache), inside ``model_guard`` and
    ``torch.inference_mode``: no hook added here outlives the call and no graph is built.
    Stops after the tokenizer's end-of-sequence token.
    """
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
            logits = model(seq)[0, -1]
            nxt = int(logits.argmax(-1))
            generated.append(nxt)
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
            if eos is not None and nxt == int(eos):
                break
    return generated


def generation_batch(
    model: Any, batch: Batch, target: Target
) -> tuple[Batch, Target, dict[str, Any]]:
    """Greedy tokens (``Target(generate=N)``) or a given continuation as a batch of steps.

    Returns ``(steps_batch, step_target, info)``: ``steps_batch`` has one row per step, every row
    of a prompt the sequence prompt + continuation[:-1]; ``step_target`` explains at that prompt's
    row ``s`` the token ``continuation[s]`` at position ``prompt_length − 1 + s``; ``info`` holds
    ``prompt_length``, ``generated_ids``, ``generated_tokens`` and ``steps`` (per prompt lists for
    a batch of prompts, plus ``step_prompt`` / ``step_index`` per row) and, for a continuation,
    ``step_scores`` (:func:`step_scores`); it is also stored in ``steps_batch.extra["generation"]``,
    from where it reaches ``Attribution.meta``.
    """
    forced = target.continuation is not None
    what = "Target(continuation=...)" if forced else "Target(generate=N)"
    if not forced and target.generate <= 0:
        raise TargetError("generation_batch needs Target(generate=N) with N > 0.")
    if batch.arch.encoder:
        raise TargetError(
            f"{what} needs a decoder (HookedTransformer): an encoder does not generate."
        )
    if not forced and batch.size != 1:
        raise TargetError(
            f"Target(generate=N) explains the generation of a single prompt, got {batch.size} "
            "prompts: call the method once per prompt."
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
    if forced:
        continuations = continuation_ids(model, target.continuation, batch.size)
        foils = step_foils(target.foil, [len(c) for c in continuations])
    else:
        continuations = [greedy_generate(model, prompts[0], int(target.generate))]
        foils = None
    return steps_of(model, batch, prompts, continuations, foils, forced)


def continuation_ids(model: Any, spec: Any, n_prompts: int) -> list[list[int]]:
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
            f"Target(continuation=...) got {len(specs)} continuation(s) for {n_prompts} "
            "prompt(s): pass one continuation per prompt (a list of strings or id lists)."
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
        specials.append(
            torch.cat(
                [special, torch.zeros(len(cont) - 1, dtype=torch.bool, device=special.device)]
            )
        )
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
    if forced:
        info["continuation"] = True
        if not single:
            info["step_prompt"] = row_prompt
            info["step_index"] = row_step
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


__all__ = ["continuation_ids", "generation_batch", "greedy_generate", "step_scores"]
