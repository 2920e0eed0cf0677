"""AUTOMATIC1111's prompt syntax: attention weights, prompt editing/alternation, extra-network tags.

This module re-implements, in plain Python and without torch or ``lark``, the behaviour of
AUTOMATIC1111 stable-diffusion-webui's ``modules/prompt_parser.py`` and of the tag syntax of
``modules/extra_networks.py``. The reference is A1111's *code* (its doctests are reproduced in
``tests/test_prompts.py``); each function says which A1111 function it follows and where it
deliberately deviates.

Order of processing in A1111, which :func:`describe` follows: extra-network tags are removed first,
then the remaining text is turned into a step schedule, and each scheduled text is parsed for
attention weights (and cut into 75-token chunks at ``BREAK``). A1111's ``AND`` (composable
diffusion) and its ``#`` comments (a separate processing script) are not handled here.

Three surfaces:

* :func:`parse_attention` -- ``(text)``, ``[text]``, ``(text:1.3)``, escapes and ``BREAK``;
* :func:`prompt_schedule` / :func:`text_at_step` -- ``[from:to:when]`` editing and ``[a|b]``
  alternation;
* :func:`extract_networks` -- ``<lora:name:0.8>`` style tags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from sdlite.errors import SDLiteError

__all__ = [
    "NetworkTag",
    "PromptError",
    "ScheduledPrompt",
    "describe",
    "extract_networks",
    "is_break",
    "parse_attention",
    "prompt_schedule",
    "split_break",
    "text_at_step",
]


class PromptError(SDLiteError, ValueError):
    """A prompt that cannot be interpreted (a malformed tag weight, an unusable number...)."""


# ---------------------------------------------------------------------------------------------
# Attention: A1111 parse_prompt_attention
# ---------------------------------------------------------------------------------------------

ROUND_MULTIPLIER = 1.1
SQUARE_MULTIPLIER = 1 / 1.1

# The token classes A1111's ``re_attention`` recognises, tried in this order at each position:
# an escaped bracket or backslash; a lone backslash (it stands for nothing); an opening bracket;
# ":<number>)" closing a round bracket with an explicit weight; a closing bracket; a run of
# ordinary text; a colon on its own.
_ATTENTION_TOKEN = re.compile(
    r"(?P<esc>\\[()\[\]\\])"
    r"|(?P<lone>\\)"
    r"|(?P<open>[(\[])"
    r"|:\s*(?P<weight>[+-]?[.\d]+)\s*\)"
    r"|(?P<close>[)\]])"
    r"|(?P<text>[^\\()\[\]:]+)"
    r"|(?P<colon>:)"
)
# ``BREAK`` as a word of its own (word boundaries are taken within one text token), with the
# whitespace around it.
_BREAK = re.compile(r"\s*\bBREAK\b\s*")


def parse_attention(text: str) -> list[tuple[str, float]]:
    r"""Split ``text`` into ``(piece, weight)`` pairs; follows A1111's ``parse_prompt_attention``.

    * ``(x)`` multiplies the weight of ``x`` by 1.1, ``[x]`` by ``1/1.1``, ``(x:w)`` by ``w``;
      nesting multiplies. The explicit weight is ``[+-]?[.\d]+`` with optional spaces around it
      and must be followed directly by ``)``; otherwise the colon is plain text.
    * ``\(`` ``\)`` ``\[`` ``\]`` ``\\`` are literal characters. A backslash before anything else
      disappears (A1111 keeps an empty piece for it) and the next character is read normally.
    * Brackets left open apply to the rest of the prompt; a closing bracket without an opener is
      text.
    * ``BREAK`` as a word inside a text run becomes the marker pair ``("BREAK", -1.0)``; the
      whitespace around it is dropped. The marker is multiplied like any piece, so ``(BREAK)``
      yields ``("BREAK", -1.1)``, which A1111's tokenizer does not take as a break (it tests
      ``weight == -1``) -- reproduced as is.
    * Adjacent pieces with exactly equal weights are merged; an empty prompt gives
      ``[("", 1.0)]``. Floating-point products are formed in A1111's order, so the merges and the
      values match A1111's to the last bit.

    Deviation: an explicit weight that Python's ``float`` rejects (``(a:1.2.3)``, ``(a:.)``) makes
    A1111 raise a bare ``ValueError``; here it is a :class:`PromptError` (also a ``ValueError``).
    """
    pieces: list[list] = []  # [text, weight] pairs, mutated in place like A1111's list
    round_open: list[int] = []
    square_open: list[int] = []

    def scale_from(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] *= factor

    for match in _ATTENTION_TOKEN.finditer(text):
        kind = match.lastgroup
        token = match.group(0)
        if kind == "esc":
            pieces.append([token[1:], 1.0])
        elif kind == "lone":
            pieces.append(["", 1.0])
        elif kind == "open" and token == "(":
            round_open.append(len(pieces))
        elif kind == "open":
            square_open.append(len(pieces))
        elif kind == "weight" and round_open:
            number = match.group("weight")
            try:
                factor = float(number)
            except ValueError:
                raise PromptError(f"attention weight {number!r} in {token!r} is not a number") from None
            scale_from(round_open.pop(), factor)
        elif token == ")" and round_open:
            scale_from(round_open.pop(), ROUND_MULTIPLIER)
        elif token == "]" and square_open:
            scale_from(square_open.pop(), SQUARE_MULTIPLIER)
        else:
            for index, part in enumerate(_BREAK.split(token)):
                if index:
                    pieces.append(["BREAK", -1.0])
                pieces.append([part, 1.0])

    for start in round_open:
        scale_from(start, ROUND_MULTIPLIER)
    for start in square_open:
        scale_from(start, SQUARE_MULTIPLIER)

    if not pieces:
        return [("", 1.0)]
    merged: list[list] = [pieces[0]]
    for piece in pieces[1:]:
        if piece[1] == merged[-1][1]:
            merged[-1][0] += piece[0]
        else:
            merged.append(piece)
    return [(piece_text, float(weight)) for piece_text, weight in merged]


def is_break(pair: tuple[str, float]) -> bool:
    """True for the BREAK marker exactly as A1111's tokenizer tests it (``text == "BREAK" and weight == -1``)."""
    return pair[0] == "BREAK" and pair[1] == -1


