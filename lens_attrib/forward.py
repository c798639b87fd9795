"""The forward engine: every run of the model that a method, a metric or pruning needs.

- :func:`run` — one hooked forward of a :class:`~lens_attrib.inputs.Batch` up to the final
  residual, with the caller's hooks applied first and the activations named in ``capture``
  recorded (made differentiable leaves when gradients are on, since parameters are frozen), then
  the explained scalar ``f_b`` of every item through :meth:`lens_attrib.target.Target.evaluate`
  (the head is applied at the target rows only). Encoders without any head (all-MiniLM-L6-v2)
  are run "position only" for methods that need no head: the target is then the representation
  at the target position.
- :func:`head_outputs` — the head at given rows of many sequences, chunked, without gradients
  (perturbation metrics, pruning, scoring).
- :func:`grad_context` / :func:`no_grad_context` — the model guard plus the autograd mode.

Methods take ``torch.autograd.grad`` of ``f.sum()`` with respect to captured activations: items
of a batch never interact, so this is every item's own gradient in one backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.backend import Arch, Head, arch_of, default_head, final_residual
from lens_attrib.errors import NonFiniteError
from lens_attrib.finite import check_activations, raise_if_weights_nonfinite
from lens_attrib.hooks import HookFn
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import Batch
from lens_attrib.target import ResolvedTarget, Target

FwdHooks = Sequence[tuple[str | Callable[[str], bool], HookFn]]
ChunkHooks = Callable[[slice], list[tuple[str, HookFn]]]
Reduce = Callable[[Tensor, slice], Tensor]


@dataclass
class Forward:
    """One forward: the explained scalar (``None`` position-only), the target, the residual."""

    value: Float[Tensor, "batch"] | None
    resolved: ResolvedTarget
    head_out: Float[Tensor, "batch n_out"] | None
    resid: Float[Tensor, "batch pos d_model"]
    captured: dict[str, Tensor] = field(default_factory=dict)
    position_only: bool = False
    rows: Int[Tensor, "batch"] | None = None
    """Shared runs (:func:`run_shared`): the captured sequence each batch row reads (captured
    tensors then have one row per distinct sequence); ``None``: one captured row per item."""


def resid_of(model: Any, batch: Batch) -> Float[Tensor, "batch pos d_model"]:
    """The final residual of ``batch`` (hooks installed by the caller fire).

    NaN/inf at a real position is an error naming the weight or position responsible
    (:func:`lens_attrib.finite.check_activations`).
    """
    resid = final_residual(
        model, batch.arch, batch.tokens, batch.mask, batch.padded, batch.token_types
    )
    check_activations(model, resid, batch.mask)
    return resid


def has_head(arch: Arch, target: Target) -> bool:
    """Whether an explained scalar exists (a head on top, or the target names one)."""
    return target.head is not None or not arch.encoder or arch.lm_head or arch.class_head


def _capture_hook(store: dict[str, Tensor], name: str) -> HookFn:
    def hook(x: Tensor, hook: Any) -> Tensor:
        if torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_(True)
        store[name] = x
        return x

    return hook


def check_value(value: Tensor, model: Any = None) -> None:
    """The explained scalar is finite; else the non-finite weight is named (when ``model``)."""
    if not torch.isfinite(value).all():
        if model is not None:
            raise_if_weights_nonfinite(model)
        raise NonFiniteError(
            "The explained scalar is not finite (NaN/inf) for items "
            f"{torch.nonzero(~torch.isfinite(value)).flatten().tolist()}: check the inputs and "
            "the model's dtype (bf16/fp16 overflow)."
        )


def run(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    capture: Sequence[str] = (),
    fwd_hooks: FwdHooks = (),
    position_only_ok: bool = False,
) -> Forward:
    """Forward with ``fwd_hooks`` (applied first), capturing ``capture``; the explained scalar.

    Runs under the caller's autograd mode (use inside :func:`grad_context` for gradients).
    ``position_only_ok``: a model without any head gives a position-only target instead of an
    error (for methods whose scores do not need the head).
    """
    store: dict[str, Tensor] = {}
    hooks: list[tuple[Any, HookFn]] = list(fwd_hooks)
    hooks += [(name, _capture_hook(store, name)) for name in capture]
    headless = position_only_ok and not has_head(batch.arch, target)
    with model.hooks(fwd_hooks=hooks):
        resid = resid_of(model, batch)
        if not headless:
            value, resolved, head_out = target.evaluate(model, batch, resid)
    missing = [n for n in capture if n not in store]
    if missing:
        raise RuntimeError(f"Hooks {missing} did not fire: not part of this model's forward.")
    if headless:
        positions = target.positions(batch)
        idx = torch.arange(batch.size, device=positions.device)
        resolved = ResolvedTarget(positions, batch.tokens[idx, positions], None, False)
        return Forward(None, resolved, None, resid, store, position_only=True)
    check_value(value, model)
    return Forward(value, resolved, head_out, resid, store)


def target_rows(x: Tensor, positions: Tensor) -> Tensor:
    """``x[b, positions[b]]`` for every item."""
    return x[torch.arange(x.shape[0], device=x.device), positions.to(x.device)]


@contextmanager
def grad_context(model: Any) -> Iterator[None]:
    """Guard the model and enable autograd (also under ``torch.no_grad``/``inference_mode``)."""
    with model_guard(model), torch.inference_mode(False), torch.enable_grad():
        yield


@contextmanager
def no_grad_context(model: Any) -> Iterator[None]:
    """Guard the model; no autograd graph is built."""
    with model_guard(model), torch.no_grad():
        yield


def head_outputs(
    model: Any,
    tokens: Int[Tensor, "n pos"],
    mask: Bool[Tensor, "n pos"],
    positions: Int[Tensor, "n"],
    *,
    head: Head | None = None,
    reduce: Reduce | None = None,
    hooks: ChunkHooks | None = None,
    max_batch: int = 64,
    token_types: Int[Tensor, "n pos"] | None = None,
) -> Tensor:
    """Head outputs at ``positions`` for many sequences, in chunks of ``max_batch`` rows.

    ``hooks(rows)`` gives the forward hooks for the chunk ``rows`` (a slice of the ``n`` rows);
    ``reduce(head_out, rows)`` maps the chunk's ``[chunk, n_out]`` head outputs to what is kept
    (default: the head outputs themselves). ``token_types``: an encoder's segment ids of the
    ``n`` rows (``None``: segment 0). Runs inside the model guard under inference mode.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    arch = arch_of(model)
    head = head or default_head(model, arch)
    device = model.cfg.device
    outs: list[Tensor] = []
    with model_guard(model), torch.inference_mode():
        for start in range(0, int(tokens.shape[0]), max_batch):
            rows = slice(start, min(start + max_batch, int(tokens.shape[0])))
            tok, msk = tokens[rows].to(device), mask[rows].to(device)
            types = None if token_types is None else token_types[rows].to(device)
            with model.hooks(fwd_hooks=hooks(rows) if hooks is not None else []):
                resid = final_residual(model, arch, tok, msk, not bool(msk.all()), types)
            out = head(target_rows(resid, positions[rows]))
            outs.append(reduce(out, rows) if reduce is not None else out)
    return torch.cat(outs)


