"""env.renderer = "bridge" (rollout_server/environments/verifiers_renderer.py): the verifiers training
client's next turn
keeps the previous prompt and the sampled reply as they were, token for token, and adds what the model's
chat template adds, so a reply that tokenizes differently from how it was sampled no longer splits the
episode; a template the bridge cannot read is left to full renders. And env.renderer's errors, one line."""

from __future__ import annotations

import copy

import pytest

from shared import verifiers_tasks
from shared.cli import check_task
from shared.config import ConfigError, EnvConfig, TandemConfig

pytest.importorskip("verifiers")

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
FOLLOW_UP = [{"role": "user", "content": "Add 4 to it."}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    from renderers import create_renderer

    return create_renderer(tokenizer, verifiers_tasks.renderer_config(EnvConfig(renderer="bridge")))


def _full(renderer, reply: str, tail=FOLLOW_UP) -> list[int]:
    """The whole conversation rendered from its text, as the library's fallback does each turn."""
    messages = [*QUESTION, {"role": "assistant", "content": reply}, *tail]
    return renderer.render_ids(messages, add_generation_prompt=True)


def test_env_renderer_bridge_is_the_bridge_renderer(renderer):
    from rollout_server.environments.verifiers_renderer import BridgeRenderer

    assert type(renderer) is BridgeRenderer


@pytest.mark.parametrize("tail", [FOLLOW_UP, [{"role": "tool", "content": "42"}, *FOLLOW_UP]])
def test_a_reply_that_stopped_or_was_cut_is_bridged_as_a_full_render_would_be(renderer, tokenizer, tail):
    prompt = renderer.render_ids(QUESTION, add_generation_prompt=True)
    reply = tokenizer.encode("It is 5.", add_special_tokens=False)
    stopped = renderer.bridge_to_next_turn(prompt, [*reply, tokenizer.eos_token_id], tail)
    assert stopped.token_ids == _full(renderer, "It is 5.", tail)
    assert stopped.sampled_mask == [False] * len(stopped.token_ids)
    # message_indices: -1 up to the new messages, then each new message's own index, -1 for the prompt
    indices = stopped.message_indices
    assert len(indices) == len(stopped.token_ids) and indices[: len(prompt) + len(reply) + 2] == [-1] * (
        len(prompt) + len(reply) + 2
    )
    assert sorted(set(indices)) == [-1, *range(len(tail))] and indices[-1] == -1
    cut = renderer.bridge_to_next_turn(prompt, reply[:2], tail)  # at the token limit: the close is added
    assert cut.token_ids == _full(renderer, tokenizer.decode(reply[:2]), tail)


def test_a_reply_sampled_in_tokens_its_text_would_not_give_is_kept_as_sampled(renderer, tokenizer):
    prompt = renderer.render_ids(QUESTION, add_generation_prompt=True)
    canonical = tokenizer.encode("It is 5.", add_special_tokens=False)
    odd = [
        *tokenizer.encode("I", add_special_tokens=False),
        *tokenizer.encode("t is 5.", add_special_tokens=False),
    ]
    assert odd != canonical and tokenizer.decode(odd) == tokenizer.decode(canonical)
    bridged = renderer.bridge_to_next_turn(prompt, [*odd, tokenizer.eos_token_id], FOLLOW_UP)
    full = _full(renderer, "It is 5.")
    # what re-rendering would have changed (the split the library then makes) is kept as sampled
    assert bridged.token_ids[: len(prompt) + len(odd) + 1] == [*prompt, *odd, tokenizer.eos_token_id]
    assert bridged.token_ids[len(prompt) + len(odd) :] == full[len(prompt) + len(canonical) :]


def _with_template(tokenizer, template: str):
    from renderers import create_renderer

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return create_renderer(tok, verifiers_tasks.renderer_config(EnvConfig(renderer="bridge")))


PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"


@pytest.mark.parametrize(
    "template",
    [
        # not prefix-stable: the head counts the messages
        "{{ messages | length }} messages\n" + PLAIN + "{% if add_generation_prompt %}assistant:{% endif %}",
        # rewrites an assistant's content: only a full render is faithful to it
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'][:5] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}",
    ],
)
def test_a_template_the_bridge_cannot_read_is_left_to_full_renders(tokenizer, template):
    renderer = _with_template(tokenizer, template)
    prompt = renderer.render_ids(QUESTION, add_generation_prompt=True)
    reply = tokenizer.encode("It is 5.", add_special_tokens=False)
    assert renderer.bridge_to_next_turn(prompt, reply, FOLLOW_UP) is None


def test_a_reply_stopped_on_a_token_that_is_not_the_templates_close_is_not_bridged(tokenizer):
    closed = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
    renderer = _with_template(tokenizer, closed + "{% if add_generation_prompt %}assistant:{% endif %}")
    prompt = renderer.render_ids(QUESTION, add_generation_prompt=True)
    reply = tokenizer.encode(" It is 5.", add_special_tokens=False)
    assert renderer.bridge_to_next_turn(prompt, [*reply, tokenizer.eos_token_id], FOLLOW_UP) is None
    bridged = renderer.bridge_to_next_turn(prompt, reply, FOLLOW_UP)  # cut short: this template's close
    assert tokenizer.decode(bridged.token_ids) == tokenizer.decode([*prompt, *reply]) + (
        "<|endoftext|>user: Add 4 to it.<|endoftext|>assistant:"
    )
    assert renderer.bridge_to_next_turn(prompt, reply, [{"role": "assistant", "content": "x"}]) is None


def test_pieces_that_tokenize_differently_from_their_whole_are_not_bridged(tokenizer):
    renderer = _with_template(tokenizer, PLAIN + "{% if add_generation_prompt %}assistant:{% endif %}")
    pieces = renderer.bridge_pieces(FOLLOW_UP)
    assert pieces == ["\n\n", "user: Add 4 to it.\n\n", "assistant:"]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("".join(pieces)) != [t for p in pieces for t in encode(p)]  # "\n\n" + "user" merge
    prompt = renderer.render_ids(QUESTION, add_generation_prompt=True)
    assert renderer.bridge_to_next_turn(prompt, encode(" It is 5."), FOLLOW_UP) is None


def test_env_renderer_names_a_library_renderer_or_a_class_and_says_so_in_one_line():
    assert verifiers_tasks.renderer_config(EnvConfig(renderer="auto")) is None
    # a name, dots and all
    assert verifiers_tasks.renderer_config(EnvConfig(renderer="qwen3.5")).name == "qwen3.5"
    assert verifiers_tasks.renderer_config(EnvConfig(renderer="llama-3")).name == "llama-3"
    with pytest.raises(ConfigError) as e:
        verifiers_tasks.renderer_config(EnvConfig(renderer="qwen"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("env.renderer = 'qwen': not 'bridge', 'auto', a renderer's name ('auto', ")
    assert "'qwen3'" in str(e.value) and str(e.value).endswith("('module.Class' / 'path/to/file.py:Class')")
    cfg = TandemConfig(
        env={
            "kind": "verifiers",
            "verifiers": {"taskset": {"id": "my_sums"}},
            "renderer": "my_renderers.Chat",
        }
    )
    with pytest.raises(ConfigError) as e:  # --check-config says it before loading the environment
        check_task(cfg)
    assert str(e.value) == (
        "env.renderer = 'my_renderers.Chat': not a renderer's name, nor an importable renderer class: "
        "ModuleNotFoundError: No module named 'my_renderers'"
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


def test_tools_a_template_ignores_are_described_in_the_system_message_and_calls_read_from_text(
    renderer, tokenizer
):
    """SmolLM2's template has no place for tools: the bridge renderer describes them as env.kind = "tools"
    does and reads <tool_call> blocks back as the library's tool calls, so the null harness can run them."""
    from renderers.base import ToolCallParseStatus as Status

    from rollout_server.tool_calls import TOOLS_PREAMBLE

    assert renderer.supports_tools
    rendered = renderer.render(QUESTION, tools=TOOLS, add_generation_prompt=True)
    text = tokenizer.decode(rendered.token_ids)
    assert text.startswith("<|im_start|>system\n" + TOOLS_PREAMBLE + "\n" + '{"name": "multiply", ')
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # tandem's system message belongs to none of the caller's messages; the question is message 0
    assert rendered.message_roles == ["user"] and set(rendered.message_indices) == {-1, 0}
    first_user = rendered.message_indices.index(0)
    assert tokenizer.decode(rendered.token_ids[:first_user]).endswith("<|im_end|>\n")
    assert renderer.render_ids(QUESTION, tools=TOOLS, add_generation_prompt=True) == rendered.token_ids

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    parsed = renderer.parse_response(encode("Let me see. " + CALL) + [tokenizer.eos_token_id], tools=TOOLS)
    assert parsed.content == "Let me see. "
    [call] = parsed.tool_calls
    assert (call.name, call.arguments, call.status) == ("multiply", {"a": 12, "b": 34}, Status.OK)
    bad = renderer.parse_response(
        encode(
            "<tool_call>{x}</tool_call><tool_call>[1]</tool_call><tool_call>{}</tool_call>"
            '<tool_call>{"name": "multiply", "arguments": 3}</tool_call><tool_call>{'
        ),
        tools=TOOLS,
    )
    assert [c.status for c in bad.tool_calls] == [
        Status.INVALID_JSON,
        Status.MALFORMED_STRUCTURE,
        Status.MISSING_NAME,
        Status.MALFORMED_STRUCTURE,
        Status.UNCLOSED_BLOCK,
    ]
    plain = renderer.parse_response(encode("It is 408.") + [tokenizer.eos_token_id], tools=TOOLS)
    assert (plain.content, plain.tool_calls) == ("It is 408.", [])
    # without tools, nothing of this: the template's own render
    assert renderer.render_ids(QUESTION, add_generation_prompt=True) == tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_a_tool_turn_bridged_is_the_full_render_of_the_call_and_its_result(renderer, tokenizer):
    """The call the model sampled, its result as a tool message, the next generation prompt: bridged from
    the sampled tokens, the same tokens a full render of the conversation gives (the call written back as the
    text the model samples), so an episode's turns stay one branch whichever way the library renders."""
    prompt = renderer.render_ids(QUESTION, tools=TOOLS, add_generation_prompt=True)
    sampled = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    result = [{"role": "tool", "tool_call_id": "call_0", "content": "408"}]
    bridged = renderer.bridge_to_next_turn(prompt, sampled, result, tools=TOOLS)
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'},
    }
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}, *result]
    assert bridged.token_ids == renderer.render_ids(conversation, tools=TOOLS, add_generation_prompt=True)
    assert tokenizer.decode(bridged.token_ids[len(prompt) + len(sampled) :]) == (
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )
