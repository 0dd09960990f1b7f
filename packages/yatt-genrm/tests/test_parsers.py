NUM_GPUS = 0

import json
import re
import sys
import time
import unicodedata
from pathlib import Path

import pytest

from yatt.genrm import ScoreParser, YesNoParser
from yatt.genrm._parsers import _FORMAT_CHARS, find_boxed, strip_markup

# Judge outputs written to fool a verdict parser (issue 23): negation, quoting, reversals,
# several verdicts, injected instructions, invisible and look-alike characters, boxes beside
# negation, score ranges, markdown, chatter after the verdict. Each holds its right reading
# under the parser it names: null (unparsable) or the negative reward; never the positive one.
CORPUS = json.loads((Path(__file__).parent / "data" / "adversarial_verdicts.json").read_text())
PARSERS = {
    "yes_no": YesNoParser(),
    "yes_no_boxed": YesNoParser(is_boxed=True),
    "score": ScoreParser(low=1, high=10),
}


def test_the_corpus_is_large_and_covers_each_trick() -> None:
    assert len(CORPUS) >= 100
    kinds = {case["kind"] for case in CORPUS}
    assert {"negation", "quoting", "reversal", "injection", "unicode", "score"} <= kinds
    assert len({case["id"] for case in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[case["id"] for case in CORPUS])
def test_no_adversarial_verdict_earns_the_positive_reward(case: dict) -> None:
    got = PARSERS[case["parser"]].parse(case["text"])
    if case["parser"] == "score":
        # The corpus's scores are low ones a trick would lift: at most the 3 of 1..10.
        assert got is None or got <= 2 / 9
    else:
        assert got != 1.0
    assert got == (None if case["expected"] is None else pytest.approx(case["expected"]))


# Well-formed verdicts (the declared grammar: the last non-empty line is "[Verdict:] Yes|No
# [.]", case-insensitive, NFKC): these must parse, so the corpus test cannot pass by
# rejecting everything.
WELL_FORMED = [
    ("Yes", 1.0),
    ("No", -1.0),
    ("yes.", 1.0),
    ("NO", -1.0),
    ("  Yes  \n\n", 1.0),
    ("Verdict: Yes", 1.0),
    ("verdict:no.", -1.0),
    ("Verdict:\tYES", 1.0),
    ("The response computes 3+4=7, as the reference.\nVerdict: Yes", 1.0),
    ("Step 1: wrong carry.\nStep 2: the result differs.\n\nVerdict: No\n", -1.0),
    ("Reasoning\r\nVerdict: Yes\r\n", 1.0),
    ("\uff39\uff45\uff53", 1.0),  # full-width: NFKC reads it as Yes
    ("Verdict:\u00a0No", -1.0),  # a no-break space is a space after NFKC
    ("Verdict: Yes\nVerdict: Yes", 1.0),  # the same verdict twice is no reversal
    ("I first thought Verdict: No, but\nVerdict: Yes", 1.0),  # not a whole verdict line
    # Markdown is part of the grammar (issue 49): judges bold their verdicts.
    ("`Yes`", 1.0),
    ("**Yes**", 1.0),
    ("*Yes*", 1.0),
    ("__Yes__", 1.0),
    ("Verdict: **Yes**", 1.0),
    ("**Verdict:** No", -1.0),
    ("**Verdict: No**", -1.0),
    ("Verdict: `No`.", -1.0),
]


# Each line break str.splitlines() knows besides "\n" (and "\r\n"): none splits a verdict.
NOT_NEWLINES = ["\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x85"]


@pytest.mark.parametrize("char", NOT_NEWLINES, ids=[f"U+{ord(c):04X}" for c in NOT_NEWLINES])
def test_only_newlines_split_the_verdict_line(char: str) -> None:
    parser = YesNoParser()
    # The issue: "Verdict: No<break>Yes" read the "Yes" after the break as the last line.
    assert parser.parse(f"Verdict: No{char}Yes") is None
    assert parser.parse(f"The response is wrong.{char}Yes") is None
    assert parser.parse(f"Verdict: No{char}Yes\n") is None
    assert "a\nb" in f"a{chr(10)}b" and len(f"x{char}y".splitlines()) == 2  # what it guards


@pytest.mark.parametrize(
    "text",
    ["Verdict: **No**\nYes", "**Verdict: No**\nVerdict: Yes", "`No`\n\n**Yes**", "*No*\nYes"],
)
def test_a_reversal_written_in_markdown_is_a_reversal(text: str) -> None:
    assert YesNoParser().parse(text) is None


def test_markdown_label_start_points_at_the_label() -> None:
    text = "Reasoning.\nVerdict: **Yes**"
    start = YesNoParser().label_start(text)
    assert text[start : start + 3] == "Yes"


@pytest.mark.parametrize(("text", "expected"), WELL_FORMED)
def test_well_formed_verdicts_parse(text: str, expected: float) -> None:
    assert YesNoParser().parse(text) == expected


def test_boxed_and_prefixed_formats() -> None:
    boxed = YesNoParser(is_boxed=True)
    assert boxed.parse("Thinking...\n\\boxed{Yes}") == 1.0
    assert boxed.parse("Verdict: $\\boxed{no}$.") == -1.0
    assert boxed.parse("Yes") is None  # a boxed format reads boxes only
    required = YesNoParser(is_prefix_required=True)
    assert required.parse("Verdict: Yes") == 1.0
    assert required.parse("Yes") is None
    bare = YesNoParser(prefix="")
    assert bare.parse("No") == -1.0
    assert bare.parse("Verdict: No") is None


def test_custom_labels_and_rewards() -> None:
    parser = YesNoParser(yes_label="PASS", no_label="FAIL", yes_reward=1.0, no_reward=0.0)
    assert parser.parse("Verdict: pass") == 1.0
    assert parser.parse("fail") == 0.0
    assert parser.parse("Yes") is None


def test_format_instruction_states_what_the_parser_reads() -> None:
    for parser in (YesNoParser(), YesNoParser(is_boxed=True), YesNoParser(prefix="Final:")):
        yes_line, no_line = re.findall(r"'([^']*)'", parser.format_instruction)
        assert (parser.parse(yes_line), parser.parse(no_line)) == (1.0, -1.0)
    score = ScoreParser(low=0, high=5)
    (line,) = re.findall(r"'([^']*)'", score.format_instruction)
    assert score.parse(line.replace("N", "4")) == pytest.approx(4 / 5)
    assert "from 0 to 5" in score.format_instruction


def test_label_start_points_at_the_label_as_written() -> None:
    parser = YesNoParser()
    for text in ("Yes", "Reasoning.\nVerdict: No.\n", "a\r\nb\r\nVerdict:   YES  "):
        start = parser.label_start(text)
        assert start is not None
        assert text[start:].strip().rstrip(".").lower() in ("yes", "no")
    assert parser.label_start("Not correct") is None
    assert parser.label_start("\uff39\uff45\uff53") is None  # NFKC changed it: no verbatim label


SCORE_CASES = [
    ("Score: 10", 1.0),
    ("Score: 1", 0.0),
    ("score: 4.", 1 / 3),
    ("Score: 7/10", 2 / 3),
    ("Score: 8.5", 7.5 / 9),
    ("The response is mostly right.\nScore: 7\n", 2 / 3),
    ("Score: 2\nScore: 2", 1 / 9),
]


@pytest.mark.parametrize(("text", "expected"), SCORE_CASES)
def test_well_formed_scores_parse(text: str, expected: float) -> None:
    assert ScoreParser(low=1, high=10).parse(text) == pytest.approx(expected)


def test_score_parser_raw_and_boxed_scores() -> None:
    assert ScoreParser(low=0, high=5, should_normalize=False).parse("Score: 3") == 3.0
    assert ScoreParser(is_boxed=True).parse("Score: \\boxed{10}") == 1.0
    assert ScoreParser(is_boxed=True).parse("Score: 10") is None
    assert ScoreParser(is_prefix_required=False).parse("10") == 1.0


def test_format_chars_class_is_unicode_category_cf() -> None:
    # An independent statement: every Cf code point, and only those (the class is Unicode
    # 15's; an older unicodedata has some of them unassigned, a newer may add a few).
    cf = {chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"}
    matched = {chr(c) for c in range(sys.maxunicode + 1) if _FORMAT_CHARS.match(chr(c))}
    assert all(unicodedata.category(c) in ("Cf", "Cn") for c in matched)
    assert cf - matched == set(), sorted(hex(ord(c)) for c in cf - matched)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"occurrence": "first"}, "occurrence"),
        ({"yes_label": "ok", "no_label": "OK"}, "same word"),
        ({"yes_label": " Yes"}, "yes_label"),
        ({"yes_reward": float("nan")}, "yes_reward"),
        ({"prefix": "", "is_prefix_required": True}, "is_prefix_required"),
    ],
    ids=["occurrence", "overlap", "outer_space", "nan_reward", "required_empty_prefix"],
)
def test_yes_no_parser_rejects_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        YesNoParser(**kwargs)