def split_break(pairs: list[tuple[str, float]]) -> list[list[tuple[str, float]]]:
    """Split :func:`parse_attention` output at the BREAK markers, dropping the markers.

    One segment per chunk boundary A1111's CLIP tokenizer starts at a marker (``next_chunk()``): a
    leading ``BREAK`` gives an empty first segment, as A1111 then emits a padding-only chunk. Only
    exact markers split (see :func:`is_break`); ``("BREAK", -1.1)`` from ``(BREAK)`` stays a piece.
    """
    segments: list[list[tuple[str, float]]] = [[]]
    for pair in pairs:
        if is_break(pair):
            segments.append([])
        else:
            segments[-1].append(pair)
    return segments


# ---------------------------------------------------------------------------------------------
# Scheduling: A1111 get_learned_conditioning_prompt_schedules
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScheduledPrompt:
    """One text of a schedule, in force up to and including sampler step ``end_at_step`` (see :func:`text_at_step`)."""

    end_at_step: int
    text: str


# lark's common SIGNED_NUMBER, matched the way lark's dynamic Earley lexer does: one greedy
# regular-expression match at the position (so "1e" is the number "1" followed by "e").
_NUMBER = re.compile(
    r"[+-]?(?:\d+[eE][+-]?\d+|(?:\d+\.(?:\d+)?|\.\d+)(?:[eE][+-]?\d+)?|\d+)", re.ASCII
)
_WHITESPACE = re.compile(r"\s+")
# A1111's ``plain`` terminal: anything but \ [ ] ( ) : | -- or a backslash and any character
# except a newline.
_PLAIN = re.compile(r"(?:[^\\\[\]():|]|\\.)+")


