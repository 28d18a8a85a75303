"""Tool calls (OpenAI's ``tools`` and ``tool_choice``), as a grammar over the answer and a reading of it.

How an answer writes its calls:
- a named function (``tool_choice: {"type": "function", "function": {"name": ...}}``): the answer is the call's
  arguments, a JSON object under the function's parameters schema;
- ``required``: the answer is a JSON list of calls, ``{"name": ..., "arguments": {...}}`` each, one at least (one at
  most without ``parallel_tool_calls``), each under its function's schema;
- ``auto``: as the model's chat template writes calls, where specdec knows the format (Qwen2.5's and Hermes'
  ``<tool_call>`` JSON ``</tool_call>``): either text, or calls, each constrained to its function's schema once
  it opens. A template without a tool-call format is refused for ``auto`` (400): ask ``required`` or a function;
- ``none``: no grammar, and the template is not shown the tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdec.grammars import JSON_LAYOUT, GrammarSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # Qwen2.5's and Hermes' format


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be served: the message, and the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's function tools, and how its answer calls them."""

    tools: tuple[dict, ...]  # each {"name", "description", "parameters"}
    choice: str  # "auto", "required", or a function's name
    parallel: bool = True

    @property
    def named(self) -> bool:
        return self.choice not in ("auto", "required")

    def schema_of(self, name: str) -> dict:
        return next(tool for tool in self.tools if tool["name"] == name).get("parameters") or {"type": "object"}

    def call_schema(self) -> dict:
        """One call: a function's name and its arguments under that function's schema."""
        options = [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                                    "arguments": self.schema_of(tool["name"])},
                    "required": ["name", "arguments"], "additionalProperties": False} for tool in self.tools]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self) -> GrammarSpec:
        if self.named:
            return GrammarSpec.json_schema(self.schema_of(self.choice))
        if self.choice == "required":
            calls = {"type": "array", "items": self.call_schema(), "minItems": 1}
            return GrammarSpec.json_schema(calls | ({} if self.parallel else {"maxItems": 1}))
        call = '"<tool_call>\\n" %json ' + json.dumps(self.call_schema() | {"x-guidance": JSON_LAYOUT}) + \
            ' "\\n</tool_call>"'
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        # text that does not open a call, or calls and nothing else
        lark = f'start: TEXT | calls\ncalls: {calls}\ncall: {call}\nTEXT: /([^<]|<[^t])(.|\\n)*/\n'
        return GrammarSpec("grammar", lark)

    def in_text(self, answer: str) -> bool:
        """Whether an answer that begins with ``answer`` is text, not calls: under ``auto``, known from its first
        characters (a call opens with "<t"; the grammar lets text open with anything else); never otherwise."""
        if self.choice != "auto":
            return False
        return bool(answer) and answer[0] != "<" or len(answer) > 1 and answer[1] != "t"

    def calls(self, text: str) -> list[dict] | None:
        """The answer's calls, as OpenAI's ``message.tool_calls``; None where it answered in text."""
        if self.named:
            found = [(self.choice, text)]
        elif self.choice == "required":
            found = [(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in _json(text)]
        elif text.startswith(CALL_OPEN):
            blocks = [block.strip() for block in text.split(CALL_CLOSE) if block.strip()]
            found = [(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
                     for call in (_json(block.removeprefix(CALL_OPEN.strip()).strip()) for block in blocks)]
        else:
            return None
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": arguments}} for name, arguments in found]


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as error:  # a call cut short (max_tokens): its text is kept, unread
        raise ToolError(f"the answer's tool call is incomplete: {error}", "max_tokens") from None


def tool_calling(tools: list[dict] | None, tool_choice, parallel: bool | None, template: str | None
                 ) -> ToolCalling | None:
    """The request's tool calling, or None (no tools, or tool_choice none); ToolError where it cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters")
        functions.append({"name": function["name"], "description": function.get("description", ""),
                          **({"parameters": parameters} if parameters is not None else {})})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("two tools have the same name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if isinstance(choice, dict):
        choice = choice["function"]["name"]
        if choice not in names:
            raise ToolError(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})",
                            "tool_choice")
    if choice == "auto" and (template is None or CALL_OPEN.strip() not in template):
        raise ToolError("this model's chat template has no tool-call format specdec knows, so tool_choice auto "
                        "cannot tell a call from text: ask tool_choice required or a named function", "tool_choice")
    return ToolCalling(tuple(functions), choice, True if parallel is None else parallel)


def template_tools(calling: ToolCalling | None) -> list[dict] | None:
    """The tools as chat templates read them (transformers' convention), or None."""
    if calling is None:
        return None
    return [{"type": "function", "function": tool} for tool in calling.tools]
