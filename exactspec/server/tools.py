"""Tool calls (OpenAI's ``tools`` and ``tool_choice``), as a grammar over the answer and a reading of it.

How an answer writes its calls:
- a named function (``tool_choice: {"type": "function", "function": {"name": ...}}``): the answer is that one call
  as the chat template writes calls, where exactspec knows its format (``CALL_FORMATS``): its opening through the
  arguments' key forced (``<tool_call>\n{"name": "Person", "arguments": `` on Qwen2.5's), then the arguments under
  the function's parameters schema, then the closing. That is how the model was trained to call: asked for the
  arguments object alone, Qwen2.5-Coder-1.5B put the function's name in a ``name`` argument (instructor's TOOLS
  mode, right on 2 of 5 extractions; 5 of 5 with the opening). On a template without a known format the answer is
  the arguments object alone;
- ``required``: the answer is a JSON list of calls, ``{"name": ..., "arguments": {...}}`` each, one at least (one at
  most without ``parallel_tool_calls``), each under its function's schema;
- ``auto``: as the model's chat template writes calls, where exactspec knows the format (``CALL_FORMATS``: Qwen2.5's
  and Hermes' ``<tool_call>`` JSON ``</tool_call>``, Llama 3.1-3.3's bare JSON with ``parameters``): either text,
  or calls, each constrained to its function's schema once it opens. A template without a tool-call format is
  refused for ``auto`` (400): ask ``required`` or a function;
- ``none``: no grammar, and the template is not shown the tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from exactspec.grammars import JSON_LAYOUT, GrammarSpec


@dataclass(frozen=True)
class CallFormat:
    """How a chat template has the model write tool calls (for ``auto`` and a named function): each call is
    ``opens``, then a JSON object of the function's ``name`` and its arguments under ``arguments_key``, then
    ``closes``; where ``several``, calls may follow one another, ``between`` apart. Every call begins with ``lead``,
    which text may not begin with, so an answer's first characters tell text from calls. ``marker``: what in a chat
    template shows it writes calls so."""

    name: str
    marker: str
    opens: str
    closes: str
    arguments_key: str
    lead: str
    several: bool
    between: str = "\n"

    def grammar(self, calling: ToolCalling) -> GrammarSpec:
        """Under ``auto``: text that does not open a call, or calls and nothing else; for a named function: one call
        to it. Each call under its function's schema, its keys in the order written (the name first), so that the
        opening through the arguments' key is forced where one function may be called."""
        schema = calling.call_schema(self.arguments_key) | {"x-guidance": JSON_LAYOUT}
        call = " ".join([*([json.dumps(self.opens)] if self.opens else []), "%json", json.dumps(schema),
                         *([json.dumps(self.closes)] if self.closes else [])])
        if calling.named:
            return GrammarSpec("grammar", f"start: call\ncall: {call}\n")
        calls = f"call ({json.dumps(self.between)} call)*" if calling.parallel and self.several else "call"
        starts = "|".join(re.escape(self.lead[:i]) + "[^" + re.escape(self.lead[i]) + "]"
                          for i in range(len(self.lead)))  # text: its first characters are not the lead's
        lark = f"start: TEXT | calls\ncalls: {calls}\ncall: {call}\nTEXT: /({starts})(.|\\n)*/\n"
        return GrammarSpec("grammar", lark)

    def opened(self, answer: str) -> bool:
        """Whether an answer that begins with ``answer`` may be calls (its first characters do not yet tell)."""
        return self.lead.startswith(answer[: len(self.lead)])

    def read(self, text: str) -> list[tuple[str, str]]:
        """The calls in an answer of calls: (name, arguments as JSON text) each."""
        blocks = [block.strip() for block in (text.split(self.closes) if self.closes else [text]) if block.strip()]
        return [(call["name"], json.dumps(call[self.arguments_key], ensure_ascii=False))
                for call in (_json(block.removeprefix(self.opens.strip()).strip()) for block in blocks)]


HERMES = CallFormat("hermes", marker="<tool_call>", opens="<tool_call>\n", closes="\n</tool_call>",
                    arguments_key="arguments", lead="<t", several=True)
# Llama 3.1-3.3's JSON tool calling: one call, a bare object; their templates ask for it in these words
LLAMA3_JSON = CallFormat("llama3-json", marker='"parameters": dictionary of argument name and its value', opens="",
                         closes="", arguments_key="parameters", lead="{", several=False)
CALL_FORMATS = (HERMES, LLAMA3_JSON)


def call_format(template: str | None) -> CallFormat | None:
    """The tool-call format a chat template writes, or None where exactspec knows none of its."""
    return next((f for f in CALL_FORMATS if template is not None and f.marker in template), None)


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
    format: CallFormat | None = None  # how the template writes calls, where exactspec knows (auto needs one)

    @property
    def named(self) -> bool:
        return self.choice not in ("auto", "required")

    def schema_of(self, name: str) -> dict:
        return next(tool for tool in self.tools if tool["name"] == name).get("parameters") or {"type": "object"}

    def call_schema(self, arguments_key: str = "arguments") -> dict:
        """One call: a function's name and its arguments (under ``arguments_key``) under that function's schema; the
        named function's only, where one is named."""
        names = [self.choice] if self.named else [tool["name"] for tool in self.tools]
        options = [{"type": "object", "properties": {"name": {"const": name}, arguments_key: self.schema_of(name)},
                    "required": ["name", arguments_key], "additionalProperties": False} for name in names]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self) -> GrammarSpec:
        """What the answer keeps to (the module's docstring): ``required``'s list of calls; else the template's
        call format (``auto``, a named function); else, a named function on a template without one, its
        arguments."""
        if self.choice == "required":
            calls = {"type": "array", "items": self.call_schema(), "minItems": 1}
            return GrammarSpec.json_schema(calls | ({} if self.parallel else {"maxItems": 1}))
        if self.format is None:  # a named function: auto needs a format (refused without one, tool_calling)
            return GrammarSpec.json_schema(self.schema_of(self.choice))
        return self.format.grammar(self)

    def in_text(self, answer: str) -> bool:
        """Whether an answer that begins with ``answer`` is text, not calls: under ``auto``, known from its first
        characters (:meth:`CallFormat.opened`); never otherwise."""
        return self.choice == "auto" and self.format is not None and not self.format.opened(answer)

    def calls(self, text: str) -> list[dict] | None:
        """The answer's calls, as OpenAI's ``message.tool_calls``; None where it answered in text. ToolError where
        max_tokens cut them short (a named function's arguments too: not yet JSON)."""
        if self.choice == "required":
            found = [(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in _json(text)]
        elif self.format is None:  # a named function's arguments
            _json(text)
            found = [(self.choice, text)]
        elif self.named or text and self.format.opened(text):
            found = self.format.read(text)
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
    form = call_format(template)
    if choice == "auto" and form is None:
        raise ToolError("this model's chat template has no tool-call format exactspec knows, so tool_choice auto "
                        "cannot tell a call from text: ask tool_choice required or a named function", "tool_choice")
    return ToolCalling(tuple(functions), choice, True if parallel is None else parallel, form)


def template_tools(calling: ToolCalling | None) -> list[dict] | None:
    """The tools as chat templates read them (transformers' convention), or None."""
    if calling is None:
        return None
    return [{"type": "function", "function": tool} for tool in calling.tools]
