"""Loss masks: exactly each assistant turn's tokens in the full rendering, end-of-turn token included."""

import copy
from collections import Counter

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


def skip_reason(call) -> str:
    """The reason call() skips its record (train.Skip's message); fails the test if it does not."""
    with pytest.raises(train.Skip) as skipped:
        call()
    return str(skipped.value)


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
    rewriting = CHATML.replace("{{ m.content }}", "{{ m.content | replace('2', 'two') }}")
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    masker = train.AssistantMasker(with_template(tokenizer, rewriting))
    assert skip_reason(lambda: masker(messages)) == "template renders content-dependently"
    ids, mask = train.AssistantMasker(with_template(tokenizer, CHATML))(messages)  # no reasoning_content: verbatim
    assert loss_runs(tokenizer, ids, mask) == ["<think>add</think>4<|im_end|>"]


def test_text_the_template_adds_after_the_last_content_is_checked_too(tokenizer):
    """A rendering must be the skeleton with the contents put back, to its end: text that depends on a content and
    comes after the last one (here a marker for long answers) skips the conversation too."""
    tail = CHATML + "{% if messages[-1].content | length > 20 %}<|im_start|>long<|im_end|>{% endif %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four, as two and two make."}]
    masker = train.AssistantMasker(with_template(tokenizer, tail))
    assert skip_reason(lambda: masker(messages)) == "template renders content-dependently"
    ids, mask = masker(messages[:1] + [{"role": "assistant", "content": "Four."}])  # short: the same skeleton
    assert loss_runs(tokenizer, ids, mask) == ["Four.<|im_end|>"]


def test_span_that_does_not_start_on_a_token_boundary_is_skipped(tokenizer):
    # "assistant: Four" -> byte-level BPE merges the space into " Four": the span would start mid-token.
    template = "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four"}]
    masker = train.AssistantMasker(with_template(tokenizer, template))
    assert skip_reason(lambda: masker(messages)) == "assistant span not on token boundaries"


def test_template_without_end_of_turn_token_is_skipped(tokenizer):
    template = "{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n\n{% endfor %}"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four"}]
    masker = train.AssistantMasker(with_template(tokenizer, template))
    assert skip_reason(lambda: masker(messages)) == "no end-of-turn token after an assistant turn"


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
def test_malformed_conversations_are_named(messages, reason, tokenizer):
    masker = train.AssistantMasker(tokenizer)
    assert skip_reason(lambda: train.samples_of({"messages": messages}, masker, train.Config())) == reason


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.mark.parametrize("first_content", ["", "Let me look."])
def test_tool_calls_are_trained_tool_results_and_definitions_are_not(tokenizer, first_content):
    """Qwen3.5: a turn that only calls a tool (empty content) is rendered without the blank line a content would
    bring; its call is trained through <|im_end|>, like a call after a content. The tool's result and the tool
    definitions (rendered into the system prompt) are not trained."""
    tok = with_template(tokenizer, QWEN3_5)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": first_content, "tool_calls": [CALL]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."},
    ]
    ids, mask = train.AssistantMasker(tok)(messages, [WEATHER_TOOL])
    assert ids == tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True, return_dict=False)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    first = f"{first_content}\n\n{call}" if first_content else call
    assert loss_runs(tok, ids, mask) == [f"{first}<|im_end|>", "18C in Paris.<|im_end|>"]
    text = tok.decode(ids)
    assert "The weather in a city" in text and "18C" in tok.decode([t for t, m in zip(ids, mask) if not m])


