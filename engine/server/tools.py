"""Tool calling on /v1/chat/completions (issue 31 item 2): the request's tools, tool_choice
and parallel_tool_calls become a plan; the answer's text becomes tool_calls.

- `none`: tools are rendered into the prompt (the model may know of them), the answer is
  content.
- `required` / a named function: the grammar forces the answer (vLLM's way, so any model,
  even a random one, returns valid arguments): required -> a JSON array of
  {"name", "parameters"} objects, one of the tools each (one at most without
  parallel_tool_calls); named -> that function's arguments object.
- `auto` (OpenAI's default when tools are given): the model decides; the server's
  --tool-call-parser reads its calls out of the text (hermes: `<tool_call>{json}</tool_call>`
  blocks, Qwen2.5/Qwen3; llama3_json: `{"name": ..., "parameters": ...}` objects, Llama 3.x).
  Without a parser (--enable-auto-tool-choice --tool-call-parser) `auto` is a 400 naming it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.protocol import StructuredOutput
from engine.server.errors import APIError
from engine.server.json_scan import Memo, elements, members, skip_ws, value_end

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none, auto, required, named
    tools: list[dict[str, Any]]  # as rendered by the chat template
    named: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def structured(self) -> StructuredOutput | None:
        """The grammar that enforces `required` / a named function (None otherwise)."""
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(_parameters(self.tools, self.named)))
        if self.mode != "required":
            return None
        one_of = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": _parameters(self.tools, t["function"]["name"])},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema))

    @property
    def parses(self) -> bool:
        """Whether the answer's text is read as tool calls (else it is content)."""
        return self.mode in ("required", "named") or (self.mode == "auto" and bool(self.parser))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer. Text that is not a call stays content.
        A call's arguments are the answer's own text of them (as streamed, see ToolStream)."""
        if self.mode == "named":
            return None, [ToolCall(self.named or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                ok = isinstance(items, list) and all(
                    isinstance(i["name"], str) and "parameters" in i for i in items)
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                ok = False
            calls = _finished(self.begun(text)) if ok else None
            return (None, calls) if calls and len(calls) == len(items) else (text, [])
        if self.parser == "hermes":
            return _parse_hermes(text, self.begun(text))
        if self.parser == "llama3_json":
            return _parse_llama3(text, self.begun(text))
        return text, []

    def begun(self, text: str, memo: Memo | None = None) -> list[Begun]:
        """The calls an answer has begun so far, in order (the text may still grow; `memo`
        is json_scan's, kept while it does)."""
        if self.mode == "named":
            return [Begun(self.named, text, False)]
        if self.mode == "required":
            i = skip_ws(text, 0)
            starts = elements(text, i, memo) if text[i:i + 1] == "[" else []
            return _begun_list(text, starts, "parameters", memo)
        starts = []
        if self.parser == "hermes":
            pos = 0
            while (k := text.find("<tool_call>", pos)) >= 0:
                starts.append(skip_ws(text, k + len("<tool_call>")))
                end = value_end(text, starts[-1], memo)
                if end is None:
                    break
                pos = end
            return _begun_list(text, starts, "arguments", memo)
        if self.parser == "llama3_json":
            i = skip_ws(text, 0)
            if text.startswith("<|python_tag|>", i):
                i = skip_ws(text, i + len("<|python_tag|>"))
            while text[i:i + 1] == "{":
                starts.append(i)
                end = value_end(text, i, memo)
                if end is None:
                    break
                i = end
                while i < len(text) and text[i] in "; \n\t":
                    i += 1
            return _begun_list(text, starts, "parameters", memo)
        return []


@dataclass(frozen=True)
class Begun:
    """A call as far as the answer's text goes: its name once the name's string is closed,
    its arguments' text so far (an object or array grows; a scalar comes whole), and
    whether the arguments are complete."""

    name: str | None
    arguments: str
    done: bool


def _begun_at(text: str, start: int, key: str, memo: Memo | None) -> Begun | None:
    if text[start:start + 1] != "{":
        return None
    found = members(text, start, memo)
    name = None
    if "name" in found and found["name"][1] is not None:
        a, b = found["name"]
        try:
            value = json.loads(text[a:b])
        except ValueError:
            value = None
        name = value if isinstance(value, str) else None
    span = found.get(key, found.get("arguments"))
    if span is None:
        return Begun(name, "", False)
    a, b = span
    if text[a] in "{[":
        return Begun(name, text[a:len(text) if b is None else b], b is not None)
    if b is None:
        return Begun(name, "", False)
    try:
        value = json.loads(text[a:b])
    except ValueError:
        return Begun(name, "", False)
    return Begun(name, value if isinstance(value, str) else text[a:b], True)


def _begun_list(text: str, starts: list[int], key: str, memo: Memo | None = None
                ) -> list[Begun]:
    out = []
    for start in starts:
        b = _begun_at(text, start, key, memo)
        if b is None:
            break
        out.append(b)
    return out


def _finished(begun: list[Begun]) -> list[ToolCall] | None:
    """The calls of a finished answer (a call without arguments has {}); None if one has no
    name."""
    if any(b.name is None for b in begun):
        return None
    return [ToolCall(b.name or "", b.arguments if b.done else "{}") for b in begun]


def _parameters(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"].get("parameters") or {"type": "object"}
    raise APIError(f"tool_choice names {name!r}, which is not among the tools",
                   param="tool_choice")


def _named(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


def _parse_hermes(text: str, begun: list[Begun]) -> tuple[str | None, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    blocks = _HERMES.findall(text)
    for block in blocks:
        try:
            if not _named(json.loads(block)):
                return text, []
        except ValueError:
            return text, []  # a malformed block: the text is the answer, unparsed
    calls = _finished(begun)
    if not calls or len(calls) != len(blocks):
        return text, []
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def _parse_llama3(text: str, begun: list[Begun]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    count = 0
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        if not _named(obj):
            return text, []
        count += 1
        pos = end
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    calls = _finished(begun)
    return (None, calls) if calls and len(calls) == count else (text, [])


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
              parser: str | None) -> ToolPlan | None:
    """The request's plan (None: no tools). Malformed tools or choices are a 400 naming them."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(fn, dict) or t.get("type", "function") != "function"
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise APIError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}",
                           param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools must have distinct function names", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    clean = [{"type": "function", "function": t["function"]} for t in tools]
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise APIError(f"tool_choice names a function that is not among the tools: "
                           f"{name!r}", param="tool_choice")
        return ToolPlan("named", clean, named=name, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise APIError("tool_choice must be none, auto, required or "
                       "{type: function, function: {name}}", param="tool_choice")
    if choice == "auto" and parser is None:
        raise APIError("tool_choice auto needs a server started with --enable-auto-tool-choice "
                       "--tool-call-parser (hermes or llama3_json); send tool_choice required, "
                       "a named function or none", param="tool_choice")
    return ToolPlan(choice, clean, parallel=parallel, parser=parser)


def history_message(m: Any) -> dict[str, Any]:
    """A request message as the chat template reads it: an assistant's tool_calls with their
    arguments as objects (templates print them with tojson), a tool result's id."""
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for i, c in enumerate(m.tool_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError("an assistant message's tool_calls need function.name",
                               param=f"messages.tool_calls.{i}")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError as exc:
                raise APIError(f"tool_calls[{i}].function.arguments is not JSON: {exc}",
                               param=f"messages.tool_calls.{i}") from exc
            calls.append({"id": c.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        d["tool_calls"] = calls
    return d


def with_tool_grammar(params: Any, plan: ToolPlan | None) -> Any:
    """`params` with the grammar `required` / a named function needs (one grammar only)."""
    import msgspec

    grammar = None if plan is None else plan.structured
    if grammar is None:
        return params
    if params.structured is not None:
        raise APIError(f"tool_choice {plan.mode} and a structured output (response_format, "
                       "guided_*) exclude each other", param="tool_choice")
    return msgspec.structs.replace(params, structured=grammar)


def answer(plan: ToolPlan | None, text: str, finish_reason: str | None
           ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """(content, tool_calls, finish_reason) of one finished choice."""
    if plan is None or not plan.parses:
        return text, None, finish_reason
    content, calls = plan.parse(text)
    if not calls:
        return content, None, finish_reason
    if finish_reason == "stop" and plan.mode != "named":  # OpenAI: named calls end in stop
        finish_reason = "tool_calls"
    return content, [c.to_openai() for c in calls], finish_reason


class ToolStream:
    """Per choice of a streamed answer, as OpenAI streams it: content deltas as they come until
    the text may be a call; then per call one delta with index, id, type and name (arguments
    "") as soon as the name is generated, and the arguments in fragments as their JSON grows
    (vLLM's hermes / llama3_json streaming). The fragments join to the arguments of the same
    answer unstreamed. A call cut short (max_tokens) stays as far as it was streamed."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text: dict[int, str] = {}
        self.sent: dict[int, int] = {}  # characters already sent as content
        self.calls: dict[int, list[list[Any]]] = {}  # per choice: [name, arguments sent]
        self.memo: dict[int, Memo] = {}  # per choice: json_scan's, as its text grows

    def _streamable(self, text: str) -> int:
        """How much of `text` is surely content (not the start of a call)."""
        if self.plan.mode in ("required", "named"):
            return 0
        if self.plan.parser == "llama3_json":
            head = text.lstrip()
            if not head or head[0] in "{<":
                return 0
            return len(text)
        cut = text.find("<tool_call>")
        if cut >= 0:
            return cut
        for k in range(len("<tool_call>") - 1, 0, -1):  # a marker may be starting
            if text.endswith("<tool_call>"[:k]):
                return len(text) - k
        return len(text)

    def _advance(self, index: int, calls: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
        """Deltas that bring the client's calls up to `calls` (name, arguments so far)."""
        headed = self.calls.setdefault(index, [])
        out: list[dict[str, Any]] = []
        for i, (name, arguments) in enumerate(calls):
            if name is None:
                break  # calls head in order
            if i == len(headed):
                headed.append([name, ""])
                out.append({"tool_calls": [{
                    "index": i, "id": f"call_{secrets.token_hex(12)}", "type": "function",
                    "function": {"name": name, "arguments": ""}}]})
            sent = headed[i][1]
            if headed[i][0] == name and len(arguments) > len(sent) \
                    and arguments.startswith(sent):
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": arguments[len(sent):]}}]})
                headed[i][1] = arguments
        return out

    def deltas(self, index: int, new_text: str, finish_reason: str | None
               ) -> tuple[list[dict[str, Any]], str | None]:
        """(delta messages to send, finish_reason) for a choice's new text."""
        text = self.text[index] = self.text.get(index, "") + new_text
        sent = self.sent.get(index, 0)
        out: list[dict[str, Any]] = []
        if finish_reason is None:
            upto = max(sent, self._streamable(text))
            if upto > sent:
                out.append({"content": text[sent:upto]})
                self.sent[index] = upto
            return out + self._advance(index, [(b.name, b.arguments) for b in self.plan.begun(
                text, self.memo.setdefault(index, {}))]), None
        content, calls, finish = answer(self.plan, text, finish_reason)
        if not calls:
            rest = text[sent:]
            if self.calls.get(index):  # cut short inside a call: it stays as streamed
                return self._advance(index, [
                    (b.name, b.arguments) for b in self.plan.begun(text)]), finish
            return ([{"content": rest}] if rest else []), finish
        if content and len(content) > sent and content.startswith(text[:sent]):
            out.append({"content": content[sent:]})
        return out + self._advance(index, [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]), finish
