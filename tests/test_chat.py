"""Chat prompts: the template applied once (no doubled start token), role segments as token
ranges, and aggregation to roles.

Oracles: every segment's ids equal the tokenization of the text that message's turn renders to
(written out here); an Attribution of a ChatPrompt equals one of its token ids; role sums equal
token sums, and for conservative methods the explained logit read from one forward.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lens_attrib import Attribution, ChatPrompt, Target, attribute, chat_prompt
from lens_attrib.errors import InputError
from lens_attrib.models import keep_tokenizer_as_is
from lens_attrib.tiny_models import tiny_llama, tiny_tokenizer

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nyou are a good dog<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's template shape: a default system prompt when the conversation has none."""
WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' <eos> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant ' }}{% endif %}"
)
"""A template that writes the BOS itself (Llama style)."""
PLAIN = "{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' <eos> ' }}{% endfor %}"
"""A template without any special token in front."""

MESSAGES = [
    {"role": "user", "content": "the dog sees the cat"},
    {"role": "assistant", "content": "the cat is near the house"},
    {"role": "user", "content": "who sees the cat"},
]


@functools.cache
def _chat_model(template: str):
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["system", "user", "assistant", "who", "you", "good"])
    tokenizer.chat_template = template
    model = tiny_llama(dtype=torch.float64, d_vocab=len(tokenizer))
    model.tokenizer = keep_tokenizer_as_is(tokenizer)
    return model


