"""Models from ``load_model`` behave like plain TransformerLens models under TransformerLens' own
operations, and the processed-model warning says what TransformerLens' processing really does.

Oracle: a *plain* ``HookedTransformer`` built from the same weights by another route (the tiny
tied Llama through TransformerLens' own weight converter from the transformers checkpoint;
SmolLM2 from the cached float32 tensors): independent parameters, TransformerLens' layout, no
fast path. Each operation is applied to both, and the logits (and parameters) must agree to the
rounding of the dtype: the two models differ only in memory layout and in the fast path's fused
attention, whose values equal the eager ones to float rounding. Tolerances (relative to the
largest |logit|): 1e-12 in float64 (a few dozen roundings of 1.1e-16 on a 2-layer model),
1e-5 in float32 for SmolLM2 (30 layers; ``ε = 6e-8``), 1e-5 for a float64 model cast to
float32, 2e-2 for float16 (``ε = 4.9e-4``, two layers).

The loaded model used to store a tied unembedding as a view of the embedding; each operation
below then went wrong (``process_weights_(fold_ln=True)`` moved SmolLM2's logits by up to 19.7).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lens_attrib import Target, attribute, load_model
from lens_attrib.fastpath import enable_fast_forward, is_fast_forward
from lens_attrib.models import quiet_deprecation, share_equal_rotary_tables
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama, tiny_tokenizer
from tests.tl_versions import hooked_only, process_weights

F64 = torch.float64
PROCESSED = 1e-6  # float32 processing (ε = 6e-8) of a float64 model: see the processing tests
TEXT = "the keys to the cabinet are near the dog"


# --------------------------------------------------------------------------- helpers
THREE_NINE = hooked_only(
    "compares load_model's model with a plain HookedTransformer built by TransformerLens 3.9's "
    "own converter under 3.9's operations (process_weights_, the fast path, untied views); a "
    "bridge runs the Hugging Face module itself"
)


def _plain(cfg: Any, state_dict: dict[str, torch.Tensor]) -> Any:
    """A plain HookedTransformer from ``cfg`` holding ``state_dict`` (``load_state_dict``)."""
    from transformer_lens import HookedTransformer

    cfg = copy.deepcopy(cfg)
    cfg.init_weights = False
    with quiet_deprecation():
        plain = HookedTransformer(cfg, move_to_device=False)
    missing, unexpected = plain.load_state_dict(state_dict, strict=False)
    buffers = {name for name, _ in plain.named_buffers()}
    assert not unexpected and set(missing) <= buffers, (missing, unexpected)
    return plain.eval()


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)  # type: ignore[no-any-return]


def _relative_gap(ours: torch.Tensor, plain: torch.Tensor) -> float:
    assert ours.dtype == plain.dtype and ours.shape == plain.shape
    return float((ours - plain).abs().max() / plain.abs().max())


def _assert_same_logits(ours: Any, plain: Any, ids: torch.Tensor, rel: float) -> None:
    gap = _relative_gap(_logits(ours, ids), _logits(plain, ids))
    assert gap <= rel, f"logits differ from the plain model's by {gap:.2e} (relative)"


def _assert_same_parameters(ours: Any, plain: Any, rel: float) -> None:
    mine = {k: v.detach() for k, v in ours.named_parameters()}
    theirs = {k: v.detach() for k, v in plain.named_parameters()}
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        scale = float(value.abs().max()) or 1.0
        assert mine[name].dtype == value.dtype, name
        gap = float((mine[name] - value).abs().max()) / scale
        assert gap <= rel, f"{name} differs by {gap:.2e} (relative)"


def _no_shared_memory(model: Any) -> None:
    storages = [
        t.untyped_storage().data_ptr()
        for t in (*model.parameters(), *model.buffers())
        if t.numel() > 0
    ]
    assert len(storages) == len(set(storages)), "two tensors of the model share memory"


# --------------------------------------------------------------------------- the tiny tied Llama
@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with ``tie_word_embeddings=True`` saved by transformers (random norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
    hf_model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.ndim == 1:  # norm gains are 1 by default: fold_ln would have nothing to fold
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    folder = tmp_path_factory.mktemp("tied") / "tiny-tied-llama"
    hf_model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _tiny_pair(folder: Path, dtype: torch.dtype = F64) -> tuple[Any, Any]:
    """(``load_model(folder)``, a plain model from TransformerLens' converter on the same file)."""
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import LlamaForCausalLM

    ours = load_model(str(folder), dtype=dtype)
    hf_model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    plain = _plain(ours.cfg, convert_llama_weights(hf_model, ours.cfg))
    assert torch.equal(plain.W_U, plain.W_E.T)  # tied in the checkpoint
    return ours, plain


def _ids(model: Any, text: str = TEXT) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids  # type: ignore[no-any-return]


@pytest.fixture
def tiny(tied_folder: Path) -> tuple[Any, Any, torch.Tensor]:
    ours, plain = _tiny_pair(tied_folder)
    ids = _ids(ours)
    _assert_same_logits(ours, plain, ids, 1e-12)  # before any operation
    return ours, plain, ids


@THREE_NINE
def test_loaded_tied_model_stores_nothing_twice(tiny):
    ours, plain, _ = tiny
    assert torch.equal(ours.W_U, ours.W_E.T)  # tied values ...
    _no_shared_memory(ours)  # ... in independent memory, as in the plain model
    _no_shared_memory(plain)
    assert is_fast_forward(ours)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # TransformerLens' defaults (center_writing_weights is skipped for RMSNorm)
        {"fold_ln": True, "center_writing_weights": False, "center_unembed": False},
        {"fold_ln": False, "center_writing_weights": False, "center_unembed": True},
    ],
    ids=["defaults", "fold_ln", "center_unembed"],
)
@THREE_NINE
def test_process_weights_matches_plain_tiny(tiny, kwargs):
    ours, plain, ids = tiny
    for model in (ours, plain):
        process_weights(model, **kwargs)
    assert ours.cfg.normalization_type == plain.cfg.normalization_type
    # TransformerLens 3.9 processes every weight in float32, also a float64 model's; reductions
    # (the vocabulary mean of W_U) then sum in the order of each model's layout: float32 rounding
    _assert_same_parameters(ours, plain, PROCESSED)
    _assert_same_logits(ours, plain, ids, PROCESSED)
    assert is_fast_forward(ours)  # processing copies into the parameters: layout kept


