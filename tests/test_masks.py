"""Loss masks: exactly each assistant turn's tokens in the full rendering, end-of-turn token included."""

import copy

import pytest
from conftest import ROOT

import train

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN3_5 = (ROOT / "examples/qwen3_5_chat_template.jinja").read_text()
TEMPLATES = {
    "chatml": (CHATML, "<|im_end|>", False),
    "llama3": (LLAMA3, "<|eot_id|>", True),
    "qwen3_5": (QWEN3_5, "<|im_end|>", True),
}  # (template, end of turn, template trims content)


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def loss_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss tokens."""
    runs, current = [], []
    for token, m in zip(ids + [None], mask + [False]):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.mark.parametrize("name", TEMPLATES)
def test_loss_spans_are_the_assistant_contents_plus_end_of_turn(name, tokenizer, conversations):
    template, eot, trims = TEMPLATES[name]
    tok = with_template(tokenizer, template)
    masker = train.AssistantMasker(tok)
    system = [{"role": "system", "content": "You are concise."}]
    for messages in conversations[:100] + [system + c for c in conversations[100:110]]:
        ids, mask = masker(messages)
        expected = [
            (m["content"].strip() if trims else m["content"]) + eot for m in messages if m["role"] == "assistant"
        ]
        assert loss_runs(tok, ids, mask) == expected
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_qwen3_5_empty_think_block_is_rendered_but_not_trained(tokenizer, conversations):
    tok = with_template(tokenizer, QWEN3_5)
    ids, mask = train.AssistantMasker(tok)(conversations[0])
    think = tok.convert_tokens_to_ids("<think>")
    positions = [i for i, t in enumerate(ids) if t == think]
    assert len(positions) == 1, "the template renders the empty think block on the last assistant turn only"
    assert not mask[positions[0]]


def seed_prefix_diff_mask(tok, messages):
    """The seed recipe's method: an assistant turn is what templating through it adds to the prompt before it."""
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    mask = [False] * len(full)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prefix = tok.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False)
            through = tok.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
            for j in range(len(prefix), min(len(through), len(full))):
                mask[j] = True
    return full, mask


def test_the_seed_method_is_wrong_on_qwen3_5_where_ours_is_exact(tokenizer, conversations):
    tok = with_template(tokenizer, QWEN3_5)
    masker = train.AssistantMasker(tok)
    wrong = sum(seed_prefix_diff_mask(tok, c)[1] != masker(c)[1] for c in conversations[:50])
    assert wrong == 50


def test_content_the_template_rewrites_is_skipped_not_guessed(tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    assert train.AssistantMasker(with_template(tokenizer, QWEN3_5))(messages) == "template renders content-dependently"
    ids, mask = train.AssistantMasker(with_template(tokenizer, CHATML))(messages)  # ChatML renders it verbatim
    assert loss_runs(tokenizer, ids, mask) == ["<think>add</think>4<|im_end|>"]


def test_span_that_does_not_start_on_a_token_boundary_is_skipped(tokenizer):
    # "assistant: Four" -> byte-level BPE merges the space into " Four": the span would start mid-token.
    template = "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four"}]
    assert (
        train.AssistantMasker(with_template(tokenizer, template))(messages) == "assistant span not on token boundaries"
    )


def test_template_without_end_of_turn_token_is_skipped(tokenizer):
    template = "{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n\n{% endfor %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four"}]
    assert (
        train.AssistantMasker(with_template(tokenizer, template))(messages)
        == "no end-of-turn token after an assistant turn"
    )


@pytest.mark.parametrize(
    "messages, reason",
    [
        ("not a list", "messages not a non-empty list"),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "unknown role"),
        ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}], "empty or non-string content"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "empty or non-string content"),
    ],
)
def test_malformed_conversations_are_named(messages, reason):
    assert train.conversation_problem(messages) == reason
