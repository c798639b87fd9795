"""Float64 for the few steps of a method whose float32 result would cancel.

Some quantities are differences of nearly equal numbers, and in float32 their rounding error
``≈ 2⁻²⁴`` of the operands is then not small against the difference:

- DeepLIFT's Rescale multiplier ``(φ(h) − φ(h₀))/(h − h₀)`` (Shrikumar et al. 2017), where the
  explained and the reference activation are close, as most elements deep in a model are
  (:func:`lens_attrib.hooks.rules.rescale_multiplier`);
- value zeroing's cosine distance ``1 − cos(y, y^{¬j})`` (Mohebbi et al. 2023), where zeroing one
  token's value vector barely moves a layer's output
  (:func:`lens_attrib.methods.value_zeroing.cosine_distance`).

Their operands come from the model in its own dtype; only the cancelling step is taken in
float64 (:func:`widened`), and the result goes back to the model's dtype. So a float32 model's
numbers depart from the float64 model's by the rounding of its forward and backward passes, as
Gradient×Input's do, and the last bits of a device's kernels no longer decide them. Measured on
SmolLM2-135M and MiniLM-L6 (``benchmarks/bench_deeplift_float32.py``,
``tests/test_deeplift_float32.py``, ``tests/test_value_zeroing.py``): float32 DeepLIFT was 7–90×
further from float64 than Gradient×Input; float32 value zeroing on MiniLM departed by 1.6–2.5 %
of its largest score, 10,000× Gradient×Input's departure.
"""

from __future__ import annotations

import torch
from torch import Tensor


def widened(x: Tensor) -> Tensor:
    """``x`` detached, in float64: on its device, or on the CPU where the device has no float64
    (Apple's MPS). A float64 ``x`` is returned as it is."""
    x = x.detach()
    if x.dtype == torch.float64:
        return x
    return (x.cpu() if x.device.type == "mps" else x).to(torch.float64)
