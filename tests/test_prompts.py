"""Tests for sdlite.prompts: AUTOMATIC1111's prompt syntax.

Expected values are written out literally. They are A1111's: the doctests of its
``modules/prompt_parser.py`` and the output of its code (``parse_prompt_attention``,
``get_learned_conditioning_prompt_schedules`` with lark 1.1.2, ``extra_networks.parse_prompt``)
for the other cases.
"""

from __future__ import annotations

import json

import pytest

from sdlite.errors import SDLiteError
from sdlite.prompts import (
    NetworkTag,
    PromptError,
    ScheduledPrompt,
    describe,
    extract_networks,
    parse_attention,
    prompt_schedule,
    split_break,
    text_at_step,
)

TOL = 1e-9


def assert_pairs(got: list[tuple[str, float]], expected: list[list]) -> None:
    assert [text for text, _ in got] == [text for text, _ in expected]
    for (_, weight), (text, want) in zip(got, expected):
        assert weight == pytest.approx(want, abs=TOL), text


def sched(text: str, steps: int = 10, **kwargs) -> list[list]:
    return [[entry.end_at_step, entry.text] for entry in prompt_schedule(text, steps, **kwargs)]


# --------------------------------------------------------------------------------------------
# parse_attention: A1111's parse_prompt_attention doctests
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("normal text", [["normal text", 1.0]]),
        ("an (important) word", [["an ", 1.0], ["important", 1.1], [" word", 1.0]]),
        ("(unbalanced", [["unbalanced", 1.1]]),
        ("\\(literal\\]", [["(literal]", 1.0]]),
        ("(unnecessary)(parens)", [["unnecessaryparens", 1.1]]),
        (
            "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
            [
                ["a ", 1.0],
                ["house", 1.5730000000000004],
                [" ", 1.1],
                ["on", 1.0],
                [" a ", 1.1],
                ["hill", 0.55],
                [", sun, ", 1.1],
                ["sky", 1.4641000000000006],
                [".", 1.1],
            ],
        ),
    ],
)
def test_attention_a1111_doctests(text: str, expected: list[list]) -> None:
    assert_pairs(parse_attention(text), expected)


def test_attention_doctest_floats_are_bit_exact() -> None:
    # Products are formed in A1111's order, so even the rounding noise matches.
    got = dict(parse_attention("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky)))."))
    assert got["house"] == 1.5730000000000004
    assert got["sky"] == 1.4641000000000006


# --------------------------------------------------------------------------------------------
# parse_attention: corner cases (A1111's output)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("((a))", [["a", 1.2100000000000002]]),
        ("[[a]]", [["a", 0.8264462809917354]]),
        ("((a (b:1.5) c))", [["a ", 1.21], ["b", 1.815], [" c", 1.21]]),
        ("((a:2):3)", [["a", 6.0]]),
        ("\\(a\\)", [["(a)", 1.0]]),
        ("\\\\", [["\\", 1.0]]),
        ("(a", [["a", 1.1]]),
        ("[a", [["a", 0.9090909090909091]]),
        ("(a [b) c]", [["a ", 1.1], ["b", 1.0], [" c", 0.9090909090909091]]),
        (")a(", [[")a", 1.0]]),
        ("[a]]]", [["a", 0.9090909090909091], ["]]", 1.0]]),
        ("(a]", [["a]", 1.1]]),
        # [(c)] is 1.1 / 1.1 == 1.0 exactly, so it merges with the text before it
        ("[a] (b) [(c)]", [["a", 0.9090909090909091], [" ", 1.0], ["b", 1.1], [" c", 1.0]]),
        # a colon not followed by a number (and ")") is text
        ("(a: b)", [["a: b", 1.1]]),
        ("a:b", [["a:b", 1.0]]),
        ("(a:1.5", [["a:1.5", 1.1]]),
        ("a:1.5)", [["a:1.5)", 1.0]]),
        ("[a:1.5)", [["a:1.5)", 0.9090909090909091]]),
        # the weight is [+-]?[.\d]+ : no exponent, a trailing dot and signs are fine
        ("(a:1e1)", [["a:1e1", 1.1]]),
        ("(a:1.)", [["a", 1.0]]),
        ("(a:-0.5)", [["a", -0.5]]),
        ("(a:+2)", [["a", 2.0]]),
        ("(a:0)", [["a", 0.0]]),
        ("(a: 1.5 )", [["a", 1.5]]),
        ("(a:\t2\n)", [["a", 2.0]]),
        # BREAK
        ("BREAK", [["", 1.0], ["BREAK", -1.0], ["", 1.0]]),
        ("a BREAK b", [["a", 1.0], ["BREAK", -1.0], ["b", 1.0]]),
        ("a, BREAK, b", [["a,", 1.0], ["BREAK", -1.0], [", b", 1.0]]),
        ("a BREAK BREAK b", [["a", 1.0], ["BREAK", -1.0], ["", 1.0], ["BREAK", -1.0], ["b", 1.0]]),
        ("BREAKfast", [["BREAKfast", 1.0]]),
        ("a break b", [["a break b", 1.0]]),
        ("(BREAK)", [["", 1.1], ["BREAK", -1.1], ["", 1.1]]),
        ("x(a:BREAK)y", [["x", 1.0], ["a:", 1.1], ["BREAK", -1.1], ["", 1.1], ["y", 1.0]]),
        ("(a\nBREAK\nb)", [["a", 1.1], ["BREAK", -1.1], ["b", 1.1]]),
        # a backslash before anything else vanishes; a trailing one too
        ("a\\", [["a", 1.0]]),
        ("a \\ b", [["a  b", 1.0]]),
        ("a\\nb", [["anb", 1.0]]),
        ("", [["", 1.0]]),
    ],
)
def test_attention_corner_cases(text: str, expected: list[list]) -> None:
    assert_pairs(parse_attention(text), expected)


