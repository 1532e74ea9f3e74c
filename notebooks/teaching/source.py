"""The engine's own code, shown: the methods of a class that deal with one idea, printed from
the installed module (`inspect`), so that a notebook shows the code as it is, never a copy.

Methods are chosen by what their text says (`methods_mentioning(SkipJoinMLFQScheduler,
"quantum")`), not by name, so that a method renamed or split still shows up.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["methods_mentioning"]


def methods_mentioning(cls: type, word: str) -> str:
    """The source of `cls`'s own methods (in the order the class defines them) whose name,
    docstring or code mentions `word`, separated by blank lines; empty when none does."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0]
    if not isinstance(body, ast.ClassDef):
        raise TypeError(f"{cls!r} is not a class defined in Python source")
    found = []
    for node in body.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_source_segment(source, node, padded=True) or ""
            if word in text:
                found.append(textwrap.dedent(text))
    return "\n\n".join(found)
