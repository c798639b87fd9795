"""Light fine-tuning of a classifier: the model's last ``k`` blocks and its linear head.

The frozen-model head of :mod:`lens_attrib.classifiers.linear` is the starting point. A *copy* of
the model (the caller's model is never changed) has every parameter frozen except those of blocks
``L − k … L − 1``; these and the head's linear map ``(W, c)`` are trained together on

    cross-entropy(h(x_L[p]), y)        (classification)   or   MSE(h(x_L[p]), y)   (regression),

where ``x_L[p]`` is the copy's final residual at the feature position (the last real token for
decoders, ``[CLS]`` for encoders) and ``h`` the head (``ln_final`` then the linear map for
decoders). Optimiser: AdamW (weight decay 0.01 on matrices), learning rate warmed up linearly
over the first 10 % of the steps and decayed linearly to 0, mini-batches of seeded shuffles.
The frozen lower blocks run once per item before training, at the item's own length, and every
step runs only the trained blocks from there, its items in chunks of similar length
(:mod:`lens_attrib.classifiers.frozen_prefix`): the same mini-batches, loss and updates as a
padded forward of the whole model, to float rounding, at a fraction of the cost.

Storage: :func:`save_blocks` writes the tuned blocks' parameters (``blocks.<i>.…`` names, the
TransformerLens parameter names) to ``blocks.safetensors``; :func:`tuned_model` copies a base model
and writes them into it with ``Tensor.copy_`` (bit-exact, and the copy keeps the fast-forward
layout of :mod:`lens_attrib.fastpath`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lens_attrib.backend import arch_of, block, deep_copy
from lens_attrib.classifiers.frozen_prefix import (
    CHUNK_OVERHEAD,
    FrozenPrefix,
    build_prefix,
    final_rows,
)
from lens_attrib.classifiers.linear import LinearHead, feature_position, head_norm
from lens_attrib.forward import resid_of, target_rows
from lens_attrib.inputs import to_batch
from lens_attrib.progress import progress_bar

BLOCKS_FILE = "blocks.safetensors"
LOG = logging.getLogger("lens_attrib.classifiers.finetune")


def tuned_block_names(model: Any, k: int) -> list[str]:
    """Parameter names (``blocks.<i>.…``) of the last ``k`` blocks."""
    return list(block_parameters(model, k))


def block_parameters(model: Any, k: int) -> dict[str, nn.Parameter]:
    """The parameters of the last ``k`` blocks, named ``blocks.<i>.<name in the block>`` (read
    through the blocks, so also on a TransformerBridge, whose ``named_parameters`` are the
    Hugging Face module's)."""
    n_layers = arch_of(model).n_layers
    if not 1 <= k <= n_layers:
        raise ValueError(f"k must be between 1 and the model's {n_layers} blocks, got {k}")
    return {
        f"blocks.{layer}.{name}": param
        for layer in range(n_layers - k, n_layers)
        for name, param in block(model, layer).named_parameters()
    }


def trainable_copy(model: Any, k: int) -> Any:
    """A deep copy of ``model`` in which only the last ``k`` blocks require gradients."""
    tuned = deep_copy(model)
    trained = {id(p) for p in block_parameters(tuned, k).values()}
    for param in tuned.parameters():
        param.requires_grad_(id(param) in trained)
    return tuned


def head_on(model: Any, head: LinearHead) -> LinearHead:
    """A copy of ``head``'s linear map on ``model``'s own final normalisation."""
    new = LinearHead(head.linear.in_features, head.linear.out_features, head_norm(model))
    new.linear.load_state_dict(head.linear.state_dict())
    return new.to(device=head.linear.weight.device, dtype=head.linear.weight.dtype)


def _loss(out: Tensor, y: Tensor, regression: bool) -> Tensor:
    if regression:
        return nn.functional.mse_loss(out[:, 0], y.to(out.dtype))
    return nn.functional.cross_entropy(out, y.long())


def head_rows(model: Any, head: LinearHead, inputs: Sequence[Any]) -> Tensor:
    """``h(x_L[p])`` for a batch of inputs (under the caller's autograd mode)."""
    batch = to_batch(model, list(inputs))
    position = feature_position(model)
    pos = batch.last_real if position is None else batch.first_real + position
    return head(target_rows(resid_of(model, batch), pos))  # type: ignore[no-any-return]


def fine_tune(
    model: Any,
    head: LinearHead,
    inputs: Sequence[Any],
    targets: Tensor,
    *,
    k: int,
    regression: bool = False,
    epochs: int = 1,
    lr: float = 5e-5,
    head_lr: float | None = None,
    batch_size: int = 16,
    seed: int = 0,
    chunk_overhead: float = CHUNK_OVERHEAD,
    prefix: FrozenPrefix | None = None,
) -> tuple[Any, LinearHead, dict[str, Any]]:
    """Train the last ``k`` blocks of a copy of ``model`` and a copy of ``head`` (module
    docstring). Returns ``(tuned model, tuned head, info)``; ``model`` and ``head`` are left
    unchanged. ``head_lr``: the head's learning rate (default ``10 · lr``). ``chunk_overhead``:
    how a step's items are grouped by length (:func:`~lens_attrib.classifiers.frozen_prefix.
    length_chunks`; speed only). ``info["prefix_seconds"]``: the one pass over the frozen
    blocks; ``info["epoch_seconds"]``: each epoch's time. ``prefix``: the inputs' residuals
    entering block ``L − k`` when already computed (:func:`~lens_attrib.classifiers.
    frozen_prefix.build_prefix` on ``model`` or a copy with the same lower blocks)."""
    if len(inputs) != len(targets) or not len(inputs):
        raise ValueError(f"need one target per input, got {len(inputs)} and {len(targets)}")
    started = time.perf_counter()
    tuned = trainable_copy(model, k)
    layer = arch_of(tuned).n_layers - k
    if prefix is None:
        prefix = build_prefix(tuned, inputs, layer)
    elif prefix.layer != layer or len(prefix) != len(inputs):
        raise ValueError(
            f"prefix holds {len(prefix)} items entering block {prefix.layer}; fine-tuning the "
            f"last {k} blocks on {len(inputs)} inputs needs them entering block {layer}"
        )
    prefix_seconds = time.perf_counter() - started
    tuned_head = head_on(tuned, head)
    tuned_head.requires_grad_(True)
    blocks = [p for p in tuned.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in blocks if p.ndim >= 2], "weight_decay": 0.01, "lr": lr},
        {"params": [p for p in blocks if p.ndim < 2], "weight_decay": 0.0, "lr": lr},
        {"params": list(tuned_head.parameters()), "weight_decay": 0.0, "lr": head_lr or 10 * lr},
    ]
    optimiser = torch.optim.AdamW(groups)
    base = [g["lr"] for g in optimiser.param_groups]
    n_steps = epochs * math.ceil(len(inputs) / batch_size)
    warmup = max(1, n_steps // 10)
    gen = torch.Generator().manual_seed(seed)
    step, losses, epoch_seconds = 0, [], []
    bar = progress_bar(desc=f"fine-tune last {k} blocks", total=n_steps, unit="step")
    with bar, torch.inference_mode(False), torch.enable_grad():
        for _ in range(epochs):
            epoch_started = time.perf_counter()
            order = torch.randperm(len(inputs), generator=gen).tolist()
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                scale = min(
                    (step + 1) / warmup, max(0.0, (n_steps - step) / max(1, n_steps - warmup))
                )
                for group, lr0 in zip(optimiser.param_groups, base):
                    group["lr"] = lr0 * scale
                out = tuned_head(final_rows(tuned, prefix, rows, chunk_overhead))
                y = targets[rows].to(out.device)
                loss = _loss(out, y, regression)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                losses.append(float(loss.detach()))
                step += 1
                bar.update()
                if step % max(1, n_steps // 10) == 0 or step == n_steps:
                    recent = losses[-max(1, n_steps // 10) :]
                    LOG.info(
                        "fine-tune step %d/%d, mean loss %.4f, %.0f s",
                        step,
                        n_steps,
                        sum(recent) / len(recent),
                        time.perf_counter() - started,
                    )
            epoch_seconds.append(round(time.perf_counter() - epoch_started, 1))
    for param in tuned.parameters():
        param.requires_grad_(False)
        param.grad = None
    tuned_head.requires_grad_(False)
    tail = losses[-max(1, len(losses) // 10) :]
    info = {
        "k": k,
        "epochs": epochs,
        "lr": lr,
        "head_lr": head_lr or 10 * lr,
        "batch_size": batch_size,
        "steps": n_steps,
        "final_loss": sum(tail) / len(tail),
        "fine_tune_seconds": round(time.perf_counter() - started, 1),
        "prefix_seconds": round(prefix_seconds, 1),
        "epoch_seconds": epoch_seconds,
    }
    return tuned, tuned_head, info


def save_blocks(model: Any, k: int, folder: str | Path) -> Path:
    """Write the last ``k`` blocks' parameters to ``folder/blocks.safetensors``."""
    from safetensors.torch import save_file

    state = {n: p.detach().cpu().contiguous() for n, p in block_parameters(model, k).items()}
    path = Path(folder) / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def tuned_model(model: Any, folder: str | Path) -> Any:
    """A copy of ``model`` with the tuned blocks of ``folder`` written into it (bit-exact)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / BLOCKS_FILE))
    tuned = deep_copy(model)
    params = block_parameters(tuned, arch_of(tuned).n_layers)
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ValueError(f"{folder}: parameters {unknown[:3]} are not in this model.")
    with torch.no_grad():
        for name, value in state.items():
            if params[name].shape != value.shape:
                raise ValueError(
                    f"{folder}: {name} has shape {tuple(value.shape)}, the model "
                    f"{tuple(params[name].shape)}: load it on the model it was tuned from."
                )
            params[name].copy_(value)
    return tuned


__all__ = [
    "BLOCKS_FILE",
    "block_parameters",
    "fine_tune",
    "head_on",
    "head_rows",
    "save_blocks",
    "trainable_copy",
    "tuned_block_names",
    "tuned_model",
]