def test_attention_returns_tuples_of_str_and_float() -> None:
    result = parse_attention("a (b) BREAK c")
    assert all(isinstance(pair, tuple) and isinstance(pair[1], float) for pair in result)
    assert ("BREAK", -1.0) in result


@pytest.mark.parametrize("text", ["(a:1.2.3)", "(a:.)", "x (y:..5) z"])
def test_attention_unparseable_weight(text: str) -> None:
    # A1111 raises ValueError from float(); ours is a PromptError, which is one.
    with pytest.raises(PromptError, match="not a number"):
        parse_attention(text)
    assert issubclass(PromptError, SDLiteError) and issubclass(PromptError, ValueError)


def test_attention_malformed_weight_without_open_paren_is_text() -> None:
    assert_pairs(parse_attention("a:1.2.3)"), [["a:1.2.3)", 1.0]])


# --------------------------------------------------------------------------------------------
# split_break
# --------------------------------------------------------------------------------------------

def test_split_break() -> None:
    assert split_break(parse_attention("a (b) BREAK c")) == [[("a ", 1.0), ("b", 1.1), ("", 1.0)], [("c", 1.0)]]
    assert split_break(parse_attention("BREAK a")) == [[("", 1.0)], [("a", 1.0)]]
    assert split_break(parse_attention("no break")) == [[("no break", 1.0)]]
    # (BREAK) has weight -1.1, which A1111's tokenizer does not take as a break
    assert len(split_break(parse_attention("a (BREAK) b"))) == 1
    assert split_break([("a", 1.0), ("BREAK", -1.0), ("BREAK", -1.0), ("b", 1.0)]) == [
        [("a", 1.0)], [], [("b", 1.0)]
    ]