@dataclass
class _Edit:
    """``[before:after:when]`` / ``[after:when]`` (``before`` is None then)."""

    before: _Seq | None
    after: _Seq
    number: str  # the NUMBER token as written
    when: int = 0  # resolved by _resolve_when


@dataclass
class _Alternate:
    """``[a|b|...]``; an empty alternative is None."""

    options: list[_Seq | None]


# A parsed sequence is a list of nodes: literal text (str), an emphasis group kept verbatim
# (a nested list: its brackets, content and colon as written), an _Edit or an _Alternate.
_Node = Union[str, list, _Edit, _Alternate]
_Seq = list


class _Unparseable(Exception):
    """The prompt is outside A1111's grammar: A1111 then uses it unchanged for every step."""


class _Frame:
    """An open ``[`` or ``(`` while parsing a group: the parts read so far and the one being read."""

    __slots__ = ("opening", "start", "parts", "current", "mode")

    def __init__(self, opening: str, start: int):
        self.opening = opening
        self.start = start
        self.parts: list[_Seq] = []
        self.current: _Seq = []
        self.mode = ""  # "[": "" (first part), "|" (alternation) or ":" (editing); "(": "" or ":"


class _ScheduleParser:
    """Hand-written parser for A1111's prompt-editing grammar (its lark ``schedule_parser``).

    Inside brackets the grammar is strict: the content must be plain text, whitespace and
    well-formed ``(x)``, ``(x:y)``, ``[x]``, editing and alternation groups. At top level the
    characters ``[ ] ( ) :`` may also stand alone. ``|`` is only allowed inside an alternation and
    a backslash must escape a character other than a newline; a prompt breaking either rule is
    unparseable.

    At top level each ``[`` is taken as the start of a group when the strict grammar accepts a
    group there (the group, ending at its matching ``]``, is then unique), else it is a lone
    character. On the inputs where A1111's lark (Earley) parser has one answer, this is that
    answer; where lark's result depends on the hash seed of the process (a group followed directly
    by a lone ``[ ] ( ) :`` character, e.g. ``[a:1]:2]``), lark gives either this or the reading
    without the group, and we always give this one.

    Groups are parsed with an explicit stack (no recursion, so no nesting limit) and memoised by
    start position, which keeps the whole parse linear.
    """

    def __init__(self, text: str):
        self.text = text
        self.memo: dict[int, tuple[_Node, int] | None] = {}

    def parse(self) -> _Seq:
        text, n = self.text, len(self.text)
        out: _Seq = []
        i = 0
        while i < n:
            char = text[i]
            if char == "[":
                group = self.group(i)
                if group is not None:
                    node, i = group
                    out.append(node)
                    continue
                out.append(char)
                i += 1
            elif char in "]():":
                out.append(char)
                i += 1
            elif char == "|":
                raise _Unparseable
            else:
                match = _PLAIN.match(text, i)
                if match is None:  # a backslash at the end or before a newline
                    raise _Unparseable
                out.append(match.group(0))
                i = match.end()
        return out

    def group(self, start: int) -> tuple[_Node, int] | None:
        """The strict ``[...]`` group starting at ``start`` and the index after it, or None."""
        if start in self.memo:
            return self.memo[start]
        text, n = self.text, len(self.text)
        stack = [_Frame("[", start)]
        i = start + 1
        while True:
            frame = stack[-1]
            char = text[i] if i < n else ""
            if char == "[" and i in self.memo:
                known = self.memo[i]
                if known is None:
                    return self._fail(stack)
                frame.current.append(known[0])
                i = known[1]
            elif char in ("[", "("):
                stack.append(_Frame(char, i))
                i += 1
            elif char and char not in "]):|":
                match = _PLAIN.match(text, i)
                if match is None:
                    return self._fail(stack)
                frame.current.append(match.group(0))
                i = match.end()
            else:
                done = self._separator(frame, char, i)
                if done is None:
                    return self._fail(stack)
                if done is True:  # the frame goes on with a new part
                    i += 1
                    continue
                node, i = done
                stack.pop()
                if frame.opening == "[":
                    self.memo[frame.start] = (node, i)
                if not stack:
                    return node, i
                stack[-1].current.append(node)

    def _separator(self, frame: _Frame, char: str, i: int) -> tuple[_Node, int] | bool | None:
        """Handle ``] ) : |`` (or the end, ``char == ""``) at ``i`` for ``frame``.

        Returns the finished node and the index after it, True when the frame continues with a
        new part after ``char``, or None when the group is not valid.
        """
        part = frame.current
        if frame.opening == "(":
            if char == ")":
                return ["(", *frame.parts, part, ")"], i + 1
            if char == ":" and not frame.mode:
                frame.parts += [part, ":"]
                frame.current, frame.mode = [], ":"
                return True
            return None
        if frame.mode == "" and char == "]":
            return ["[", part, "]"], i + 1
        if frame.mode in ("", "|") and char in ("|", "]"):
            frame.parts.append(part)
            frame.current, frame.mode = [], "|"
            if char == "]":
                return _Alternate([option or None for option in frame.parts]), i + 1
            return True
        if frame.mode in ("", ":") and char == ":":
            number = self._number(i + 1)
            if number is not None:
                token, end = number
                if frame.mode == "":  # [after:when]
                    return _Edit(None, part, token), end
                return _Edit(frame.parts[0], part, token), end  # [before:after:when]
            if frame.mode == "":
                frame.parts.append(part)
                frame.current, frame.mode = [], ":"
                return True
        return None

    def _number(self, i: int) -> tuple[str, int] | None:
        """``[WHITESPACE] NUMBER [WHITESPACE] "]"`` from ``i``: the number token and the index after ``]``."""
        text = self.text
        space = _WHITESPACE.match(text, i)
        if space:
            i = space.end()
        number = _NUMBER.match(text, i)
        if number is None:
            return None
        i = number.end()
        space = _WHITESPACE.match(text, i)
        if space:
            i = space.end()
        if i < len(text) and text[i] == "]":
            return number.group(0), i + 1
        return None

    def _fail(self, stack: list[_Frame]) -> None:
        # In the strict grammar an invalid inner group invalidates every group around it.
        for frame in stack:
            if frame.opening == "[":
                self.memo[frame.start] = None
        return None


