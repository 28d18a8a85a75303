"""The code-edit workload, ``exactspec bench --prompts code-edits``: edits of the functions exactspec itself ships,
whose answers copy most of their input, as editors' "apply" and coding agents ask for (issue 62). A drafter that copies
(prompt lookup, the suffix index, the hybrid) then drafts long, and a pass over many positions is what a round costs.

Each of exactspec's own functions of 12-40 lines (its package's modules in the order of their paths, then of the
functions in each) gives one prompt: rename a variable it assigns and reads at least three times, or, where it has
none, remove its comments. Nothing here comes from the benchmarks' held-out prompts, and nothing is tuned on it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import exactspec

CODE_EDITS = "code-edits"  # the name --prompts gives the workload
CATEGORY = "edit"
SHORTEST, LONGEST = 12, 40  # lines of a function edited
INSTRUCTION = ("Apply this edit to the Python function below, and answer with the whole function as edited, in one "
               "code block, and nothing else.\nEdit: {edit}\n\n```python\n{source}\n```")


def code_edits() -> list[tuple[str, str]]:
    """The workload's prompts (id, chat text), the same on every machine for the same exactspec."""
    prompts = []
    package = Path(exactspec.__file__).parent
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for function in _functions(ast.parse(text)):
            source = ast.get_source_segment(text, function, padded=True)
            if source is None or not SHORTEST <= source.count("\n") + 1 <= LONGEST:
                continue
            edit = _edit(function, source)
            if edit is not None:
                prompts.append((f"{module}:{function.name}", INSTRUCTION.format(edit=edit, source=_dedented(source))))
    return prompts


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The module's functions and its classes' methods, in the order they are written."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append(node)
        elif isinstance(node, ast.ClassDef):
            found += [child for child in node.body if isinstance(child, ast.FunctionDef)]
    return found


def _edit(function: ast.FunctionDef, source: str) -> str | None:
    """The edit asked of ``function``: rename its most used assigned variable (3 uses or more); else remove its
    comments, where it has some; else none."""
    names = [node for node in ast.walk(function) if isinstance(node, ast.Name)]
    assigned = {node.id for node in names if isinstance(node.ctx, ast.Store)}
    uses = {name: sum(node.id == name for node in names) for name in sorted(assigned) if len(name) > 1}
    if uses and max(uses.values()) >= 3:
        name = max(uses, key=lambda n: (uses[n], n))
        return f"rename the variable `{name}` to `{name}_value` everywhere in the function."
    if _has_comments(source):
        return "remove every comment (the lines and the ends of lines after #); keep the docstring."
    return None


def _has_comments(source: str) -> bool:
    try:
        return any(token.type == tokenize.COMMENT for token in tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError):
        return False


def _dedented(source: str) -> str:
    """A method's source moved to the left margin (its first line's indent off every line)."""
    lines = source.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines)