@THREE_NINE
def test_fold_layer_norm_matches_plain(tiny):
    ours, plain, ids = tiny
    for model in (ours, plain):
        folded = model.fold_layer_norm(model.state_dict(), fold_biases=False, center_weights=False)
        model.load_state_dict(folded)
    _assert_same_parameters(ours, plain, 1e-12)
    _assert_same_logits(ours, plain, ids, 1e-12)
    assert is_fast_forward(ours)


def _untied_state_dict(plain: Any) -> dict[str, torch.Tensor]:
    """``plain``'s weights with ``W_E`` and ``W_U`` made different (a fine-tuned, untied copy)."""
    gen = torch.Generator().manual_seed(7)
    state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    state["embed.W_E"] += 0.1 * torch.randn(state["embed.W_E"].shape, generator=gen, dtype=F64)
    state["unembed.W_U"] -= 0.1 * torch.randn(state["unembed.W_U"].shape, generator=gen, dtype=F64)
    return state


@THREE_NINE
def test_load_state_dict_matches_plain(tiny):
    ours, plain, ids = tiny
    state = _untied_state_dict(plain)
    ours.load_state_dict(state)
    plain.load_state_dict(state)
    assert torch.equal(ours.W_E, state["embed.W_E"]) and torch.equal(ours.W_U, state["unembed.W_U"])
    _assert_same_logits(ours, plain, ids, 1e-12)
    assert is_fast_forward(ours)


@THREE_NINE
def test_load_state_dict_assign_matches_plain(tiny):
    """``assign=True`` gives the model the loaded tensors themselves (as TransformerLens does):
    outputs stay right; the copy-free layout is the loaded tensors' until enable_fast_forward."""
    ours, plain, ids = tiny
    state = _untied_state_dict(plain)
    ours.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    plain.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    _assert_same_logits(ours, plain, ids, 1e-12)
    assert not is_fast_forward(ours)  # contiguous loaded tensors: correct, forward copies again
    enable_fast_forward(ours)
    assert is_fast_forward(ours)
    _assert_same_logits(ours, plain, ids, 1e-12)
    _assert_same_parameters(ours, plain, 0.0)


@pytest.mark.parametrize(
    ("cast", "dtype", "rel"),
    [
        (lambda m: m.to(torch.float32, print_details=False), torch.float32, 1e-5),
        (lambda m: m.to(torch.float16, print_details=False), torch.float16, 2e-2),
        # .double() leaves cfg.dtype at float32: values are the float32 ones, computed in float64
        (lambda m: m.to(torch.float32, print_details=False).double(), F64, 1e-12),
    ],
    ids=["to_float32", "to_float16", "to_float32_then_double"],
)
@THREE_NINE
def test_dtype_casts_match_plain(tiny, cast, dtype, rel):
    ours, plain, ids = tiny
    cast(ours)
    cast(plain)
    assert {p.dtype for p in ours.parameters()} == {dtype}
    assert ours.cfg.dtype == plain.cfg.dtype  # .to() updates cfg.dtype, .double() does not
    _assert_same_parameters(ours, plain, 0.0)  # a cast of equal values: equal, layout aside
    _assert_same_logits(ours, plain, ids, rel)
    assert is_fast_forward(ours)  # casts keep each parameter's strides


