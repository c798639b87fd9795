"""One hooked forward for cache-reading methods (ALTI, attention baselines, value zeroing).

Runs the model once with the method's recording hooks under ``torch.no_grad`` and resolves the
target. Methods that need no head (alti, attention, rollout, value zeroing) also work on encoders
without a masked-LM head (all-MiniLM-L6-v2): the target is then the representation at the target
position, and its "token" is the input token there (``meta['target_position_only']``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lens_attrib.inputs import Batch
from lens_attrib.methods.common import FwdHooks, final_residual, hooked_forward
from lens_attrib.models import has_lm_head, is_encoder
from lens_attrib.target import ResolvedTarget, Target


@dataclass
class Forward:
    """The explained value (``None`` when there is no head), the resolved target, the residual."""

    value: Tensor | None
    resolved: ResolvedTarget
    resid: Tensor
    position_only: bool = False


def has_head(model: Any, target: Target) -> bool:
    return target.head is not None or not is_encoder(model) or has_lm_head(model)


def forward(model: Any, batch: Batch, target: Target, fwd_hooks: FwdHooks = ()) -> Forward:
    """Forward with ``fwd_hooks`` (no gradients); resolve the target (position-only if headless)."""
    if target.generate:
        raise NotImplementedError("This method explains one target per input (generate=0).")
    with torch.no_grad():
        if has_head(model, target):
            result = hooked_forward(model, batch, target, fwd_hooks=fwd_hooks)
            assert result.resid is not None
            return Forward(result.value.detach(), result.resolved, result.resid.detach())
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            resid = final_residual(model, batch)
    positions = target.positions(batch)
    idx = torch.arange(batch.size, device=positions.device)
    resolved = ResolvedTarget(positions, batch.tokens[idx, positions], None, False)
    return Forward(None, resolved, resid.detach(), position_only=True)


def target_rows(x: Tensor, positions: Tensor) -> Tensor:
    """``x[b, positions[b]]`` for every item."""
    return x[torch.arange(x.shape[0], device=x.device), positions.to(x.device)]
