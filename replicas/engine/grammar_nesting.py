"""How deep a GBNF grammar's groups nest, counted as llama.cpp's parser reads them.

llama.cpp parses a group `( … )` by recursing once per level, and the bundled version has
no depth check: a grammar nested some tens of thousands deep overflows the parsing thread's
stack and kills the process (ggml-org/llama.cpp#26600). Upstream's fix (PR #26602) refuses
more than 1,000 levels; Baton counts the depth before llama.cpp sees a grammar, in one
linear pass that skips what the parser reads as text: string literals, character classes,
token references (`<…>`) and comments, where brackets do not nest.
"""

from __future__ import annotations

import re

# llama.cpp's own cap upstream (LLAMA_GRAMMAR_MAX_NESTING, PR #26602), "far above any
# legitimate grammar depth"; Baton's schemas nest at most MAX_REPEAT (1,000) optional items.
DEFAULT_MAX_GRAMMAR_NESTING = 1000

# Each lexeme as the parser reads it; an unterminated one runs to the end (llama.cpp fails
# there). Only the brackets outside them count.
_LEXEMES = re.compile(
    r"""
      "(?:\\.|[^"\\])*"?       # a string literal, with escapes
    | \[(?:\\.|[^\]\\])*\]?    # a character class, with escapes
    | <[^>]*>?                 # a token reference: <name> or <[id]>
    | \#[^\r\n]*               # a comment, to the end of its line
    | [()]
    """,
    re.VERBOSE | re.DOTALL,
)


class GrammarTooDeep(ValueError):
    """A grammar whose groups nest deeper than the bound."""

    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(
            f"the grammar's groups nest {depth} deep; at most {limit} are taken "
            "(the max_grammar_nesting setting)"
        )
        self.depth = depth
        self.limit = limit


def grammar_nesting(text: str) -> int:
    """The deepest nesting of groups in `text`, as llama.cpp's parser would reach it (an
    unbalanced `)` counts as nothing, so the depth is never under the parser's)."""
    depth = deepest = 0
    for lexeme in _LEXEMES.finditer(text):
        bracket = lexeme.group()
        if bracket == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket == ")":
            depth = max(depth - 1, 0)
    return deepest


def check_grammar_nesting(text: str, limit: int) -> None:
    """Raise `GrammarTooDeep` if `text`'s groups nest deeper than `limit`."""
    depth = grammar_nesting(text)
    if depth > limit:
        raise GrammarTooDeep(depth, limit)