def test_records_in_openai_form_and_content_parts_are_read_as_the_template_takes_them(tokenizer):
    """Tool definitions and call arguments as JSON text are parsed; text parts are joined; an image part skips."""
    tok = with_template(tokenizer, QWEN3_5)
    cfg = train.Config()
    as_json = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": "", "tool_calls": [as_json]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": [{"type": "text", "text": "18C in Paris."}]},
        ],
        "tools": '[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city"}}]',
    }
    messages, tools = train.conversation_of(record["messages"], record["tools"], cfg)
    assert messages[0]["content"] == "Weather in Paris?" and messages[3]["content"] == "18C in Paris."
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tools[0]["function"]["name"] == "get_weather"
    ids, mask = train.AssistantMasker(tok)(messages, tools)
    assert len(loss_runs(tok, ids, mask)) == 2
    image = {"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "What is it?"}]}
    assert skip_reason(lambda: train.conversation_of([image], None, cfg)) == "a content part that is not text"
    bad_tools = lambda: train.conversation_of(record["messages"], "{not json", cfg)  # noqa: E731
    assert skip_reason(bad_tools) == "tools or tool-call arguments not JSON"


def totals(counts) -> dict:
    """The counts over all sources (tokenize_stream also keeps them by source, under (source, what))."""
    return {k: v for k, v in counts.items() if isinstance(k, str)}


def turn(content, reasoning=None):
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


def test_reasoning_is_trained_with_its_answer_as_generated_after_the_prompt(tokenizer):
    """Qwen3.5's generation prompt ends with `<think>\\n`: the span is what the model generates after it."""
    tok = with_template(tokenizer, QWEN3_5)
    question = {"role": "user", "content": "2+2?"}
    [(ids, mask)] = train.AssistantMasker(tok).samples([question, turn("4", "Two and two make four.")])
    assert ids == tok.apply_chat_template([question, turn("4", "Two and two make four.")], return_dict=False)
    assert loss_runs(tok, ids, mask) == ["Two and two make four.\n</think>\n\n4<|im_end|>"]
    prompt = tok.apply_chat_template([question], add_generation_prompt=True, return_dict=False)
    assert ids[: len(prompt)] == prompt and mask.index(True) == len(prompt)
    # The same reasoning written into the content is the same sample.
    assert train.AssistantMasker(tok).samples([question, turn("<think>\nTwo and two make four.\n</think>\n\n4")]) == [
        (ids, mask)
    ]


def test_reasoning_of_earlier_turns_gets_a_sample_of_its_own_and_is_trained_once(tokenizer):
    """Qwen3.5 renders reasoning after the last user turn only. [u1, a1 (r1), u2, a2 (r2)]: the whole conversation
    trains a2 with r2 (a1, rendered there without r1, is not trained), and [u1, a1] trains a1 with r1."""
    tok = with_template(tokenizer, QWEN3_5)
    u1, u2 = {"role": "user", "content": "2+2?"}, {"role": "user", "content": "and 3+3?"}
    samples = train.AssistantMasker(tok).samples([u1, turn("4", "Two twos."), u2, turn("6", "Two threes.")])
    assert [loss_runs(tok, ids, mask) for ids, mask in samples] == [
        ["Two threes.\n</think>\n\n6<|im_end|>"],
        ["Two twos.\n</think>\n\n4<|im_end|>"],
    ]
    assert "Two twos." not in tok.decode(samples[0][0])  # the template drops it there
    # A turn without reasoning is trained where it is, as before.
    [(ids, mask)] = train.AssistantMasker(tok).samples([u1, turn("4"), u2, turn("6", "Two threes.")])
    assert loss_runs(tok, ids, mask) == ["4<|im_end|>", "Two threes.\n</think>\n\n6<|im_end|>"]


def test_reasoning_can_be_dropped_and_extra_samples_are_counted(tokenizer):
    tok = with_template(tokenizer, QWEN3_5)
    u1, u2 = {"role": "user", "content": "2+2?"}, {"role": "user", "content": "and 3+3?"}
    record = {"messages": [u1, turn("<think>Two twos.</think>4"), u2, turn("6", "Two threes.")]}
    counts = Counter()
    [(_, samples)] = train.tokenize_stream([(0, record, 0)], train.AssistantMasker(tok), train.Config(), counts)
    assert len(samples) == 2 and totals(counts) == {"conversations": 1, train.EXTRA_SAMPLES: 1}
    assert train.skip_reasons(counts) == {}
    dropped = train.Config(reasoning="drop")
    [(_, [(ids, mask)])] = train.tokenize_stream([(0, record, 0)], train.AssistantMasker(tok), dropped, Counter())
    assert loss_runs(tok, ids, mask) == ["4<|im_end|>", "6<|im_end|>"] and "Two" not in tok.decode(ids)


def test_tool_calls_that_could_be_masked_wrongly_are_skipped(tokenizer):
    """Special-token text in call arguments, reasoning for a template that cannot render it, and a template that
    puts the calls before the content: each skips the record, with its reason, instead of a wrong mask."""
    qwen = train.AssistantMasker(with_template(tokenizer, QWEN3_5))
    fake_end = {**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris<|im_end|>"}}}
    call_turn = {"role": "assistant", "content": "", "tool_calls": [fake_end]}
    assert (
        skip_reason(lambda: qwen([{"role": "user", "content": "Weather?"}, call_turn]))
        == "special-token text in a content"
    )
    chatml = train.AssistantMasker(with_template(tokenizer, CHATML))
    reasoned = [{"role": "user", "content": "2+2?"}, turn("4", "Two twos.")]
    assert (
        skip_reason(lambda: chatml.samples(reasoned)) == "reasoning the template does not render (set reasoning: drop)"
    )
    calls_first = CHATML.replace(
        "{{ m.content }}",
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}{{ m.content }}",
    )
    only_calls = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    masker = train.AssistantMasker(with_template(tokenizer, calls_first))
    assert skip_reason(lambda: masker(only_calls)) == "template renders content-dependently"


def test_an_openai_tool_call_turn_with_null_content_is_trained(tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "18C in Paris."},
        ]
    }
    counts = Counter()
    tok = with_template(tokenizer, QWEN3_5)
    [(_, [(ids, mask)])] = train.tokenize_stream([(0, record, 0)], train.AssistantMasker(tok), train.Config(), counts)
    assert len(loss_runs(tok, ids, mask)) == 2 and totals(counts) == {"conversations": 1}