# --------------------------------------------------------------------------------------------
# prompt_schedule: A1111's get_learned_conditioning_prompt_schedules doctests (10 steps)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("test", [[10, "test"]]),
        ("a [b:3]", [[3, "a "], [10, "a b"]]),
        ("a [b: 3]", [[3, "a "], [10, "a b"]]),
        ("a [[[b]]:2]", [[2, "a "], [10, "a [[b]]"]]),
        ("[(a:2):3]", [[3, ""], [10, "(a:2)"]]),
        ("a [b : c : 1] d", [[1, "a b  d"], [10, "a  c  d"]]),
        ("a[b:[c:d:2]:1]e", [[1, "abe"], [2, "ace"], [10, "ade"]]),
        ("a [unbalanced", [[10, "a [unbalanced"]]),
        ("a [b:.5] c", [[5, "a  c"], [10, "a b c"]]),
        ("((a][:b:c [d:3]", [[3, "((a][:b:c "], [10, "((a][:b:c d"]]),
        (
            "[a|(b:1.1)]",
            [[1, "a"], [2, "(b:1.1)"], [3, "a"], [4, "(b:1.1)"], [5, "a"], [6, "(b:1.1)"], [7, "a"],
             [8, "(b:1.1)"], [9, "a"], [10, "(b:1.1)"]],
        ),
        (
            "[fe|]male",
            [[1, "female"], [2, "male"], [3, "female"], [4, "male"], [5, "female"], [6, "male"],
             [7, "female"], [8, "male"], [9, "female"], [10, "male"]],
        ),
        (
            "[fe|||]male",
            [[1, "female"], [2, "male"], [3, "male"], [4, "male"], [5, "female"], [6, "male"],
             [7, "male"], [8, "male"], [9, "female"], [10, "male"]],
        ),
    ],
)
def test_schedule_a1111_doctests(text: str, expected: list[list]) -> None:
    assert sched(text, 10) == expected


def test_schedule_a1111_stale_doctest() -> None:
    # A1111's docstring says [[5, 'a  c'], [10, 'a {b|d{ c']] ("not handling this right now"), but
    # since alternation exists its grammar rejects the "|", and its code returns the prompt unchanged.
    assert sched("a [{b|d{:.5] c", 10) == [[10, "a [{b|d{:.5] c"]]


def test_schedule_a1111_hires_doctests() -> None:
    assert sched("a [b:.5] c", 10, hires_steps=10) == [[10, "a b c"]]
    assert sched("a [b:1.5] c", 10, hires_steps=10) == [[5, "a  c"], [10, "a b c"]]


def test_schedule_a1111_comment_example() -> None:
    # The example in the comment at the top of A1111's prompt_parser.py (100 steps).
    text = ("fantasy landscape with a [mountain:lake:0.25] and [an oak:a christmas tree:0.75]"
            "[ in foreground::0.6][ in background:0.25] [shoddy:masterful:0.5]")
    assert sched(text, 100) == [
        [25, "fantasy landscape with a mountain and an oak in foreground shoddy"],
        [50, "fantasy landscape with a lake and an oak in foreground in background shoddy"],
        [60, "fantasy landscape with a lake and an oak in foreground in background masterful"],
        [75, "fantasy landscape with a lake and an oak in background masterful"],
        [100, "fantasy landscape with a lake and a christmas tree in background masterful"],
    ]