def _groups(seq: _Seq) -> list[_Edit | _Alternate]:
    """Every editing and alternation group, in all branches (like lark's ``Visitor``), iteratively."""
    found: list[_Edit | _Alternate] = []
    stack: list = [seq]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, _Edit):
            found.append(node)
            stack.append(node.after)
            if node.before is not None:
                stack.append(node.before)
        elif isinstance(node, _Alternate):
            found.append(node)
            stack.extend(option for option in node.options if option is not None)
    return found


def _resolve_when(token: str, steps: int, int_offset: int, flt_offset: float, old: bool) -> int:
    """A1111's step for a ``when`` token (``CollectSteps.scheduled``), including ``int()`` truncation."""
    value = float(token)
    if old:
        value = value * steps if value < 1 else value
    elif "." in token:
        value = (value - flt_offset) * steps
    else:
        value = value - int_offset
    try:
        return min(steps, int(value))
    except OverflowError:
        raise PromptError(f"prompt editing step {token!r} is too large") from None


def _render(seq: _Seq, step: int) -> str:
    """The text of ``seq`` at (1-based) ``step``: A1111's ``AtStep`` transformer, iteratively."""
    out: list[str] = []
    stack: list = list(reversed(seq))
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, _Edit):
            chosen = (node.before or []) if step <= node.when else node.after
            stack.extend(reversed(chosen))
        else:
            option = node.options[(step - 1) % len(node.options)]
            stack.extend(reversed(option or []))
    return "".join(out)