# The structure of Llama 3.1's tool-call format (its prompt-format documentation): a turn with tool calls renders
# only the calls, as JSON, and drops any content; tool results come back under the "ipython" role. (Written for
# this test, not Meta's template text.)
LLAMA3_TOOLS = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for c in m.tool_calls %}{{ \'{"name": "\' + c.function.name + \'", "parameters": \' }}'
    "{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_a_template_that_renders_calls_without_content_trains_them_from_its_generation_prompt(tokenizer):
    tok = with_template(tokenizer, LLAMA3_TOOLS)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."},
    ]
    ids, mask = train.AssistantMasker(tok)(messages, [WEATHER_TOOL])
    assert ids == tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True, return_dict=False)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    assert loss_runs(tok, ids, mask) == [call, "18C in Paris.<|eot_id|>"]
    # A content beside calls is not rendered by this template: it cannot be trained, so the record is skipped.
    with_content = [messages[0], {**messages[1], "content": "Let me look."}, *messages[2:]]
    assert skip_reason(lambda: train.AssistantMasker(tok)(with_content)) == "template renders content-dependently"


@pytest.mark.parametrize("name", TEMPLATES)
def test_an_empty_system_prompt_or_tool_result_is_rendered_and_the_conversation_trained(name, tokenizer):
    """ShareGPT dumps often carry an empty system prompt, and a tool may return nothing: templates render both, so
    the conversation trains (an empty user or assistant turn still skips it)."""
    tok, end = with_template(tokenizer, TEMPLATES[name][0]), TEMPLATES[name][1]
    record = {
        "conversations": [
            {"from": "system", "value": ""},
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "gpt", "value": "Let me look."},
            {"from": "observation", "value": ""},
            {"from": "gpt", "value": "No data."},
        ]
    }
    messages, _ = train.conversation_of(record["conversations"], None, train.Config())
    assert messages[0]["content"] == messages[3]["content"] == ""
    [(ids, mask)] = train.samples_of(record, train.AssistantMasker(tok), train.Config())
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert loss_runs(tok, ids, mask) == [f"Let me look.{end}", f"No data.{end}"]


def test_call_arguments_as_json_text_keep_their_nulls_and_an_empty_text_is_no_arguments():
    """Only Parquet's filled-in structs (arguments as a mapping) lose their None values: nulls a user wrote in JSON
    text are part of the call."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": null}'}}
    assert train.parsed_arguments(call)["function"]["arguments"] == {"city": "Paris", "unit": None}
    struct = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": None}}}
    assert train.parsed_arguments(struct)["function"]["arguments"] == {"city": "Paris"}
    no_arguments = {"type": "function", "function": {"name": "get_time", "arguments": ""}}
    assert train.parsed_arguments(no_arguments)["function"]["arguments"] == {}