# --------------------------------------------------------------------------------------------
# prompt_schedule: more cases (A1111's output)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, steps, kwargs, expected",
    [
        ("a [b:c:3] d", 10, {}, [[3, "a b d"], [10, "a c d"]]),
        ("a [b:c:0.25] d", 10, {}, [[2, "a b d"], [10, "a c d"]]),  # int(2.5) == 2
        ("a [b::3]", 10, {}, [[3, "a b"], [10, "a "]]),  # [from::when]
        ("a [b:3]", 10, {}, [[3, "a "], [10, "a b"]]),  # [to:when]
        ("[a:b: 3 ]", 10, {}, [[3, "a"], [10, "b"]]),
        ("[a:b:+2]", 10, {}, [[2, "a"], [10, "b"]]),
        # new timelines: a "." makes it a fraction, even when >= 1; capped at steps
        ("a [b:1.5] c", 10, {}, [[10, "a  c"]]),
        ("a [b:2.0] c", 10, {}, [[10, "a  c"]]),
        ("[a:b:1.]", 10, {}, [[10, "a"]]),
        ("[a:b:1e1]", 10, {}, [[10, "a"]]),  # no "." -> a step count
        ("[a:b:1.e1]", 10, {}, [[10, "a"]]),
        # old timelines: below 1 is a fraction, else a step count
        ("a [b:1.5] c", 10, {"use_old_scheduling": True}, [[1, "a  c"], [10, "a b c"]]),
        ("a [b:0.5] c", 10, {"use_old_scheduling": True}, [[5, "a  c"], [10, "a b c"]]),
        ("[a:b:2.5]", 4, {"use_old_scheduling": True}, [[2, "a"], [4, "b"]]),
        # hires pass: integers count from the base steps, fractions run 1..2
        ("a [b:13] c", 10, {"hires_steps": 10}, [[3, "a  c"], [10, "a b c"]]),
        ("[a:b:6]", 4, {"hires_steps": 8}, [[2, "a"], [8, "b"]]),
        ("[a:b:1]", 4, {"hires_steps": 8}, [[8, "b"]]),
        ("[a:b:.25]", 4, {"hires_steps": 8}, [[8, "b"]]),
        # when < 1 after conversion never switches; beyond the steps never switches back
        ("[a:b:0]", 10, {}, [[10, "b"]]),
        ("[a:b:-1]", 10, {}, [[10, "b"]]),
        ("[a:b:0.05]", 10, {}, [[10, "b"]]),
        ("[a:b:20]", 10, {}, [[10, "a"]]),
        # steps = 1
        ("[a:b:0.5]", 1, {}, [[1, "b"]]),
        ("[a:b:1]", 1, {}, [[1, "a"]]),
        ("[a|b]", 1, {}, [[1, "a"]]),
        # alternation cycles over more steps than alternatives
        ("[a|b|c]", 7, {}, [[1, "a"], [2, "b"], [3, "c"], [4, "a"], [5, "b"], [6, "c"], [7, "a"]]),
        ("[a (b:1.2) | c]", 3, {}, [[1, "a (b:1.2) "], [2, " c"], [3, "a (b:1.2) "]]),
        # nesting
        ("[a:[b|c]:3]", 5, {}, [[1, "a"], [2, "a"], [3, "a"], [4, "c"], [5, "b"]]),
        ("[[a|b]:2]", 4, {}, [[1, ""], [2, ""], [3, "a"], [4, "b"]]),
        ("(x [a:b:2]) [c|d]", 4, {}, [[1, "(x a) c"], [2, "(x a) d"], [3, "(x b) c"], [4, "(x b) d"]]),
        # not editing: escaped, unclosed, not a number, or outside the grammar -> unchanged
        ("a \\[b:3\\] c", 10, {}, [[10, "a \\[b:3\\] c"]]),
        ("x [a:b:3", 10, {}, [[10, "x [a:b:3"]]),
        ("[a: b]", 10, {}, [[10, "[a: b]"]]),
        ("[a:1e]", 10, {}, [[10, "[a:1e]"]]),
        ("[a:b:c:3]", 10, {}, [[10, "[a:b:c:3]"]]),
        ("[a|b:3]", 4, {}, [[4, "[a|b:3]"]]),
        ("a|b [c:2]", 10, {}, [[10, "a|b [c:2]"]]),  # a "|" outside alternation
        ("a [c:2]\\", 10, {}, [[10, "a [c:2]\\"]]),  # a trailing backslash
        ("a\\\nb [c:2]", 3, {}, [[3, "a\\\nb [c:2]"]]),  # a backslash before a newline
    ],
)
def test_schedule_cases(text: str, steps: int, kwargs: dict, expected: list[list]) -> None:
    assert sched(text, steps, **kwargs) == expected


def test_schedule_hash_dependent_case_takes_the_group() -> None:
    # A group directly followed by lone brackets/colons: A1111's lark result depends on the
    # process's hash seed (either of these two); we always give the first.
    assert sched("[a:1]:2]", 10) == [[1, ":2]"], [10, "a:2]"]]
    assert sched("[a::3]:x", 10) == [[3, "a:x"], [10, ":x"]]


def test_schedule_returns_dataclasses() -> None:
    assert prompt_schedule("plain", 20) == [ScheduledPrompt(20, "plain")]
    assert prompt_schedule("", 5) == [ScheduledPrompt(5, "")]


def test_schedule_deep_nesting_and_long_prompts() -> None:
    deep = "[" * 3000 + "a:3" + "]" * 3000
    assert sched(deep, 10) == [[3, "[" * 2999 + "]" * 2999], [10, "[" * 2999 + "a" + "]" * 2999]]
    assert sched("[" * 5000, 10) == [[10, "[" * 5000]]
    assert len(prompt_schedule("[a|" * 2000 + "]" * 2000, 10)) == 10


def test_schedule_errors() -> None:
    with pytest.raises(PromptError):
        prompt_schedule("a", 0)
    with pytest.raises(PromptError, match="too large"):
        prompt_schedule("[a:b:1e999]", 10)


