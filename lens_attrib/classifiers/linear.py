"""Trainable linear classification and regression heads on a model's final residual.

Features. Item ``b``'s feature is its final residual ``x_b[p_b]`` (the stream the model's own head
reads, :func:`lens_attrib.forward.resid_of`) at the *feature position* ``p_b``: the last real
token for decoders (``Target``'s default position), ``[CLS]`` (real position 0) for encoders.
Mean pooling is deliberately not offered: ``Target(head=h, position=p)`` applies the head to the
residual at one position, so only a one-position feature makes the explained scalar the
classifier's own output.

Head. ``h(x) = W · n(x) + c`` with ``n`` the model's own final normalisation ``ln_final`` for
decoders (the normalisation the language-model head applies; the module is the model's, not a
copy, so hooks on it — e.g. LRP's detached ``hook_scale`` — act on the class head exactly as on
the LM head) and the identity for post-LN encoders (BERT's final residual is already a LayerNorm
output). ``W`` is ``[n_out, d_model]``: ``n_out`` classes, or 1 for regression.

Training (:func:`fit_head`). The normalised features ``u = n(x)`` are standardised,
``z = (u − μ) / σ`` (training mean and standard deviation), and a linear map ``(A, a)`` is fitted
by full-batch L-BFGS on cross-entropy (classification) or mean squared error (regression) plus
``λ ‖A‖²``; ``λ`` is chosen from a grid on a seeded 85/15 split of the training data, then the
map is refitted on all of it. The standardisation is folded into the saved map,
``W = A / σ``, ``c = a − (A / σ) · μ``, so a head is one ``nn.Linear`` after ``n``. Features that
are constant over the training set (``σ_j ≤ 10⁻⁶ · median σ``: all-MiniLM-L6-v2's final LayerNorm
has three dimensions with weights of ``10⁻⁹`` and below) carry no information and get
``W_j = 0``; standardising them would divide by ``σ_j ≈ 0`` and give weights of ``10⁷`` that
blow up the gradient to that LayerNorm once the last blocks are fine-tuned.

Storage (:func:`save_head` / :func:`load_head`): ``head.safetensors`` (the linear map) and
``head.json`` (metadata: training-data hash, seed, n, dev accuracy or Pearson r, …) in one
folder; loading is bit-exact and re-attaches the given model's ``ln_final``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_attrib.backend import arch_of, final_norm
from lens_attrib.forward import no_grad_context, resid_of, target_rows
from lens_attrib.inputs import to_batch
from lens_attrib.progress import progress_bar

WEIGHT_DECAYS = (1e-4, 1e-3, 1e-2, 1e-1)
HEAD_FORMAT = "1"
HEAD_FIT = 2
"""Version of :func:`fit_head`'s recipe, kept in a head's metadata: 2 leaves constant features
out (1 standardised them with ``σ`` clamped at ``1e-8``, which gave near-constant features weights
of ``1e7``; harmless on frozen features, ruinous once the model below is fine-tuned)."""
CONSTANT_FEATURE_RTOL = 1e-6


class LinearHead(nn.Module):
    """``h(x) = W · n(x) + c`` on final-residual rows ``[n, d_model] -> [n, n_out]``.

    ``norm``: the model's final normalisation (decoders) or ``None`` (identity, encoders). It is
    held by reference and not registered as a submodule, so the head's ``state_dict`` is the
    linear map only and the model's own module (with its hooks) is what runs.
    """

    def __init__(self, d_model: int, n_out: int, norm: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        self.linear = nn.Linear(d_model, n_out)
        self._norm = (norm,)  # a tuple: not a registered submodule

    @property
    def norm(self) -> Callable[[Tensor], Tensor] | None:
        return self._norm[0]

    def normalise(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """``n(x)``: the model's ``ln_final`` (applied as on ``[n, 1, d_model]``) or identity."""
        if self.norm is None:
            return x
        return self.norm(x[:, None, :])[:, 0, :]

    def forward(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, "n n_out"]:
        return self.linear(self.normalise(x))  # type: ignore[no-any-return]


def feature_position(model: Any) -> int | None:
    """The feature position of a model: ``0`` (``[CLS]``) for encoders, ``None`` (the last real
    token, ``Target``'s default) for decoders."""
    return 0 if arch_of(model).encoder else None


def head_norm(model: Any) -> Callable[[Tensor], Tensor] | None:
    """The normalisation a head applies before its linear map (module docstring)."""
    return None if arch_of(model).encoder else final_norm(model)


