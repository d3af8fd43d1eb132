"""OpenAI tool calling over Hermes-style `<tool_call>` JSON, which Qwen3 (and Hermes, Qwen2.5)
write: the tools go into the system prompt in that format, the answer is parsed back into
`tool_calls`, whole or as a stream of deltas.

tool_choice decides how: "none" leaves the text alone; "auto" parses whatever `<tool_call>`
blocks the model writes; "required" and a named function constrain the output by grammar
(a JSON array of calls, or the named function's arguments), so it always parses. Under
"auto", a tool marked `"strict": true` (OpenAI's function.strict) has its calls constrained
too: the text stays free until the model opens `<tool_call>`, and from there the call must
name a known tool and give a strict tool arguments its schema allows (a structural tag,
protocol.structural_tags); with parallel_tool_calls false the answer ends after one call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend.structured.markers import partial_suffix
from protocol.outcomes import FieldError
from protocol.structured_outputs import (
    StructuredOutputs,
    StructuredOutputsError,
    build_grammar,
    check_compiles,
    short_error,
)

START, END = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


class ToolsError(FieldError):
    """Bad `tools` or `tool_choice`; `field` names which."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}",
                                "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean for its output."""

    mode: str
    """none | auto | required | named."""
    tools: list[dict[str, Any]]
    name: str | None = None
    """The function a named tool_choice forces."""
    parallel: bool = True
    """OpenAI's parallel_tool_calls: False allows one call at most."""
    strict: tuple[str, ...] = ()
    """The tools marked strict, whose calls under "auto" must match their parameters."""

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> dict[str, Any] | None:
        """The constraint of required / named (vLLM's structured_outputs spelling)."""
        if self.mode == "required":
            calls = [{"type": "object", "properties": {
                "name": {"const": t["name"]}, "arguments": _parameters(t)},
                "required": ["name", "arguments"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1,
                      "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json": schema}
        if self.mode == "named":
            tool = next(t for t in self.tools if t["name"] == self.name)
            return {"json": _parameters(tool)}
        if self.mode == "auto" and self.strict:
            return {"structural_tag": self._call_tags()}
        return None

    def _call_tags(self) -> dict[str, Any]:
        """Free text, and calls as the Hermes format writes them: `<tool_call>`, the JSON of
        name and arguments (spelled as render_tool_calls spells it), `</tool_call>`."""
        tags = [{"type": "tag",
                 "begin": f'{START}\n{{"name": {json.dumps(t["name"])}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": (
                     _parameters(t) if t["name"] in self.strict else {"type": "object"})},
                 "end": f"}}\n{END}"} for t in self.tools]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [START], "tags": tags,
            "stop_after_first": not self.parallel}}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in calls]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                return text, []
        if self.mode == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.mode == "auto":
            return parse_hermes(text)
        return text, []


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool.get("parameters") or {"type": "object", "properties": {}})


def tool_plan(tools: Any, tool_choice: Any, parallel: bool | None = None) -> ToolPlan | None:
    """Check OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; None when the request
    has no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolsError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolsError("tools", f"tools must be a list of at most {MAX_TOOLS} functions")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolsError("tools", "tools: function names must be unique")
    strict = tuple(f["name"] for f, t in zip(functions, tools, strict=True)
                   if t["function"].get("strict") is True)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tool_choice or "auto", functions, parallel=parallel is not False,
                        strict=strict)
    name = None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise ToolsError("tool_choice", "tool_choice must be none, auto, required or "
                                        '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise ToolsError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolPlan("named", functions, name, parallel=False)


def _function(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ToolsError("tools", f"{where} must be {{\"type\": \"function\", \"function\": "
                                  "{...}}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolsError("tools", f"{where}.function must have a name")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ToolsError("tools", f"{where}.function.parameters must be a JSON schema object")
    if fn.get("strict") not in (None, True, False):
        raise ToolsError("tools", f"{where}.function.strict must be true or false")
    if params is not None:  # whatever tool_choice is: a call the model writes is parsed by it
        spec = StructuredOutputs("json", json.dumps(params))
        try:
            if fn.get("strict"):  # a schema it could not hold to would break the promise
                check_compiles(spec, f"{where}.function.parameters")
            else:
                build_grammar(spec)
        except StructuredOutputsError as exc:
            raise ToolsError("tools", str(exc).replace(
                f"{where}.function.parameters.json", f"{where}.function.parameters")) from None
        except Exception as exc:  # noqa: BLE001 - xgrammar raises kinds of its own
            raise ToolsError("tools", f"{where}.function.parameters cannot be compiled: "
                                      f"{short_error(exc)}") from None
    out = {"name": fn["name"], "description": str(fn.get("description") or "")}
    if params is not None:
        out["parameters"] = dict(params)
    return out


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools in the Hermes format (Qwen3's template writes the same words)."""
    lines = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """Messages (role/content dicts) with the tools' prompt in the system message."""
    prompt = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_tool_calls(calls: list[Mapping[str, Any]]) -> str:
    """An assistant turn's OpenAI tool_calls as the text the model would have written."""
    blocks = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        blocks.append(f"{START}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}"
                      f"\n{END}")
    return "\n".join(blocks)


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before/around the calls, calls) of a whole answer; a block that does not
    parse stays in the content."""
    stream = HermesStream()
    content, calls = stream.feed(text)
    tail, more = stream.finish()
    content += tail
    calls += more
    return (content if content.strip() or not calls else None), calls


class HermesStream:
    """Splits streamed text into content and complete tool calls. Text that may be the start
    of `<tool_call>` is held back until it is known not to be."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._inside:
                at = self._buffer.find(START)
                if at < 0:
                    keep = partial_suffix(self._buffer, START)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(START):]
                self._inside = True
            end = self._buffer.find(END)
            if end < 0:
                break
            block, self._buffer = self._buffer[:end], self._buffer[end + len(END):]
            self._inside = False
            call = _call(block.strip())
            if call is None:
                content.append(f"{START}{block}{END}")
            else:
                calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: an unclosed block is a call if it parses (a model may stop at EOS
        before writing `</tool_call>`), else content."""
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            call = _call(rest.strip())
            return ("", [call]) if call is not None else (START + rest, [])
        return rest, []
