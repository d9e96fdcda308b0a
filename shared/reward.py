"""The verifier: a completion's final numeric answer against the reference, reward 1.0 or 0.0.

Where the answer is read, in order:
1. after the last `</think>` when present (R1-Distill pre-fills `<think>`; `<think>` is never required);
2. the number after the last `####` (the format GSM8K's solutions use, and the prompt asks for);
3. else the content of the last `\\boxed{...}` (nesting allowed);
4. else the last number in the text.

Normalisation: Unicode digits become ASCII (NFKC, then any decimal digit), commas, `$` and a trailing
`.` go, a leading `+` goes, and `18.0`, `18.00`, `018` all read as `18`. Everything is linear-time
string work (no `int()` on the digits: CPython refuses to convert more than 4,300 of them), so a
100,000-digit completion costs a few milliseconds and every input gets an answer, never an exception.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["extract_answer", "normalize_number", "verify"]

# A number: optional sign, digits with optional thousands commas, optional decimal part.
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?|[-+−]?\.\d+")
_HASHES = "####"
_BOXED = "\\boxed"
_THINK_END = "</think>"
# Longer completions are cut to their tail: the answer is at the end, and it bounds the work.
_MAX_CHARS = 200_000


def _ascii_digits(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    if text.isascii():
        return text
    out = []
    for ch in text:
        if not ch.isascii() and ch.isdecimal():
            out.append(str(unicodedata.decimal(ch)))
        else:
            out.append(ch)
    return "".join(out)


def normalize_number(token: str) -> str | None:
    """'$1,000.50' -> '1000.5'; '-018.0' -> '-18'; returns None if no number is there."""
    token = token.strip().replace("−", "-").replace("$", "").replace(",", "").rstrip(".")
    m = re.fullmatch(r"([-+]?)(\d*)(?:\.(\d*))?", token)
    if m is None or not (m.group(2) or m.group(3)):
        return None
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    body = f"{whole}.{frac}" if frac else whole
    return body if body == "0" or sign != "-" else f"-{body}"


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER.finditer(text):  # noqa: B007 - we want the final match
        pass
    return normalize_number(last.group(0)) if last is not None else None


def _last_boxed(text: str) -> str | None:
    """Content of the last closed \\boxed{...} (nested braces allowed); None if there is none.

    One pass matches every brace pair with a stack, so the cost is linear even for thousands of
    unclosed `\\boxed{` (scanning forward from each one would be quadratic).
    """
    if _BOXED not in text:
        return None
    closing: dict[int, int] = {}  # index of '{' -> index of its matching '}'
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    best = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        brace = m.end() - 1
        if brace in closing:
            best = (brace, closing[brace])
    return None if best is None else text[best[0] + 1 : best[1]]


def extract_answer(text: str) -> str | None:
    """The normalised final answer of a completion (or of a GSM8K reference solution), or None."""
    if not isinstance(text, str):
        return None
    if len(text) > _MAX_CHARS:
        text = text[-_MAX_CHARS:]
    text = _ascii_digits(text)
    think_end = text.rfind(_THINK_END)
    if think_end != -1:
        text = text[think_end + len(_THINK_END) :]
    hashes = text.rfind(_HASHES)
    if hashes != -1:
        m = _NUMBER.search(text, hashes + len(_HASHES))
        # Only the number right after '####' counts, not one further down the text.
        if m is not None and not text[hashes + len(_HASHES) : m.start()].strip(" \t$:*"):
            return normalize_number(m.group(0))
    boxed = _last_boxed(text)
    if boxed is not None:
        inner = boxed.replace("\\,", "").replace("\\!", "")
        inner = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", inner)
        return _last_number(inner)
    return _last_number(text)


def verify(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals the reference's, else 0.0.

    `answer` may be a bare final answer ('1,000') or a full GSM8K solution ending in '#### 1000'.
    """
    want = extract_answer(answer)
    if want is None:
        return 0.0
    return 1.0 if extract_answer(completion) == want else 0.0
