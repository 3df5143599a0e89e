"""The bounds on a checkpoint's target and ignore lists: count, length, and `re:` entries that cannot backtrack for
long on a layer name (ReDoS)."""
from __future__ import annotations

import math
import re
from typing import Tuple

try:  # the regex parser, to refuse patterns that backtrack exponentially
    from re import _parser as _re_parser
except ImportError:  # Python < 3.11
    import sre_parse as _re_parser

from ..._untrusted import echo, require

# Bounds on a checkpoint's target lists: real ones name a few dozen layers or patterns.
_MAX_NAMES = 1024
_MAX_NAME_CHARS = 512
# Every layer name is matched against every `re:` entry, and a failed match of an entry with k repeats can backtrack
# through ~C(len(name) + k, k) positions: 0.5 us for k = 1 on a 59-character name, 6 us for k = 2, 135 us for k = 3,
# 2.2 ms for k = 4. So an entry holds at most _MAX_REPEATS, and the entries of one list at most _MAX_MATCH_STEPS of
# C(64 + k, k) together (1024 entries of one repeat each, or 488 of two, or 21 of three): a few ms a layer name at
# most.
# (compressed-tensors' own presets use one or two entries of one or two repeats.)
_MAX_REPEATS = 3
_MAX_MATCH_STEPS = 1 << 20


_BACKTRACKING_REPEATS = (_re_parser.MAX_REPEAT, _re_parser.MIN_REPEAT)
# Python 3.11's possessive repeats and atomic groups (a sentinel before: the parser has no such items there)
_POSSESSIVE_REPEAT = getattr(_re_parser, "POSSESSIVE_REPEAT", object())
_ATOMIC_GROUP = getattr(_re_parser, "ATOMIC_GROUP", object())
_ALTERNATIVES = (_re_parser.BRANCH, _re_parser.GROUPREF_EXISTS)  # tried one after another


def _parts(op, arg) -> list:
    """The parsed sub-patterns one item of a parsed regex holds (none for a leaf). An item of another kind holding a
    sub-pattern is refused: the checks below must see every part a matcher can backtrack in."""
    if op in _BACKTRACKING_REPEATS or op is _POSSESSIVE_REPEAT:
        return [arg[2]]
    if op is _re_parser.BRANCH:
        return list(arg[1])
    if op is _re_parser.GROUPREF_EXISTS:  # (?(group)yes|no)
        return [part for part in arg[1:] if part is not None]
    if op is _re_parser.SUBPATTERN:
        return [arg[-1]]
    if op in (_re_parser.ASSERT, _re_parser.ASSERT_NOT):
        return [arg[1]]
    if op is _ATOMIC_GROUP:
        return [arg]
    if any(isinstance(x, _re_parser.SubPattern) for x in (arg if isinstance(arg, tuple) else (arg,))):
        raise ValueError(f"a regex construct these checks do not know ({op})")
    return []


def _repeats(parsed) -> int:
    """How many variable repeats (*, +, {m,n} with m < n, n > 1) a parsed regex holds in sequence, the most of any
    alternative (alternatives are tried one after another). Each one multiplies the backtracking a failed match can do
    by the name's length: k of them take ~len(name)^k / k! steps (`.*` twenty times over a 30-character name never
    finishes). Possessive repeats and atomic groups are not backtracked into, but their parts are while they match."""
    count = 0
    for op, arg in parsed:
        count += max((_repeats(part) for part in _parts(op, arg)), default=0)
        if op in _BACKTRACKING_REPEATS and arg[1] > 1 and arg[0] != arg[1]:
            count += 1
    return count


def _repeats_a_backtracker(parsed, repeated: bool = False) -> bool:
    """Whether a parsed regex repeats (*, +, {m,n} with n > 1) a part that itself repeats or alternates: the shapes
    (`(a+)+`, `(a|a)*`) on which a backtracking matcher takes exponential time. (A possessive repeat is not
    backtracked into: what it repeats is not `repeated`.)"""
    for op, arg in parsed:
        many = op in _BACKTRACKING_REPEATS and arg[1] > 1
        if (many or op in _ALTERNATIVES) and repeated:
            return True
        if any(_repeats_a_backtracker(part, repeated or many) for part in _parts(op, arg)):
            return True
    return False


def check_names(value, where: str, field: str) -> Tuple[str, ...]:
    """A list of compressed-tensors targets (names, `re:` regexes, class names), bounded in count and length; each
    regex must compile, must not nest repetition and may hold at most _MAX_REPEATS repeats, the list's regexes at most
    _MAX_MATCH_STEPS together (a pattern that backtracks exponentially, or as a high power of the name's length, on a
    layer name would hang the load)."""
    require(isinstance(value, list) and all(isinstance(v, str) for v in value), where, field, value,
            "expected a list of strings")
    require(len(value) <= _MAX_NAMES, where, f"{field} length", len(value), f"at most {_MAX_NAMES} entries")
    steps = 0
    for target in value:
        require(len(target) <= _MAX_NAME_CHARS, where, f"{field} entry", target,
                f"at most {_MAX_NAME_CHARS} characters")
        if target.startswith("re:"):
            try:
                parsed = _re_parser.parse(target[3:])
                re.compile(target[3:])  # what the parser lets through and the compiler refuses (look-behinds)
                repeats = _repeats(parsed)
            except (re.error, RecursionError, OverflowError, ValueError) as e:
                raise ValueError(f"{where}: {field} entry {echo(target)} is not a valid regex ({e})") from None
            if repeats > _MAX_REPEATS:
                raise ValueError(f"{where}: {field} entry {echo(target)} holds {repeats} repeats (* + {{m,n}}), "
                                 f"which can take a long time to match a layer name; at most {_MAX_REPEATS} (e.g. "
                                 f"re:.*q_proj)")
            steps += math.comb(64 + repeats, repeats)
            if steps > _MAX_MATCH_STEPS:
                raise ValueError(f"{where}: {field} holds too many `re:` entries with repeats to match every layer "
                                 f"name against them in reasonable time (at most {_MAX_MATCH_STEPS} of C(64 + "
                                 f"repeats, repeats) in all: 1024 entries of one repeat, 488 of two, 21 of three)")
            if _repeats_a_backtracker(parsed):
                raise ValueError(f"{where}: {field} entry {echo(target)} repeats a group that itself repeats or "
                                 f"alternates, which can take exponential time to match; write it without nested "
                                 f"repetition (e.g. re:.*q_proj)")
    return tuple(value)