# --------------------------------------------------------------------------------------------
# text_at_step: A1111's reconstruct_cond_batch rule (0-based step <= end_at_step)
# --------------------------------------------------------------------------------------------

def test_text_at_step_boundaries() -> None:
    schedule = prompt_schedule("a [b:c:3] d", 10)
    assert [text_at_step(schedule, k) for k in range(10)] == ["a b d"] * 4 + ["a c d"] * 6
    assert text_at_step(schedule, 10) == "a c d"
    # past the last entry A1111 falls back to the first one (target_index = 0)
    assert text_at_step(schedule, 11) == "a b d"
    assert text_at_step(schedule, -1) == "a b d"


def test_text_at_step_alternation() -> None:
    schedule = prompt_schedule("[a|b]", 6)
    # entry 1 covers steps 0 and 1, entry k step k; entry 6 is never reached in 6 steps
    assert [text_at_step(schedule, k) for k in range(6)] == ["a", "a", "b", "a", "b", "a"]


def test_text_at_step_empty_schedule() -> None:
    with pytest.raises(PromptError):
        text_at_step([], 0)


# --------------------------------------------------------------------------------------------
# extract_networks: A1111's extra_networks.parse_prompt
# --------------------------------------------------------------------------------------------

def test_networks_removed_in_order_spaces_kept() -> None:
    text, tags = extract_networks("a <lora:x:0.8> b, <hypernet:y>c<lora:z_1:-1>")
    assert text == "a  b, c"
    assert tags == [
        NetworkTag("lora", "x", 0.8, ("0.8",)),
        NetworkTag("hypernet", "y", 1.0, ()),
        NetworkTag("lora", "z_1", -1.0, ("-1",)),
    ]


def test_networks_extra_args_kept_raw() -> None:
    _, [tag] = extract_networks("<lora:x:0.5:te=1:unet=0.3:16>")
    assert tag == NetworkTag("lora", "x", 0.5, ("0.5", "te=1", "unet=0.3", "16"))
    assert tag.named == {"te": "1", "unet": "0.3"}
    assert tag.positional == ("0.5", "16")
    # named fields are not the weight: the first positional one is
    _, [tag] = extract_networks("<lora:x:te=0.7>")
    assert (tag.weight, tag.named) == (1.0, {"te": "0.7"})
    _, [tag] = extract_networks("<lora:x:te=0.7:0.25>")
    assert tag.weight == 0.25


@pytest.mark.parametrize("bad", ["<lora:x:abc>", "<lora:x:0.5.1:te=1>", "<lora:x:>"])
def test_networks_bad_weight(bad: str) -> None:
    with pytest.raises(PromptError) as info:
        extract_networks(f"a {bad} b")
    assert bad in str(info.value)


@pytest.mark.parametrize(
    "text",
    ["a < b > c", "1 <3", "x<y", "<lora:x", "< lora:x:1>", "<lo-ra:x:1>", "<lora>", "a <> b"],
)
def test_networks_other_angle_brackets_left_alone(text: str) -> None:
    assert extract_networks(text) == (text, [])


def test_networks_tag_content_runs_to_the_next_gt() -> None:
    # [^>]+ spans anything, "<" and newlines included, as in A1111
    text, [tag] = extract_networks("<lora:a\nb:1> rest")
    assert (text, tag.name, tag.weight) == (" rest", "a\nb", 1.0)


# --------------------------------------------------------------------------------------------
# describe
# --------------------------------------------------------------------------------------------

def test_describe() -> None:
    info = describe("a <lora:x:0.5> [(cat:1.2)|dog] BREAK end", 3)
    assert info == {
        "networks": [{"kind": "lora", "name": "x", "weight": 0.5, "args": ["0.5"]}],
        "schedule": [
            {"end_at_step": 1, "text": "a  (cat:1.2) BREAK end"},
            {"end_at_step": 2, "text": "a  dog BREAK end"},
            {"end_at_step": 3, "text": "a  (cat:1.2) BREAK end"},
        ],
        "parsed": [["a  ", 1.0], ["cat", 1.2], ["", 1.0], ["BREAK", -1.0], ["end", 1.0]],
    }
    assert json.loads(json.dumps(info)) == info
