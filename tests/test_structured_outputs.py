"""response_format and tool calls over HTTP, driven by the openai client: outputs follow their schemas, streamed
tool calls reassemble to the whole message, tool results render through the template, and every bad input gets a
400 naming its field while a bystander stream runs on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pydantic
import pytest

from server.schemas import ChatRequest
from server.tools import ToolCallParser, split_calls, template_input
from specdec_core.grammar import Grammars
from specdec_core.models.tiny import tiny_tokenizer

from .test_server import MODEL, NO_EOS, Served, error_of, make_config, running, sample

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with running(make_config(speculation={"gamma": 2, "drafter": "suffix"})) as served:
        yield served


def chat(served: Served, **fields) -> dict:
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK} | fields, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("seed", range(4))
def test_a_json_schema_response_is_valid_and_the_stream_says_the_same(served, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = served.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=120,
                                                  temperature=0.9, seed=seed)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    stream = served.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=120,
                                                   temperature=0.9, seed=seed, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == whole.choices[0].message.content
    usage = whole.usage.model_extra["speculative"]
    assert usage["grammar_draft_tokens"] >= usage["grammar_accepted_tokens"] > 0


def test_json_object_on_completions_is_an_object(served):
    for seed in range(3):
        response = served.client.completions.create(model=MODEL, prompt="x", max_tokens=120, temperature=0.9, seed=seed,
                                                    extra_body={"response_format": {"type": "json_object"}})
        if response.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(response.choices[0].text), dict)


def test_the_openai_sdk_parses_into_a_pydantic_model(served):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)

    completion = served.client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=120, seed=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_carries_valid_arguments_and_streams_the_same(served, choice):
    fields = dict(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=120, seed=3)
    whole = chat(served, **fields)["choices"][0]
    calls = whole["message"]["tool_calls"]
    assert whole["finish_reason"] == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_")
    function = calls[0]["function"]
    if choice != "required":
        assert function["name"] == "get_weather"
    tool = {"get_weather": WEATHER, "get_time": TIME}[function["name"]]
    jsonschema.validate(json.loads(function["arguments"]), tool["function"]["parameters"])
    streamed = served.client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **fields)
    content, deltas, reasons = "", [], []
    for chunk in streamed:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and (content or None) == whole["message"]["content"]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == [(0, "function", function["name"], function["arguments"])]


def test_a_tool_round_trip_renders_the_call_and_its_result(served):
    first = chat(served, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=5)
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    messages = [*ASK, message, {"role": "tool", "tool_call_id": call["id"], "content": '{"celsius": 21}'}]
    answer = chat(served, messages=messages, tools=[WEATHER], max_tokens=8, logit_bias=NO_EOS)
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]


def test_tool_choice_none_leaves_the_text_alone(served):
    response = chat(served, tools=[WEATHER], tool_choice="none", max_tokens=6, logit_bias=NO_EOS, seed=1)
    plain = chat(served, max_tokens=6, logit_bias=NO_EOS, seed=1)
    assert response["choices"][0]["message"] == plain["choices"][0]["message"]


# -- bad input: a 400 naming the field, and a bystander stream runs on ------------------------------------------------

BAD = {
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}}}},
    "tools": {"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]},
    "tool_choice": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
}
BAD_SCHEMAS = {
    "invalid schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
                       "response_format", "not a valid JSON Schema"),
    "unsupported keyword": (BAD["response_format"], "response_format", "oneOf"),
    "tool without a name": (BAD["tools"], "tools", "tools[0].function.name"),
    "tool_choice naming no tool": (BAD["tool_choice"], "tool_choice", "launch"),
    "tool parameters unsupported": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "color"}}}}}], "tool_choice": "required"},
        "tools", "tools[0].function.parameters.properties.x.format"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "schema with tools": ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    "a schema name": ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}},
                      "response_format", "json_schema.name"),
    "tool message without its call id": ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    "arguments that are not JSON": ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "not JSON"),
}


def test_every_bad_input_is_a_400_naming_its_field_and_a_bystander_stream_survives(served):
    chunks = []
    bystander = threading.Thread(target=lambda: chunks.extend(
        chunk.choices[0] for chunk in served.client.completions.create(
            model=MODEL, prompt="x", max_tokens=60, logit_bias=NO_EOS, stream=True) if chunk.choices))
    bystander.start()
    for name, (fields, param, words) in BAD_SCHEMAS.items():
        response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK} | fields)
        error = error_of(response)
        assert response.status_code == 400 and error["param"] == param and words in error["message"], (name, error)
    bystander.join()
    assert chunks[-1].finish_reason == "length" and len(chunks) == 60 + 1  # a chunk a token, then the closing one


def test_a_schema_past_the_compile_limit_is_a_400(monkeypatch):
    compile_slowly = Grammars._run
    monkeypatch.setattr(Grammars, "_run", lambda self, spec, future: (time.sleep(1.0), compile_slowly(self, spec, future)))
    with running(make_config(grammar={"compile_timeout_s": 0.05})) as served:
        response = httpx.post(f"{served.url}/v1/chat/completions", json={
            "model": MODEL, "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
        assert response.status_code == 400 and "compile_timeout_s" in error_of(response)["message"]


def test_grammar_metrics_are_exported(served):
    chat(served, response_format={"type": "json_object"}, max_tokens=40, seed=2)
    metrics = served.metrics()
    assert sample(metrics, "specdec_grammar_compile_seconds_count") >= 1
    assert sample(metrics, "specdec_grammar_mask_seconds_count") >= 1
    assert sample(metrics, "specdec_grammar_draft_tokens_total") >= sample(metrics, "specdec_grammar_accepted_tokens_total") > 0


# -- parsing and rendering, without a server -----------------------------------------------------------------------------

CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("piece", [1, 3, 7, len(CALLS)])
def test_streamed_calls_reassemble_to_the_whole_messages(piece):
    parser, content, calls = ToolCallParser(), "", []
    for start in range(0, len(CALLS), piece):
        more, done = parser.feed(CALLS[start : start + piece])
        content, calls = content + more, calls + done
    content += parser.finish()
    whole_content, whole_calls = split_calls(CALLS)
    assert content == whole_content == "Checking."
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(whole_calls)]
    assert [json.loads(c["function"]["arguments"]) for c in whole_calls] == [{"city": "Paris", "unit": "C"}, {"zone": "CET"}]


@pytest.mark.parametrize("text", ["a < b <tool_c", "no calls\n\n", '<tool_call>\n{"name": "f", "argu', "<tool_call>{bad}</tool_call>"])
def test_text_that_is_not_a_whole_call_stays_content(text):
    assert split_calls(text) == (text, [])


HERMES_TEMPLATE = (  # the shape of Qwen2.5's: tools listed in the system turn, calls and results in hermes blocks
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
)
ROUND_TRIP = {"model": MODEL, "tools": [WEATHER], "messages": [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]}


@pytest.mark.parametrize("template", ["takes tools", "without tools"])
def test_tool_calls_and_results_render_through_the_template(template):
    tokenizer = tiny_tokenizer()
    if template == "takes tools":
        tokenizer.chat_template = HERMES_TEMPLATE
    messages, tools = template_input(ChatRequest.model_validate(ROUND_TRIP), tokenizer.chat_template)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert '"description": "The weather in a city"' in text


def test_the_api_pages_structured_output_and_tool_examples_run(served):
    """docs/API.md's example, as printed, against this server's model (random weights: what it prints is noise)."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    section = readme[readme.index("## Structured outputs and tool calls"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[: code.index("```")]
    namespace = {"client": served.client, "model": MODEL}
    exec(compile(code, "docs/API.md", "exec"), namespace)
    assert namespace["call"].choices[0].message.tool_calls and namespace["answer"].choices[0].message.content is not None
