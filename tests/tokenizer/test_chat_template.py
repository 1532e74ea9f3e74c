"""`minipaged.tokenizer.chat_template` on its own: templates rendered as `transformers` renders
them.

One template uses every feature of the environment the module promises (trim_blocks and
lstrip_blocks, `namespace()`, `{% break %}`, `{% generation %}`, a `tojson` that keeps HTML and
takes json.dumps's arguments, `tools` / `documents` tested against none, the special tokens and
extra variables); random conversations rendered by minipaged must equal `transformers`' own
`render_jinja_template` of the same template, with and without the generation prompt. The input
checks, `raise_exception`, invalid Jinja and `template_from_config` are checked against their
stated rules.
"""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from minipaged.tokenizer.bpe import TokenizerError
from minipaged.tokenizer.chat_template import (
    ChatTemplateError,
    render_chat_template,
    template_from_config,
)

TEMPLATE = """{{ bos_token }}
{% set ns = namespace(users=0, last_user=-1) %}
{% for m in messages %}
    {% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% set ns.last_user = loop.index0 %}
    {% endif %}
{% endfor %}
{% if tools is not none %}
<tools>{{ tools | tojson(indent=2, sort_keys=true) }}</tools>
{% endif %}
{% if documents is not none %}
    {% for d in documents %}
<doc title="{{ d.title }}">{{ d.text }}</doc>
    {% endfor %}
{% endif %}
users={{ ns.users }} last={{ ns.last_user }} thinking={{ enable_thinking | default(true) }}
{% for m in messages %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% if m.role == 'assistant' %}
<|{{ m.role }}|>{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
<|{{ m.role }}|>{{ m.content }}
    {% endif %}
    {% if m.meta is defined %}
meta={{ m.meta | tojson }} compact={{ m.meta | tojson(separators=(',', ':')) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
text |= st.sampled_from(["<b>&amp;</b>", "  {{ not jinja }} ", "\n\n", "é🙂", "'quoted' \"x\""])
meta = st.dictionaries(st.sampled_from(["lang", "html", "n"]), text | st.integers(), max_size=2)
message = st.builds(
    lambda role, content, m: {"role": role, "content": content, **({"meta": m} if m else {})},
    st.sampled_from(["system", "user", "assistant", "tool", "stop"]),
    text,
    meta,
)
tool = st.fixed_dictionaries({"name": text, "description": text})
document = st.fixed_dictionaries({"title": text, "text": text})


@given(
    messages=st.lists(message, min_size=1, max_size=5),
    add_generation_prompt=st.booleans(),
    tools=st.none() | st.lists(tool, max_size=2),
    documents=st.none() | st.lists(document, max_size=2),
    extra=st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
)
def test_rendering_equals_transformers(
    messages, add_generation_prompt, tools, documents, extra
) -> None:
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    expected = render_jinja_template(
        [messages],
        tools=tools,
        documents=documents,
        chat_template=TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **tokens,
        **extra,
    )[0][0]
    ours = render_chat_template(
        TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        documents=documents,
        **tokens,
        **extra,
    )
    assert ours == expected


@given(messages=st.lists(message, min_size=1, max_size=4))
def test_none_valued_keys_are_dropped_and_the_callers_messages_left_alone(messages) -> None:
    """An OpenAI-style `"content": None` renders as a missing key, never as the text "None"."""
    with_none = [{**m, "content": None, "tool_calls": None} for m in messages]
    before = [dict(m) for m in with_none]
    template = "{% for m in messages %}[{{ m.keys() | sort | join(',') }}]{% endfor %}"
    ours = render_chat_template(template, with_none, add_generation_prompt=False)
    expected = "".join(f"[{','.join(sorted(k for k in m if k not in ('content', 'tool_calls')))}]"
                       for m in messages)
    assert ours == expected
    assert with_none == before


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", "messages must be a list"),
        (b"hello", "messages must be a list"),
        ({"role": "user"}, "messages must be a list"),
        ([], "messages is empty"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\] must be a dict"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
    ],
)
def test_bad_messages_are_rejected_naming_the_message(messages, message) -> None:
    with pytest.raises(TokenizerError, match=message):
        render_chat_template("{{ messages }}", messages, add_generation_prompt=False)


@given(reason=text)
def test_raise_exception_raises_chat_template_error_with_the_templates_message(reason) -> None:
    template = "{{ raise_exception(messages[0].content) }}"
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, [{"role": "user", "content": reason}],
                             add_generation_prompt=False)
    assert str(info.value) == reason


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ 1 + }}", "{% endif %}"])
def test_invalid_jinja_is_a_chat_template_error(template) -> None:
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        render_chat_template(template, [{"role": "user"}], add_generation_prompt=False)


def test_the_sandbox_refuses_to_mutate_the_callers_data() -> None:
    """The environment is immutable: a template cannot append to a list it is given."""
    messages = [{"role": "user", "content": "x"}]
    tools = [{"name": "t"}]
    with pytest.raises(ChatTemplateError, match="append") as info:
        render_chat_template("{{ tools.append(1) }}", messages, add_generation_prompt=False,
                             tools=tools)
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)
    assert tools == [{"name": "t"}]


@pytest.mark.parametrize(
    ("template", "cause"),
    [("{{ messag - 1 }}", jinja2.UndefinedError), ("{{ 1 // 0 }}", ZeroDivisionError),
     ("{{ 'a' + 1 }}", TypeError), ("{{ messages[5] + 1 }}", jinja2.UndefinedError)],
)
def test_a_template_failing_as_it_renders_is_a_chat_template_error(template, cause) -> None:
    with pytest.raises(ChatTemplateError, match="failed to render") as info:
        render_chat_template(template, [{"role": "user"}], add_generation_prompt=False)
    assert isinstance(info.value.__cause__, cause)


@given(
    names=st.lists(st.sampled_from(["default", "tool_use", "rag", None]), max_size=4),
    templates=st.lists(text, min_size=4, max_size=4),
)
def test_template_from_config_picks_the_default_else_the_first(names, templates) -> None:
    value = [{"name": n, "template": t} for n, t in zip(names, templates, strict=False)]
    named: dict = {}
    for n, t in zip(names, templates, strict=False):
        named[n] = t  # a later entry of the same name wins, as a dict literal would
    if "default" in named:
        assert template_from_config(value) == named["default"]
    elif named:
        assert template_from_config(value) == next(iter(named.values()))
    else:
        assert template_from_config(value) is None


@given(value=text | st.none())
def test_template_from_config_keeps_a_string_or_none(value) -> None:
    assert template_from_config(value) == value


@pytest.mark.parametrize("value", [3, {"template": "x"}, 1.5, ("a",)])
def test_template_from_config_rejects_other_types_naming_the_type(value) -> None:
    with pytest.raises(TokenizerError, match=f"chat_template must be .*{type(value).__name__}"):
        template_from_config(value)