@THREE_NINE
@pytest.mark.parametrize("cast", ["float", "half"])
def test_narrowing_module_casts_fail_as_on_plain(tiny, cast):
    """``.float()``/``.half()`` of a float64 model leave ``cfg.dtype`` at float64, and
    TransformerLens' forward then multiplies float64 activations with narrower weights: the plain
    model raises, and so does ours, with the same error."""
    ours, plain, ids = tiny
    errors = []
    for model in (ours, plain):
        getattr(model, cast)()
        with pytest.raises(RuntimeError, match="must have the same dtype") as caught:
            _logits(model, ids)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert is_fast_forward(ours)


@THREE_NINE
def test_generate_matches_plain(tiny):
    ours, plain, ids = tiny
    kwargs = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False, "verbose": False}
    assert torch.equal(ours.generate(ids, **kwargs), plain.generate(ids, **kwargs))
    assert is_fast_forward(ours)


@THREE_NINE
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_optimizer_step_matches_plain(tiny, optimizer):
    """One step updates W_E and W_U each by its own gradient (not twice through one memory)."""
    ours, plain, ids = tiny
    for model in (ours, plain):
        opt = optimizer(model.parameters(), lr=1e-2)
        model(ids, return_type="loss").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_same_parameters(ours, plain, 1e-12)
    assert not torch.equal(ours.W_U, ours.W_E.T)  # the two gradients differ, so do the weights
    _assert_same_logits(ours, plain, ids, 1e-12)
    assert is_fast_forward(ours)


@THREE_NINE
def test_in_place_edit_of_W_E_leaves_W_U_alone(tiny):
    ours, plain, ids = tiny
    w_u = ours.W_U.detach().clone()
    token = int(ids[0, 1])
    for model in (ours, plain):
        with torch.no_grad():
            model.W_E[token] *= -3.0
    assert torch.equal(ours.W_U, w_u)
    _assert_same_logits(ours, plain, ids, 1e-12)


@THREE_NINE
def test_tied_bert_mlm_folder_is_untied_in_memory(tmp_path):
    """BERT's MLM decoder is tied to its word embeddings in transformers: loaded, they are two
    parameters, and an edit of one leaves the other."""
    from transformers import BertConfig, BertForMaskedLM

    tok = tiny_tokenizer(encoder=True)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=F64)
    assert torch.equal(model.unembed.W_U, model.embed.embed.W_E.T)
    _no_shared_memory(model)
    w_u = model.unembed.W_U.detach().clone()
    with torch.no_grad():
        model.embed.embed.W_E.mul_(2.0)
    assert torch.equal(model.unembed.W_U, w_u)


# --------------------------------------------------------------------------- SmolLM2 (the bug)
@THREE_NINE
def test_process_weights_matches_plain_smollm2():
    """Issue 26's call on the real model: ``fold_ln`` alone. TransformerLens' processing of a
    135M-parameter model takes tens of seconds on a loaded machine, so SmolLM2 runs this one
    operation; the tiny tied Llama runs every operation (float64)."""
    from transformer_lens.config import HookedTransformerConfig

    from lens_attrib.models import smollm2_config, smollm2_float32_weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model("smollm2-135m")
    weights, _ = smollm2_float32_weights()
    plain = _plain(HookedTransformerConfig(**smollm2_config()), dict(weights.items()))
    del weights
    ids = _ids(ours, "The keys to the cabinet")
    before = _logits(ours, ids)
    assert _relative_gap(before, _logits(plain, ids)) <= 1e-5
    kwargs = {"fold_ln": True, "center_writing_weights": False, "center_unembed": False}
    ours.process_weights_(**kwargs)
    plain.process_weights_(**kwargs)
    after = _logits(ours, ids)
    assert _relative_gap(after, _logits(plain, ids)) <= 1e-5
    for name in ("W_E", "W_U"):  # each written once, by its own folding
        mine, theirs = getattr(ours, name).detach(), getattr(plain, name).detach()
        assert float((mine - theirs).abs().max()) <= 1e-6 * float(theirs.abs().max()), name
    assert is_fast_forward(ours)
    # fold_ln preserves the outputs up to float32 rounding (RMSNorm's scale moved into W_U etc.)
    assert _relative_gap(after, before) <= 1e-5
    assert int(after[0, -1].argmax()) == int(before[0, -1].argmax())


# --------------------------------------------------------------------------- opt-in rotary sharing
@THREE_NINE
def test_shared_rotary_tables_stay_right_under_operations(tiny):
    ours, plain, ids = tiny
    assert share_equal_rotary_tables(ours) == 2 * (ours.cfg.n_layers - 1)
    assert len({id(block.attn.rotary_sin) for block in ours.blocks}) == 1
    ours.process_weights_()  # rounds every table to float32 (TransformerLens 3.9): unshares
    plain.process_weights_()
    _assert_same_logits(ours, plain, ids, PROCESSED)
    # a state dict whose layers carry different tables: each layer gets its own
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    state["blocks.0.attn.rotary_sin"][5:] = 0.0
    share_equal_rotary_tables(ours)
    ours.load_state_dict(state)
    plain.load_state_dict(state)
    for mine, theirs in zip(ours.blocks, plain.blocks, strict=True):
        assert torch.equal(mine.attn.rotary_sin, theirs.attn.rotary_sin)
    _assert_same_logits(ours, plain, ids, 1e-12)


# --------------------------------------------------------------------------- the warning's claims
def _processed_warning(model: Any) -> str:
    with pytest.warns(UserWarning, match="processed by TransformerLens") as caught:
        attribute(model, "the dog sees the cat", method="normxlogit")
    return " ".join(str(w.message) for w in caught if "processed" in str(w.message))


def test_warning_for_an_rms_model_states_what_processing_did():
    model = tiny_llama(dtype=F64)
    with torch.no_grad():  # (its random weights are float32 values: give W_E float64 digits)
        model.W_E.mul_(1.0 + 2.0**-40)
    original = copy.deepcopy(model)
    process_weights(model)  # fold_ln + center_unembed; center_writing_weights skipped
    message = _processed_warning(model)
    assert "RMSNorm's scale" in message and "exact arithmetic only" in message
    assert "center_unembed" in message and "raw logits are not" in message
    assert "LayerNorm's scale" not in message and "center_writing_weights" not in message
    assert "outputs are unchanged, but" not in message  # the old, false blanket claim
    # claims checked against what TransformerLens did: the embedding was not centred, only
    # rounded to float32 like every weight of a processed float64 model
    assert torch.equal(model.W_E, original.W_E.float().double())
    assert not torch.equal(model.W_E, original.W_E)


def test_warning_for_a_layernorm_model_states_what_processing_did():
    model = tiny_gpt2(dtype=F64)
    original = copy.deepcopy(model)
    process_weights(model)
    message = _processed_warning(model)
    for phrase in (
        "LayerNorm's scale and bias",
        "center_writing_weights centred",
        "fold_value_biases",
        "raw logits are not",
        "float32",
    ):
        assert phrase in message, phrase
    # center_unembed: each position's logits moved by one amount; probabilities did not move
    ids = model.tokenizer("the dog sees the cat", return_tensors="pt").input_ids
    new, old = _logits(model, ids), _logits(original, ids)
    shift = new - old
    assert float(shift.mean(-1).abs().max()) > 1e-2 * float(old.abs().max())
    assert float((shift - shift.mean(-1, keepdim=True)).abs().max()) <= 1e-5 * float(
        old.abs().max()
    )  # the float32 rounding of the processed weights (see the warning)
    gap = (new.log_softmax(-1) - old.log_softmax(-1)).abs().max()
    assert float(gap) <= 1e-5 * float(old.log_softmax(-1).abs().max())


def test_every_method_warns_when_centred_logits_are_explained_without_foil():
    model = tiny_llama(dtype=F64)
    process_weights(model, fold_ln=False, center_writing_weights=False, center_unembed=True)
    with pytest.warns(UserWarning, match="center_unembed") as caught:
        attribute(model, "the dog sees the cat", method="grad_x_input")  # reads no parametrisation
    assert any("Pass a foil" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model, and never for a contrastive target
        attribute(model, "the dog sees the cat", method="gradient")
        fresh = tiny_llama(dtype=F64)
        process_weights(fresh, fold_ln=False, center_writing_weights=False, center_unembed=True)
        attribute(fresh, "the dog sees the cat", Target(token="cat", foil="dog"), method="gradient")
    unprocessed = tiny_llama(dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unprocessed model: no warning at all
        attribute(unprocessed, "the dog sees the cat", method="grad_x_input")
