"""Equivalent rewritings and near misses of MATH-500 reference answers (for the math tests)."""
import fractions
import re

_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}|\\[dt]?frac(\d)(\d)")
_INT_RE = re.compile(r"-?\d+")
_DECIMAL_RE = re.compile(r"-?\d*\.\d+")


def _slash(m):
    a = m.group(1) if m.group(1) is not None else m.group(3)
    b = m.group(2) if m.group(2) is not None else m.group(4)
    simple = re.compile(r"\\?[A-Za-z0-9]+")
    a = a if simple.fullmatch(a) else f"({a})"
    b = b if simple.fullmatch(b) else f"({b})"
    return f"{a}/{b}"


def _value(ans):
    """Exact value of a plain numeric answer (int, decimal, \\frac{a}{b}), else None."""
    s = ans.replace(" ", "")
    neg = s.startswith("-")
    s = s[1:] if neg else s
    m = re.fullmatch(r"\\[dt]?frac\{(\d+)\}\{(\d+)\}|\\[dt]?frac(\d)(\d)", s)
    if m:
        a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        v = fractions.Fraction(int(a), int(b))
    elif re.fullmatch(r"\d+|\d*\.\d+", s):
        v = fractions.Fraction(s)
    else:
        return None
    return -v if neg else v


def _decimal(v):
    """A terminating decimal string for v, or None."""
    den = v.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return None
    digits = 0
    scaled = v
    while scaled.denominator != 1:
        scaled *= 10
        digits += 1
    if digits == 0:
        return None
    s = str(abs(scaled.numerator)).rjust(digits + 1, "0")
    return ("-" if v < 0 else "") + s[:-digits] + "." + s[-digits:]


def rewrites(ans):
    """(name, boxed-or-plain completion text) pairs that must all score 1 against ``ans``."""
    out = [("self", f"The final answer is $\\boxed{{{ans}}}$.")]

    def boxed(name, s):
        if s != ans:
            out.append((name, f"Thus, the answer is $\\boxed{{{s}}}$."))

    boxed("dfrac", re.sub(r"\\frac", r"\\dfrac", ans))
    if not re.search(r"\d\s*\\[dt]?frac", ans):  # not a mixed number like 1\frac{4}{5}
        boxed("slash", _FRAC_RE.sub(_slash, ans))
    boxed("tight", re.sub(r"(?<![A-Za-z])\s+|\s+(?![A-Za-z])", "", ans))
    if not re.search(r"\d,(\\!)?\s?\d{3}", ans):  # commas here separate items, not thousands
        boxed("loose", re.sub(r"\s*([,+=])\s*", r" \1 ", ans).strip())
    boxed("left_right", ans.replace("\\left", "").replace("\\right", ""))
    if "^\\circ" in ans:
        boxed("degrees_braced", ans.replace("^\\circ", "^{\\circ}"))
        boxed("degrees_dropped", ans.replace("^\\circ", ""))
        boxed("degrees_word", ans.replace("^\\circ", "\\text{ degrees}"))
        boxed("degrees_unicode", ans.replace("^\\circ", "\u00b0"))
    if re.fullmatch(r"\\\$?[\d,.\\! ]+", ans) or re.fullmatch(r"[\d,.\\! ]+", ans):
        plain = ans.replace("\\$", "").replace("\\!", "").replace(" ", "")
        if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", plain):
            boxed("no_thousands", plain.replace(",", ""))
    v = _value(ans)
    if v is not None:
        boxed("units", f"{ans} \\text{{ cm}}")
        plain = f"{v.numerator}/{v.denominator}" if v.denominator != 1 else str(v.numerator)
        out.append(("plain_text", f"So the final answer is {plain}."))
        boxed("as_fraction", f"\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}" if v >= 0 else
              f"-\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}")
        dec = _decimal(v)
        if dec is not None:
            boxed("as_decimal", dec)
        if v.denominator == 1 and abs(v) >= 1000:
            boxed("thousands", f"{v.numerator:,}")
    m = re.fullmatch(r"\\text\{\(?([A-Za-z ]+)\)?\}", ans)
    if m:
        boxed("no_text", m.group(1))
    return out


def near_misses(ans):
    """(name, completion) pairs that must all score 0 against ``ans``."""
    out = []

    def boxed(name, s):
        if s != ans:
            out.append((name, f"The final answer is $\\boxed{{{s}}}$."))

    # Bump the first digit: math-verify ignores base subscripts (52_8 reads as 52), stripped
    # units (cm^2) and differences below its 6-decimal rounding, so later digits can be moot.
    d = re.search(r"\d", ans)
    if d:
        bumped = str(int(d.group()) % 9 + 1)
        boxed("digit_bump", ans[:d.start()] + bumped + ans[d.end():])
    v = _value(ans)
    if v is not None and v != 0:
        boxed("negated", ans[1:] if ans.startswith("-") else "-" + ans)
        if v.denominator != 1:
            boxed("reciprocal", f"\\frac{{{v.denominator}}}{{{abs(v.numerator)}}}")
    if re.fullmatch(r"[(\[].*[)\]]", ans) and "\\cup" not in ans and "," in ans:
        flip = {"(": "[", "[": "(", ")": "]", "]": ")"}
        if "infty" in ans[-8:]:  # (a, oo) = (a, oo]: flip the finite end
            boxed("bracket", flip[ans[0]] + ans[1:])
        else:
            boxed("bracket", ans[:-1] + flip[ans[-1]])
    m = re.fullmatch(r"\\text\{(\(?)([A-Za-z])(.*)\}", ans)
    if m:
        other = "B" if m.group(2).upper() != "B" else "C"
        boxed("other_text", f"\\text{{{m.group(1)}{other}{m.group(3)}}}")
    return out