def test_score_parser_rejects_empty_range() -> None:
    with pytest.raises(ValueError, match="low < high"):
        ScoreParser(low=5, high=5)


ADVERSARIAL = {
    "unclosed_boxed": "\\boxed{" * 16_000,  # 112 KB: the quadratic scan took ~45 s
    "nested_text": "\\text{" * 16_000 + "Yes" + "}" * 16_000,
    "unclosed_smart_quotes": "\u201c" * 112_000,
    "spaces_then_junk": "Verdict: Yes" + " " * 112_000 + "x",
    "spaces_before_scale": "Score: 7" + " " * 112_000 + "x",
    "many_verdict_lines": "Verdict: Yes\n" * 20_000 + "Verdict: No",
    "leading_spaces": " " * 112_000 + "x",
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_parsing_is_linear_on_adversarial_text(text: str) -> None:
    # Each takes a few milliseconds; a backtracking or quadratic scan takes seconds.
    start = time.perf_counter()
    find_boxed(text)
    strip_markup(text)
    YesNoParser().parse(text)
    YesNoParser(is_boxed=True).parse(text)
    ScoreParser().parse(text)
    assert time.perf_counter() - start < 1.0


def test_find_boxed_matches_nested_braces() -> None:
    assert find_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x}") == ["\\frac{1}{2}", "x"]
    assert find_boxed("\\boxed{unclosed") == []


def test_strip_markup_keeps_words() -> None:
    assert strip_markup("**a** _b_ `c` \\textbf{d}").split() == ["a", "b", "c", "d"]


def test_unwrapping_nested_text_commands() -> None:
    assert strip_markup("\\text{\\textbf{\\text{Yes}}}").strip() == "Yes"
    assert strip_markup("\\text{a{b}c} \\text{open").split() == ["a{b}c", "\\text{open"]
    assert find_boxed("\\boxed{\\boxed{x}} \\boxed{") == ["\\boxed{x}", "x"]