def prompt_schedule(
    text: str, steps: int, *, hires_steps: int | None = None, use_old_scheduling: bool = False
) -> list[ScheduledPrompt]:
    """The texts a prompt takes over ``steps`` steps; follows A1111's ``get_learned_conditioning_prompt_schedules``.

    * ``[from:to:when]`` uses ``from`` up to step ``when`` and ``to`` after it; ``[to:when]`` adds
      ``to`` after ``when``; ``[from::when]`` removes ``from`` after ``when``. Groups nest.
    * ``when`` (A1111's default "new" timelines): a number written with a ``.`` is a fraction of
      ``steps`` (``0.25`` -> ``int(0.25 * steps)``; so ``1.5`` means ``1.5 * steps``, capped at
      ``steps``), any other number is a step count; both are truncated by ``int()`` and capped at
      ``steps``. With ``use_old_scheduling=True``: a value below 1 is a fraction, else a step count.
      With ``hires_steps`` (and new timelines) the schedule covers the hires pass: integers count
      from ``steps`` and fractions run from 1.0 to 2.0, over ``hires_steps`` steps. A ``when``
      below 1 after conversion never switches (the ``to`` text is used throughout).
    * ``[a|b|c]`` alternation takes ``a`` at step 1, ``b`` at 2, ... cycling; an empty
      alternative stands for nothing (``[fe|]male``). Any alternation gives one entry per step.
    * Each entry's text is evaluated at its ``end_at_step``; entries come in step order and the
      last ends at ``steps`` (``hires_steps`` when given). A prompt without editing, or one outside
      A1111's grammar (a stray ``|``, a trailing backslash, ``[a:b:c:3]``...), gives
      ``[ScheduledPrompt(steps, text)]`` with ``text`` unchanged.
    * Emphasis brackets and escapes are left in the texts for :func:`parse_attention`.

    Deviations: where lark's choice between a group and literal brackets depends on the process's
    hash seed (see :class:`_ScheduleParser`) we always take the group; A1111's doctest
    ``"a [{b|d{:.5] c"`` is stale (its grammar rejects the ``|``, so A1111 returns the prompt
    unchanged, as we do); ``steps < 1`` and a ``when`` that overflows ``int`` (``1e999``) raise
    :class:`PromptError` (A1111 does not check the one and crashes with ``OverflowError`` on the
    other); nesting has no depth limit (A1111 crashes with a RecursionError between 150 and 400 levels).
    """
    if steps < 1 or (hires_steps is not None and hires_steps < 1):
        raise PromptError(f"the number of steps must be at least 1, got {steps} (hires {hires_steps})")
    if hires_steps is None or use_old_scheduling:
        int_offset, flt_offset, total = 0, 0.0, steps
    else:
        int_offset, flt_offset, total = steps, 1.0, hires_steps

    try:
        tree = _ScheduleParser(text).parse()
    except _Unparseable:
        return [ScheduledPrompt(total, text)]

    ends = {total}
    for node in _groups(tree):
        if isinstance(node, _Edit):
            node.when = _resolve_when(node.number, total, int_offset, flt_offset, use_old_scheduling)
            if node.when >= 1:
                ends.add(node.when)
        else:
            ends.update(range(1, total + 1))

    return [ScheduledPrompt(end, _render(tree, end)) for end in sorted(ends)]


def text_at_step(schedule: list[ScheduledPrompt], step: int) -> str:
    """The text in force at 0-based sampler step ``step``; follows A1111's ``reconstruct_cond_batch``.

    A1111's denoiser counts its calls from 0 (``CFGDenoiser.step``, incremented after each call)
    and uses the first entry with ``step <= end_at_step``. So entry ``[3, t]`` covers steps 0..3,
    i.e. four sampler steps, and with ``[a|b]`` over 10 steps the texts are a, a, b, a, b, ...
    (entry 10 is never reached). A step past the last entry falls back to the *first* entry, as
    A1111's ``target_index = 0`` default does (it happens with samplers that call the model more
    than once per step, since A1111 counts calls, not steps).
    """
    if not schedule:
        raise PromptError("empty prompt schedule")
    for entry in schedule:
        if step <= entry.end_at_step:
            return entry.text
    return schedule[0].text