def _ids(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _segment_texts(prompt: ChatPrompt) -> list[tuple[str, list[int]]]:
    return [(s.role, prompt.ids[s.start : s.end]) for s in prompt.segments]


def test_chatml_segments_equal_each_turn_tokenized():
    model = _chat_model(CHATML)
    prompt = chat_prompt(model, MESSAGES)
    turns = [
        ("template", "<|im_start|>system\nyou are a good dog<|im_end|>\n"),
        ("user", "<|im_start|>user\nthe dog sees the cat<|im_end|>\n"),
        ("assistant", "<|im_start|>assistant\nthe cat is near the house<|im_end|>\n"),
        ("user", "<|im_start|>user\nwho sees the cat<|im_end|>\n"),
        ("assistant", "<|im_start|>assistant\n"),
    ]
    assert _segment_texts(prompt) == [(role, _ids(model, text)) for role, text in turns]
    assert prompt.text == "".join(text for _, text in turns)
    assert [s.message for s in prompt.segments] == [None, 0, 1, 2, None]
    assert prompt.start_token is None  # the text begins with <|im_start|>: nothing added
    assert prompt.ids == _ids(model, prompt.text)
    assert prompt.roles()[:3] == ["template"] * 3 and len(prompt.roles()) == len(prompt)
    system = [{"role": "system", "content": "be good"}, *MESSAGES[:1]]
    own = chat_prompt(model, system, add_generation_prompt=False)
    assert [s.role for s in own.segments] == ["system", "user"]  # no default system prompt


def test_template_bos_is_not_doubled_and_plain_templates_get_the_start_token():
    model = _chat_model(WITH_BOS)
    bos = model.tokenizer.bos_token_id
    prompt = chat_prompt(model, MESSAGES)
    assert prompt.ids.count(bos) == 1 and prompt.ids[0] == bos and prompt.start_token is None
    assert _segment_texts(prompt)[0] == ("template", [bos])  # the BOS the template writes
    assert [s.role for s in prompt.segments] == [
        "template", "user", "assistant", "user", "assistant"
    ]  # fmt: skip
    plain = chat_prompt(_chat_model(PLAIN), MESSAGES, add_generation_prompt=False)
    assert plain.ids[0] == bos and plain.ids.count(bos) == 1 and plain.start_token == "<bos>"
    assert _segment_texts(plain)[:2] == [
        ("template", [bos]),
        ("user", _ids(model, "user the dog sees the cat <eos> ")),
    ]
    none = chat_prompt(_chat_model(PLAIN), MESSAGES, start_token=False)
    assert none.ids == plain.ids[1:] and none.segments[0].role == "user"


def test_attribute_a_chat_prompt_records_roles(tmp_path):
    model = _chat_model(CHATML)
    prompt = chat_prompt(model, MESSAGES)
    reply = "the cat sees the dog"
    attr = attribute(model, prompt, Target(continuation=reply), method="grad_x_input")
    by_ids = attribute(model, [prompt.ids], Target(continuation=reply), method="grad_x_input")
    assert torch.equal(attr.scores, by_ids.scores)
    assert attr.meta["chat"] == [prompt.records()] * len(attr)
    roles = attr.to_roles()
    assert roles.tokens[0] == ["template", "user", "assistant", "generated"]
    by_turn = attr.to_roles(by="turn")
    turns = ["template", "user[0]", "assistant[1]", "user[2]", "assistant", "generated"]
    assert by_turn.tokens[0] == turns
    with_chat = by_ids.to_roles(prompt)  # the segments given instead of recorded
    assert torch.equal(with_chat.scores, roles.scores)
    loaded = Attribution.load(attr.save(tmp_path / "chat.safetensors"))  # no model needed
    assert loaded.meta["chat"] == attr.meta["chat"]
    assert torch.equal(loaded.to_roles().scores, roles.scores)
    for r in range(len(attr)):  # sums: role units add up the tokens they hold
        real = attr.item_scores(r)
        user = [i for s in prompt.segments if s.role == "user" for i in range(s.start, s.end)]
        assert float(roles.scores[r, 1]) == pytest.approx(float(real[user].sum()), rel=1e-12)
        # the explained token: the reply header for step 0, then generated tokens
        assert int(roles.target.positions[r]) == (2 if r == 0 else 3)
    absmax = attr.to_roles(reduce="absmax")
    real = attr.item_scores(0)[: len(prompt)]
    template = real[: prompt.segments[0].end]
    assert float(absmax.scores[0, 0]) == float(template[template.abs().argmax()])
    with pytest.raises(ValueError, match="do not begin with its chat prompt"):
        attribute(model, "the dog", method="grad_x_input").to_roles(prompt)
    with pytest.raises(ValueError, match="needs the chat segments"):
        by_ids.to_roles()


@pytest.mark.parametrize("method", ["lrp", "alti_logit"])
def test_role_sums_conserve_every_step(method):
    model = _chat_model(CHATML)
    prompt = chat_prompt(model, MESSAGES)
    attr = attribute(model, prompt, Target(continuation="the cat sees"), method=method)
    tokens = attr.scores.sum(-1)
    logit = attr.meta["step_scores"]["logit"]
    if method == "lrp":  # no biases (Llama): Σ tokens = the step's logit
        assert torch.allclose(tokens, logit, rtol=1e-6, atol=0)
    for by in ("role", "turn"):
        roles = attr.to_roles(by=by)
        assert torch.allclose(roles.scores.sum(-1), tokens, rtol=1e-12, atol=1e-15)
        if attr.layer_scores is not None:
            assert torch.allclose(
                roles.layer_scores.sum(-1), attr.layer_scores.sum(-1), rtol=1e-12, atol=1e-15
            )
    figure = attr.to_roles().plot_steps()
    z = figure.data[0].z
    assert [v != v for v in z[0]] == [False, False, False, True]  # step 0: "generated" blank


def test_bad_chat_inputs_are_clear_errors():
    model = _chat_model(CHATML)
    with pytest.raises(InputError, match="non-empty list of messages"):
        chat_prompt(model, "hello")
    with pytest.raises(InputError, match="string 'role' and 'content'"):
        chat_prompt(model, [{"role": "user"}])
    prompt = chat_prompt(model, MESSAGES)
    with pytest.raises(InputError, match="mix ChatPrompts"):
        attribute(model, [prompt, "the dog"], method="grad_x_input")
    bare = tiny_llama()
    with pytest.raises(InputError, match="has no chat template"):
        chat_prompt(bare, MESSAGES)


def test_smollm2_chat_template(smollm2):
    prompt = chat_prompt(smollm2, MESSAGES[:1])
    texts = [
        (s.role, smollm2.tokenizer.decode(prompt.ids[s.start : s.end])) for s in prompt.segments
    ]
    assert texts == [
        (
            "template",
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n",
        ),
        ("user", "<|im_start|>user\nthe dog sees the cat<|im_end|>\n"),
        ("assistant", "<|im_start|>assistant\n"),
    ]
    assert prompt.start_token is None and prompt.ids == _ids(smollm2, prompt.text)
    assert prompt.ids.count(smollm2.tokenizer.bos_token_id) == 3  # one <|im_start|> per turn


def test_generated_reply_to_a_chat_prompt():
    model = _chat_model(CHATML)
    prompts = [chat_prompt(model, MESSAGES), chat_prompt(model, MESSAGES[:1])]
    target = Target(generate=2, sample=True, seed=3, temperature=2.0)
    attr = attribute(model, prompts, target, method="grad_x_input")
    owners = attr.meta["step_prompt"]
    assert attr.meta["chat"] == [prompts[b].records() for b in owners]
    roles = attr.to_roles()
    for r in range(len(owners)):  # every row: its own prompt's roles, sums kept
        assert roles.tokens[r][:3] == ["template", "user", "assistant"]
        assert float(roles.scores[r].sum()) == pytest.approx(
            float(attr.item_scores(r).sum()), rel=1e-12, abs=1e-15
        )
    alone = attribute(model, prompts[1], target, method="grad_x_input").to_roles()
    mine = roles.prompt_steps(1)
    assert mine.tokens == alone.tokens
    assert torch.allclose(mine.scores, alone.scores, rtol=1e-10, atol=0)