def step_groups(batch: Batch) -> list[Int[Tensor, "rows"]] | None:
    """The rows of a generation step batch grouped by sequence, in order of first appearance.

    A step batch (``batch.extra["generation"]``, :mod:`lens_attrib.methods.generation`) holds
    every step of a prompt as one row with the same tokens ``prompt + continuation[:-1]``; rows
    are grouped by equal tokens, mask and token types (read from the tensors, not trusted from
    the metadata). ``None`` when ``batch`` is not a step batch or no two rows are equal.
    """
    if "generation" not in batch.extra or batch.size < 2:
        return None
    key = [batch.tokens, batch.mask.long()]
    if batch.token_types is not None:
        key.append(batch.token_types)
    _, inverse = torch.unique(torch.cat(key, dim=1), dim=0, return_inverse=True)
    order: dict[int, list[int]] = {}
    for row, group in enumerate(inverse.tolist()):
        order.setdefault(group, []).append(row)
    if len(order) == batch.size:
        return None
    device = batch.tokens.device
    return [torch.tensor(rows, dtype=torch.long, device=device) for rows in order.values()]


def group_rows(
    groups: Sequence[Int[Tensor, "rows"]], size: int, device: Any
) -> Int[Tensor, "size"]:
    """The group index of each of the ``size`` rows that ``groups`` partition."""
    rows = torch.empty(size, dtype=torch.long, device=device)
    for g, members in enumerate(groups):
        rows[members.to(device)] = g
    return rows


