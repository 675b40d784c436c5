"""Text from runs (output, results, error messages) shown on a terminal.

Run output is written by workflow code and may carry anything: an escape sequence that
clears the screen, sets the window title or plants an OSC-8 link, a carriage return or
newline that forges a line such as ``run succeeded``, or a bidi override that makes text
read backwards. `safe` turns each of these characters into a visible escape, so what a
user reads is what is stored. JSON output (``--json``) is exact and does not go through it.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_BIDI = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]  # embeddings, overrides, isolates
# Invisible or line-breaking: zero-width space/joiners, LRM/RLM, the Arabic letter mark,
# the Unicode line and paragraph separators (some terminals break lines on them), BOM.
_INVISIBLE = [*range(0x200B, 0x2010), 0x061C, 0x2028, 0x2029, 0xFEFF]


def _escape(code: int) -> str:
    char = chr(code)
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_TABLE: dict[int, str] = {
    code: _escape(code)
    for code in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *_BIDI, *_INVISIBLE]
}


def safe(text: str) -> str:
    """`text` with C0 and C1 controls (ESC, CR, LF, ...), DEL, bidi embedding, override,
    isolate and mark characters, zero-width characters, line and paragraph separators and
    the BOM replaced by visible escapes such as ``\\x1b`` or ``\\n``."""
    return text.translate(_TABLE)
