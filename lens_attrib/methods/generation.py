"""Greedy generation turned into a batch of step targets (``Target(generate=N)``).

For a prompt ``x_1..x_P`` the model greedily generates ``y_1..y_S`` (``S ≤ N``; generation stops
after an end-of-sequence token). Step ``s`` explains the logit of ``y_s`` at position
``P − 1 + s`` (0-based ``s``) of the sequence ``x_1..x_P y_1..y_{S−1}``. Every step row of the
returned batch holds that same full sequence: causal attention makes the tokens after a step's
position irrelevant to it, so a gradient method explains all steps in one forward and one backward
pass over the batch of steps (rows never interact), exactly as if each step were explained on its
own prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from lens_attrib.errors import InputError, TargetError
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch, str_tokens_of
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
    """Greedily generate ``target.generate`` tokens and return the batch of steps.

    Returns ``(steps_batch, step_target, info)``: ``steps_batch`` has one row per generated token,
    every row the sequence prompt + generated[:-1]; ``step_target`` explains at row ``s`` the token
    ``generated[s]`` at position ``prompt_length − 1 + s``; ``info`` holds ``prompt_length``,
    ``generated_ids``, ``generated_tokens`` and ``steps`` (also stored in
    ``steps_batch.extra["generation"]``, from where it reaches ``Attribution.meta``).
    """
    if target.generate <= 0:
        raise TargetError("generation_batch needs Target(generate=N) with N > 0.")
    if batch.arch.encoder:
        raise TargetError(
            "Target(generate=N) needs a decoder (HookedTransformer): an encoder does not generate."
        )
    if batch.size != 1:
        raise TargetError(
            f"Target(generate=N) explains the generation of a single prompt, got {batch.size} "
            "prompts: call the method once per prompt."
        )
    fixed = {
        "token": target.token,
        "foil": target.foil,
        "position": target.position,
        "head": target.head,
    }
    set_fields = [k for k, v in fixed.items() if v is not None] + (
        ["regression"] if target.regression else []
    )
    if set_fields:
        raise TargetError(
            f"Target(generate=N) explains the model's own greedy tokens with its LM head; "
            f"{set_fields} cannot be combined with it."
        )
    prompt = batch.tokens[0][batch.mask[0]]
    generated = greedy_generate(model, prompt, int(target.generate))
    n_steps = len(generated)
    prompt_length = int(prompt.numel())
    gen = prompt.new_tensor(generated)
    sequence = torch.cat([prompt, gen[:-1]])
    tokens = sequence.expand(n_steps, -1).clone()
    mask = torch.ones_like(tokens, dtype=torch.bool)
    str_tokens = str_tokens_of(model, sequence.tolist())
    special = batch.special[0][batch.mask[0]]
    special = torch.cat(
        [special, torch.zeros(n_steps - 1, dtype=torch.bool, device=special.device)]
    )
    info: dict[str, Any] = {
        "prompt_length": prompt_length,
        "generated_ids": generated,
        "generated_tokens": str_tokens_of(model, generated),
        "steps": n_steps,
    }
    steps_batch = Batch(
        tokens,
        mask,
        [list(str_tokens) for _ in range(n_steps)],
        special.expand(n_steps, -1).clone(),
        batch.arch,
        padding_side=batch.padding_side,
        extra={**batch.extra, "generation": info},
    )
    step_target = Target(
        token=gen.detach().clone(),
        position=[prompt_length - 1 + s for s in range(n_steps)],
    )
    return steps_batch, step_target, info


__all__ = ["generation_batch", "greedy_generate"]
