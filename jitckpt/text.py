"""Text from outside made safe to print: one definition for every part that prints it.

Validation where a string enters keeps most of it plain, but error texts and
records carry what others wrote (a store's error message, a pod's own
annotations, a name quoted back). A terminal acts on escape sequences, and a
log line or a table row is one record only while it has no line break. So
whatever the sidecar logs, ``jitckpt ls`` prints and ``jitckpt audit`` shows
goes through ``escape``: control characters, line and paragraph separators
and the format characters that reorder text (bidi overrides) become visible
``\\xNN``/``\\uNNNN`` escapes. It lives outside every part, on the standard
library alone, because both images carry ``jitckpt/``.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, the Unicode line/paragraph separators, and the
# zero-width and bidi format characters a terminal or viewer acts on.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` on one line, with nothing a terminal would act on."""
    return _UNSAFE.sub(_visible, text)
