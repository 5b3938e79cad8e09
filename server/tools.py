"""Structured outputs and tool calls at the API: the grammar a request asks for, the tools as the model's
chat template shows them, and the calls parsed back out of the text, whole or as a stream.

Tool calls follow the model family's format (`GrammarConfig.tool_format`, else the registry entry's). hermes is
the one the registry's models take: the template lists the tools and the model answers with
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5's template). A template that
does not take tools (SmolLM2's) gets them described in the same words in the system message, its tool calls
written as those blocks and tool results as `<tool_response>` user turns, as llama.cpp's server does for
templates without tools. xgrammar's structural tag for the format keeps every call well formed and its arguments
valid against the function's schema: after a call's opening under `auto`, from the first token under `required`
or a named function.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import xgrammar as xgr

from specdec_core.grammar import GrammarError, GrammarSpec, check_schema

from .schemas import APIError, ChatMessage, ChatRequest, NamedToolChoice, SamplingRequest

# Our name for a format, and xgrammar's for its structural tag (Qwen3's is Qwen2.5's and Hermes').
XGRAMMAR_FORMATS = {"hermes": "qwen_3"}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def response_grammar(body: SamplingRequest) -> GrammarSpec | None:
    """The grammar response_format asks for (json_object: any JSON object), checked; None for text."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object"}))
    schema = fmt.json_schema.json_schema
    _checked(schema, "response_format.json_schema.schema")
    return GrammarSpec("json_schema", json.dumps(schema))


def tool_grammar(body: ChatRequest, tool_format: str) -> GrammarSpec | None:
    """The structural tag of the request's tools under its tool_choice; None where the model may not call them."""
    check_tools(body)
    if not body.calls_tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        parameters = tool.function.parameters
        if parameters is not None:
            _checked(parameters, f"tools[{i}].function.parameters")
        tools.append({"type": "function", "function": {"name": tool.function.name, "parameters": parameters}})
    choice = body.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    try:
        tag = xgr.get_model_structural_tag(XGRAMMAR_FORMATS[tool_format], tools=tools, tool_choice=choice,
                                           reasoning="disabled", parallel_tool_calls=body.parallel_tool_calls,
                                           max_whitespace_cnt=1)
    except ValueError as exc:  # what xgrammar finds wrong with the tools
        raise APIError(400, f"tools cannot be made into a grammar: {exc}", param="tools") from None
    return GrammarSpec("structural_tag", tag.model_dump_json())


def check_tools(body: ChatRequest) -> None:
    """400s for tools that do not fit together, each naming its field."""
    names = [tool.function.name for tool in body.tools or []]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: two tools have the same function name; give each its own", param="tools")
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among tools "
                            f"({', '.join(names) or 'none given'})", param="tool_choice")
    if choice == "required" and not names:
        raise APIError(400, "tool_choice required needs tools: list the functions the model may call", param="tool_choice")
    if body.calls_tools and body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with tools the model may call; send one, or "
                            "tool_choice none", param="response_format")


def _checked(schema: dict, field: str) -> None:
    try:
        check_schema(schema, field)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=field.split(".")[0].split("[")[0]) from None


def template_input(body: ChatRequest, template: str) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to render with the chat template. Tools are left out under tool_choice none; a
    template that does not take tools gets them (and the conversation's calls and results) in hermes' words."""
    messages = [message.as_template_input() for message in body.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.calls_tools else None
    if "tools" in template:
        return messages, tools
    messages = [_plain(message, original) for message, original in zip(messages, body.messages)]
    if tools:
        described = HERMES_TOOLS.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if messages[0]["role"] == "system":
            messages[0] = messages[0] | {"content": messages[0]["content"] + "\n\n" + described}
        else:
            messages.insert(0, {"role": "system", "content": described})
    return messages, None


def _plain(message: dict, original: ChatMessage) -> dict:
    """A message for a template without tools: calls as hermes blocks, a tool's result as a user turn."""
    if original.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{original.text}\n</tool_response>"}
    if original.tool_calls:
        calls = [f'{CALL_OPEN}\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n{CALL_CLOSE}'
                 for call in original.tool_calls]
        return {"role": "assistant", "content": "\n".join(filter(None, [original.text, *calls]))}
    return message


@dataclass
class ToolCallParser:
    """Splits a choice's text into content and tool calls as it arrives. Text that may open a call is held back
    until it does or cannot, and whitespace until something other than a call follows it."""

    calls: int = 0  # calls parsed so far
    _held: str = ""  # the text of an opening or a call not yet closed
    _inside: bool = False
    _blank: str = ""  # whitespace not yet given out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the whole calls that `text` completes."""
        self._held += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    return content, calls
                body, self._held, self._inside = self._held[:end], self._held[end + len(CALL_CLOSE):], False
                call = _call(body)
                if call is None:  # not a call after all: its text is content
                    content += self._content(CALL_OPEN + body + CALL_CLOSE)
                else:
                    calls.append(call | {"index": self.calls})
                    self.calls += 1
                continue
            start = self._held.find(CALL_OPEN)
            if start < 0:
                keep = _opening_suffix(self._held)
                content += self._content(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                return content, calls
            content += self._content(self._held[:start])
            self._blank = ""  # whitespace before a call is not content
            self._held, self._inside = self._held[start + len(CALL_OPEN):], True

    def finish(self) -> str:
        """What is left once the choice has ended: an unfinished call's text is content, and so is the whitespace
        at the end, unless the choice made calls."""
        left = self._blank + (CALL_OPEN if self._inside else "") + self._held
        self._blank = self._held = ""
        self._inside = False
        return left if left.strip() or not self.calls else ""

    def _content(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self._blank += text
            return ""
        out, self._blank = self._blank + body, text[len(body):]
        return out


def _opening_suffix(text: str) -> int:
    """The length of text's longest suffix that begins CALL_OPEN (which may yet become a call)."""
    for length in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def _call(body: str) -> dict | None:
    """An OpenAI tool call from a hermes block's JSON; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("arguments", {}), dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value.get("arguments", {}))}}


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole choice's content (None when only calls) and its calls."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content += parser.finish()
    return (content or None) if calls else content, [_without_index(call) for call in calls]


def _without_index(call: dict) -> dict:
    return {key: value for key, value in call.items() if key != "index"}

