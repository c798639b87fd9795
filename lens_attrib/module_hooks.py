"""Whether a module's tensor is seen by a hook: the one test every backend and the fast path use
to decide between the lean path and the one a user's hook (or a method's) must observe."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as nn_module


def has_hooks(point: nn.Module) -> bool:
    """Whether any forward, forward-pre or backward hook (own or global) is on ``point``."""
    return bool(
        point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
    )
