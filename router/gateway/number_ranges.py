"""GBNF for JSON integers and numbers inside bounds, digit by digit.

A JSON number in an interval is a regular language when written without an exponent, so
the grammar enforces bounds exactly: `integer_range` for integers in [low, high] (either
side open-ended), `number_range` for decimals with inclusive or exclusive bounds. Values
have at most `MAX_DIGITS` integer digits and `MAX_FRACTION` fraction digits (a narrowing:
every value generated is in the interval), never a leading zero, never `-0`.
"""

from __future__ import annotations

from decimal import Decimal
from typing import NamedTuple

MAX_DIGITS = 15
MAX_FRACTION = 15
_ANY_FRACTION = f'("." [0-9]{{1,{MAX_FRACTION}}})?'


class Bound(NamedTuple):
    """One end of an interval: its value and whether the value itself is excluded."""

    value: Decimal
    exclusive: bool = False


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF expression for the integers in [low, high] (None: unbounded on that side)."""
    alts = []
    if low is None or low < 0:  # negatives: magnitudes in [max(1, -high), -low]
        least = 1 if high is None or high >= 0 else -high
        alts.append(f'"-" ({_naturals(least, None if low is None else -low)})')
    if high is None or high >= 0:
        alts.append(_naturals(max(low or 0, 0), high))
    return " | ".join(alts)


def number_range(low: Bound | None, high: Bound | None) -> str:
    """A GBNF expression for the decimals in the interval (None: unbounded that side)."""
    alts = []
    if low is None or low.value < 0:  # negatives, as magnitudes; never "-0"
        least = Bound(-high.value, high.exclusive) if high and high.value < 0 else Bound(0, True)
        most = None if low is None else Bound(-low.value, low.exclusive)
        alts.append(f'"-" ({_magnitudes(least, most)})')
    if high is None or high.value > 0 or (high.value == 0 and not high.exclusive):
        least = low if low is not None and low.value >= 0 else Bound(Decimal(0))
        alts.append(_magnitudes(least, high))
    return " | ".join(alts)


def decimal(value: int | float) -> Decimal:
    """A JSON number as the decimal it is written as (`0.1` is 0.1, not a binary float)."""
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def digits_fit(value: Decimal) -> bool:
    """Whether a bound is within the digits the grammar writes."""
    whole, fraction = _split(abs(value))
    return len(str(whole)) <= MAX_DIGITS and len(fraction) <= MAX_FRACTION


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction digits (no trailing zeros)."""
    whole = int(value)
    text = format(value - whole, "f")
    return whole, text.partition(".")[2].rstrip("0")


def _magnitudes(low: Bound, high: Bound | None) -> str:
    """Non-negative decimals between the bounds (low.value >= 0)."""
    whole_low, frac_low = _split(low.value)
    alts = []
    if high is not None:
        whole_high, frac_high = _split(high.value)
        if whole_high == whole_low:
            both = _fraction(frac_low, low.exclusive, frac_high, high.exclusive, MAX_FRACTION)
            return _with_fraction(f'"{whole_low}"', both)
    first = _fraction(frac_low, low.exclusive, None, False, MAX_FRACTION)
    alts.append(_with_fraction(f'"{whole_low}"', first))
    top = None if high is None else whole_high - 1
    if top is None or top >= whole_low + 1:
        alts.append(f"({_naturals(whole_low + 1, top)}) {_ANY_FRACTION}")
    if high is not None:
        last = _fraction(None, False, frac_high, high.exclusive, MAX_FRACTION)
        alts.append(_with_fraction(f'"{whole_high}"', last))
    return " | ".join(a for a in alts if a)


def _with_fraction(whole: str, fraction: tuple[list[str], bool]) -> str:
    """`whole` followed by a fraction from `fraction` ("" when none fits)."""
    alts, empty = fraction
    if not alts:
        return whole if empty else ""
    fraction_text = f'"." ({" | ".join(alts)})'
    return f"{whole} ({fraction_text})?" if empty else f"{whole} {fraction_text}"


def _fraction(
    low: str | None, low_open: bool, high: str | None, high_open: bool, room: int
) -> tuple[list[str], bool]:
    """Fraction digit strings s (at most `room` digits) with low <(=) 0.s <(=) high, where
    low/high are fraction digits (None: no bound): the non-empty ones as GBNF alternatives,
    and whether the empty fraction (the value 0) fits."""
    empty = (low is None or (low == "" and not low_open)) and not (high == "" and high_open)
    if room == 0:
        return [], empty
    lo = int(low[0]) if low else 0
    hi = int(high[0]) if high else 0 if high == "" else 9
    rest = f" [0-9]{{0,{room - 1}}}" if room > 1 else ""
    alts = []
    first, last = lo + (low is not None), hi - (high is not None)
    if first <= last:
        digits = f"[{first}]" if first == last else f"[{first}-{last}]"
        alts.append(digits + rest)
    if low is not None and high is not None and lo == hi:
        tails = [(lo, _fraction(low[1:], low_open, high[1:], high_open, room - 1))]
    else:
        tails = []
        if low is not None:
            tails.append((lo, _fraction(low[1:], low_open, None, False, room - 1)))
        if high is not None:
            tails.append((hi, _fraction(None, False, high[1:], high_open, room - 1)))
    for digit, (tail, tail_empty) in tails:
        if tail:
            alts.append(f'"{digit}" ({" | ".join(tail)})' + ("?" if tail_empty else ""))
        elif tail_empty:
            alts.append(f'"{digit}"')
    return alts, empty


def _naturals(low: int, high: int | None) -> str:
    """Integers in [low, high] without sign or leading zeros (None: up to MAX_DIGITS + 1
    digits)."""
    top = 10 ** (MAX_DIGITS + 1) - 1 if high is None else high
    alts, full = [], []
    for digits in range(len(str(low)), len(str(top)) + 1):
        start, end = max(low, 10 ** (digits - 1) if digits > 1 else 0), min(top, 10**digits - 1)
        if start > end:
            continue
        if digits > 1 and start == 10 ** (digits - 1) and end == 10**digits - 1:
            full.append(digits)
        else:
            alts.append(_same_length(str(start), str(end)))
    if full:
        alts.append(f"[1-9] [0-9]{{{full[0] - 1},{full[-1] - 1}}}")
    return " | ".join(alts)


def _same_length(low: str, high: str) -> str:
    """Digit strings of one length between `low` and `high`."""
    if low == high:
        return f'"{low}"'
    same = next(i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b)
    prefix = f'"{low[:same]}" ' if same else ""
    low, high = low[same:], high[same:]
    size = len(low) - 1
    if size == 0:
        return f"{prefix}[{low}-{high}]"
    low_tail_min, high_tail_max = low[1:] == "0" * size, high[1:] == "9" * size
    first = int(low[0]) + (not low_tail_min)
    last = int(high[0]) - (not high_tail_max)
    alts = []
    if not low_tail_min:
        alts.append(f'"{low[0]}" ({_same_length(low[1:], "9" * size)})')
    if first <= last:
        alts.append(f"[{first}-{last}] [0-9]{{{size}}}")
    if not high_tail_max:
        alts.append(f'"{high[0]}" ({_same_length("0" * size, high[1:])})')
    return f"{prefix}({' | '.join(alts)})"