# ---------------------------------------------------------------------------------------------
# Extra networks: A1111 extra_networks.parse_prompt
# ---------------------------------------------------------------------------------------------

_NETWORK_TAG = re.compile(r"<(\w+):([^>]+)>")


@dataclass(frozen=True)
class NetworkTag:
    """One ``<kind:name[:field...]>`` tag (A1111's ``ExtraNetworkParams``).

    ``args`` holds every field after the name exactly as written (the weight field included);
    ``weight`` is the first *positional* field after the name as a float, 1.0 when there is none.
    Positional vs named follows A1111: a field that ``split("=", 2)`` cuts into exactly two parts is
    named (``te=0.5``), any other is positional.
    """

    kind: str
    name: str
    weight: float
    args: tuple[str, ...]

    @property
    def positional(self) -> tuple[str, ...]:
        """The positional fields after the name."""
        return tuple(arg for arg in self.args if len(arg.split("=", 2)) != 2)

    @property
    def named(self) -> dict[str, str]:
        """The ``key=value`` fields (A1111's ``ExtraNetworkParams.named``), e.g. ``te``/``unet``/``dyn`` for LoRA."""
        pairs = (arg.split("=", 2) for arg in self.args)
        return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "weight": self.weight, "args": list(self.args)}


def extract_networks(text: str) -> tuple[str, list[NetworkTag]]:
    """Remove the extra-network tags from ``text``; follows A1111's ``extra_networks.parse_prompt``.

    A tag is ``<`` + word characters + ``:`` + anything up to the next ``>``; its content after the
    kind is split at every ``:``. Each tag is replaced by nothing and the text around it is left
    as it is (``"a <lora:x:1> b"`` -> ``"a  b"``, two spaces). Tags are returned in order of
    appearance. A ``<`` that does not start such a tag is ordinary text.

    Deviation: A1111 calls ``float()`` on the weight only when the network is activated (an
    unknown kind is skipped, a bad number is reported and the network not applied); here a weight
    field that ``float`` rejects raises :class:`PromptError` naming the tag, whatever the kind.
    ``name`` is the first field as written (A1111's LoRA code takes the first positional one).
    """
    tags: list[NetworkTag] = []

    def take(match: re.Match) -> str:
        fields = match.group(2).split(":")
        name, args = fields[0], tuple(fields[1:])
        positional = [arg for arg in args if len(arg.split("=", 2)) != 2]
        weight = 1.0
        if positional:
            try:
                weight = float(positional[0])
            except ValueError:
                raise PromptError(
                    f"extra network tag {match.group(0)!r}: weight {positional[0]!r} is not a number"
                ) from None
        tags.append(NetworkTag(match.group(1), name, weight, args))
        return ""

    return _NETWORK_TAG.sub(take, text), tags


# ---------------------------------------------------------------------------------------------
# Description for `sdlite tokens`
# ---------------------------------------------------------------------------------------------

def describe(text: str, steps: int) -> dict:
    """A JSON-ready summary of how ``text`` is read, in A1111's order.

    ``{"networks": [tag dicts], "schedule": [{"end_at_step": n, "text": t}, ...],
    "parsed": [[piece, weight], ...]}`` -- tags are removed first, the rest is scheduled, and
    ``parsed`` is :func:`parse_attention` of the first scheduled text.
    """
    stripped, tags = extract_networks(text)
    schedule = prompt_schedule(stripped, steps)
    return {
        "networks": [tag.as_dict() for tag in tags],
        "schedule": [{"end_at_step": entry.end_at_step, "text": entry.text} for entry in schedule],
        "parsed": [[piece, weight] for piece, weight in parse_attention(schedule[0].text)],
    }