def new_head(model: Any, n_out: int) -> LinearHead:
    """An untrained head for ``model`` (its ``d_model``, ``ln_final`` for decoders)."""
    head = LinearHead(int(model.cfg.d_model), n_out, head_norm(model))
    return head.to(device=model.cfg.device, dtype=model.cfg.dtype)


def residual_features(
    model: Any, inputs: Sequence[Any], *, batch_size: int = 32
) -> Float[Tensor, "n d_model"]:
    """Final residual at the feature position of every input (no gradients, batched).

    ``inputs``: anything :func:`lens_attrib.inputs.to_batch` takes item by item — strings,
    ``(s1, s2)`` sentence pairs (encoders: ``[CLS] s1 [SEP] s2 [SEP]`` with its segment ids), or
    token-id lists (segment 0 on every token). Batches hold inputs of similar length (sorted by
    token count), so little of a batch is padding; rows come back in the order of ``inputs``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    position = feature_position(model)
    lengths = [len(item.tokens) for item in item_tokens(model, inputs)]
    order = sorted(range(len(inputs)), key=lambda i: lengths[i])
    rows: list[Tensor] = []
    with no_grad_context(model):
        starts = range(0, len(inputs), batch_size)
        for start in progress_bar(starts, desc="features", unit="batch"):
            batch = to_batch(model, [inputs[i] for i in order[start : start + batch_size]])
            resid = resid_of(model, batch)
            pos = batch.last_real if position is None else batch.first_real + position
            rows.append(target_rows(resid, pos).cpu())
    if not rows:
        return torch.empty(0, int(model.cfg.d_model), dtype=model.cfg.dtype)
    out = torch.cat(rows)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return out[inverse]


@dataclass
class ItemTokens:
    """One item's real tokens (no padding) and, for encoders, its segment ids."""

    tokens: Tensor
    token_types: Tensor | None


def item_tokens(model: Any, inputs: Sequence[Any], chunk: int = 256) -> list[ItemTokens]:
    """Every input's real token ids (and segment ids), as :func:`lens_attrib.inputs.to_batch`
    encodes it (start token, sentence pairs), without the padding."""
    out: list[ItemTokens] = []
    for start in range(0, len(inputs), chunk):
        batch = to_batch(model, list(inputs[start : start + chunk]))
        for b in range(batch.size):
            real = batch.mask[b]
            types = None if batch.token_types is None else batch.token_types[b][real]
            out.append(ItemTokens(batch.tokens[b][real], types))
    return out


# --------------------------------------------------------------------------- training
def _loss(out: Tensor, y: Tensor, regression: bool) -> Tensor:
    if regression:
        return nn.functional.mse_loss(out[:, 0], y)
    return nn.functional.cross_entropy(out, y)


def _fit_linear(
    z: Tensor, y: Tensor, n_out: int, weight_decay: float, regression: bool, seed: int
) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(z.shape[1], n_out).to(z.dtype)
    opt = torch.optim.LBFGS(
        lin.parameters(), max_iter=200, tolerance_change=1e-10, line_search_fn="strong_wolfe"
    )

    def closure() -> Tensor:
        opt.zero_grad()
        loss = _loss(lin(z), y, regression) + weight_decay * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return lin


def score(out: Tensor, y: Tensor, regression: bool) -> float:
    """Accuracy (classification) or Pearson r of the single output (regression)."""
    if regression:
        return float(torch.corrcoef(torch.stack([out[:, 0].double(), y.double()]))[0, 1])
    return float((out.argmax(-1) == y).double().mean())