def shared_batch(batch: Batch) -> tuple[Batch, Int[Tensor, "batch"] | None]:
    """``(one row per distinct sequence, the sequence of every row)`` of a generation step
    batch (:func:`step_groups`), else ``(batch, None)``: for methods that read activations of a
    single forward and index them per row."""
    groups = step_groups(batch)
    if groups is None:
        return batch, None
    rows = group_rows(groups, batch.size, batch.tokens.device)
    return batch.select([int(g[0]) for g in groups]), rows


def select_steps(target: Target, rows: Int[Tensor, "rows"]) -> Target:
    """The target of the step rows ``rows`` of a step batch's target (per-row token ids,
    foils and positions are sliced; a single value stays as it is)."""
    index = rows.tolist()

    def pick(spec: Any) -> Any:
        if isinstance(spec, Tensor) and spec.ndim == 1 and spec.numel() > 1:
            return spec[rows.to(spec.device)]
        if isinstance(spec, list) and len(spec) > 1:
            return [spec[i] for i in index]
        return spec

    return target.with_(
        token=pick(target.token), foil=pick(target.foil), position=pick(target.position)
    )


def run_shared(
    model: Any,
    batch: Batch,
    target: Target,
    groups: Sequence[Int[Tensor, "rows"]],
    *,
    capture: Sequence[str] = (),
    fwd_hooks: FwdHooks = (),
) -> Forward:
    """:func:`run` for a batch whose rows of each group are the same sequence.

    One forward of the first row of every group (``fwd_hooks`` applied first, ``capture``
    recorded once per group: ``Forward.rows`` maps every batch row to its group), then the
    explained scalar of every row through :meth:`~lens_attrib.target.Target.evaluate` on the
    group's final residual. For a causal model the rows of a generation step batch explain
    different positions of one sequence, so this equals :func:`run` row by row while running the
    model once per sequence instead of once per step.
    """
    store: dict[str, Tensor] = {}
    hooks: list[tuple[Any, HookFn]] = list(fwd_hooks)
    hooks += [(name, _capture_hook(store, name)) for name in capture]
    inverse = group_rows(groups, batch.size, batch.tokens.device)
    firsts = batch.select([int(rows[0]) for rows in groups])
    with model.hooks(fwd_hooks=hooks):
        unique = resid_of(model, firsts)
        if len(groups) == 1:
            resid = unique.expand(batch.size, -1, -1)
        else:
            resid = unique[inverse.to(unique.device)]
        value, resolved, head_out = target.evaluate(model, batch, resid)
    missing = [n for n in capture if n not in store]
    if missing:
        raise RuntimeError(f"Hooks {missing} did not fire: not part of this model's forward.")
    check_value(value, model)
    return Forward(value, resolved, head_out, resid, store, rows=inverse)


__all__ = [
    "ChunkHooks",
    "Forward",
    "FwdHooks",
    "Reduce",
    "check_value",
    "grad_context",
    "group_rows",
    "has_head",
    "head_outputs",
    "no_grad_context",
    "resid_of",
    "run",
    "run_shared",
    "select_steps",
    "shared_batch",
    "step_groups",
    "target_rows",
]


def available_memory(device: torch.device | str) -> int:
    """Bytes free for new tensors on ``device``: CUDA's free memory, else the host's
    ``MemAvailable`` (``/proc/meminfo``); 4 GiB where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30