def fit_head(
    model: Any,
    features: Float[Tensor, "n d_model"],
    targets: Tensor,
    *,
    n_out: int,
    regression: bool = False,
    seed: int = 0,
    weight_decays: Sequence[float] = WEIGHT_DECAYS,
) -> tuple[LinearHead, dict[str, Any]]:
    """Train a head on cached final-residual ``features`` (module docstring).

    ``targets``: class ids ``[n]`` (classification) or values ``[n]`` (regression, ``n_out=1``).
    Returns the head (on the model's device and dtype) and ``{"weight_decay", "selection_score",
    "train_score"}``.
    """
    if regression and n_out != 1:
        raise ValueError(f"a regression head has one output, got n_out={n_out}")
    if len(features) != len(targets) or len(features) < 4:
        raise ValueError(
            f"need as many targets as features (at least 4), got {len(features)} and {len(targets)}"
        )
    head = new_head(model, n_out)
    with torch.no_grad():  # n(x) on the model's device and dtype, then float64 for the fit
        x = features.to(device=model.cfg.device, dtype=model.cfg.dtype)
        u = head.normalise(x).cpu().to(torch.float64)
    y = targets.to(torch.float64) if regression else targets.long()
    mu, sigma = u.mean(0), u.std(0)
    informative = sigma > CONSTANT_FEATURE_RTOL * sigma.median()
    sigma = torch.where(informative, sigma, torch.ones_like(sigma))
    z = torch.where(informative, (u - mu) / sigma, torch.zeros_like(u))
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(z), generator=gen)
    n_val = max(1, int(0.15 * len(z)))
    val, fit = order[:n_val], order[n_val:]
    scores = {}
    for wd in weight_decays:
        lin = _fit_linear(z[fit], y[fit], n_out, wd, regression, seed)
        with torch.no_grad():
            scores[wd] = score(lin(z[val]), y[val], regression)
    best = max(scores, key=lambda wd: scores[wd])
    lin = _fit_linear(z, y, n_out, best, regression, seed)
    with torch.no_grad():
        weight = torch.where(informative, lin.weight / sigma, torch.zeros_like(lin.weight))
        head.linear.weight.copy_(weight)
        head.linear.bias.copy_(lin.bias - weight @ mu)
        train_score = score(lin(z), y, regression)
    head.requires_grad_(False)
    info = {
        "weight_decay": best,
        "selection_score": scores[best],
        "train_score": train_score,
        "constant_features": int((~informative).sum()),
        "fit": HEAD_FIT,
    }
    return head, info


def evaluate_head(
    head: LinearHead, features: Float[Tensor, "n d_model"], targets: Tensor, regression: bool
) -> float:
    """Accuracy / Pearson r of ``head`` on cached features."""
    weight = head.linear.weight
    with torch.no_grad():
        out = head(features.to(device=weight.device, dtype=weight.dtype)).cpu()
    return score(out, targets, regression)


# --------------------------------------------------------------------------- storage
def save_head(head: LinearHead, folder: str | Path, metadata: dict[str, Any]) -> Path:
    """Write ``head.safetensors`` (the linear map) and ``head.json`` (metadata) to ``folder``."""
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.linear.state_dict().items()}
    save_file(state, str(path / "head.safetensors"))
    meta = {
        **metadata,
        "format": HEAD_FORMAT,
        "d_model": int(head.linear.in_features),
        "n_out": int(head.linear.out_features),
        "norm": head.norm is not None,
        "dtype": str(head.linear.weight.dtype),
    }
    (path / "head.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return path


def load_head(folder: str | Path, model: Any) -> tuple[LinearHead, dict[str, Any]]:
    """The head saved in ``folder`` on ``model`` and its metadata; the weights are bit-exact
    when the model's dtype is the saved one (else they are cast to the model's dtype)."""
    from safetensors.torch import load_file

    path = Path(folder)
    if not (path / "head.json").is_file() or not (path / "head.safetensors").is_file():
        raise FileNotFoundError(f"No saved head in {path} (head.json + head.safetensors).")
    meta: dict[str, Any] = json.loads((path / "head.json").read_text(encoding="utf-8"))
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path}: head format {meta.get('format')!r}, expected {HEAD_FORMAT}.")
    if int(meta["d_model"]) != int(model.cfg.d_model):
        raise ValueError(
            f"{path}: the head reads d_model={meta['d_model']} but the model has "
            f"{model.cfg.d_model}: load it on the model it was trained on."
        )
    if bool(meta["norm"]) != (head_norm(model) is not None):
        raise ValueError(f"{path}: the head was trained on the other architecture kind.")
    head = LinearHead(int(meta["d_model"]), int(meta["n_out"]), head_norm(model))
    state = load_file(str(path / "head.safetensors"))
    head.linear.to(state["weight"].dtype).load_state_dict(state)
    head.requires_grad_(False)
    return head.to(device=model.cfg.device, dtype=model.cfg.dtype), meta


__all__ = [
    "HEAD_FIT",
    "ItemTokens",
    "LinearHead",
    "evaluate_head",
    "feature_position",
    "fit_head",
    "head_norm",
    "item_tokens",
    "load_head",
    "new_head",
    "residual_features",
    "save_head",
    "score",
]
