import json
import time

import pytest

from shared.reward import extract_answer, normalize_number, verify


def _gsm8k_test(gsm8k_dir):
    with open(gsm8k_dir / "test.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_all_gsm8k_reference_solutions_score_one(gsm8k_dir):
    rows = _gsm8k_test(gsm8k_dir)
    assert len(rows) == 1319
    final = [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    scores = [verify(r["answer"], ans) for r, ans in zip(rows, final, strict=True)]
    assert sum(scores) == 1319


def test_perturbed_answers_score_zero(gsm8k_dir):
    rows = _gsm8k_test(gsm8k_dir)
    for r in rows:
        solution, ans = r["answer"].rsplit("####", 1)
        wrong = str(int(ans.strip().replace(",", "")) + 1)
        assert verify(f"{solution}#### {wrong}", r["answer"]) == 0.0, r["answer"]


EDGE_CASES = {
    "hashes": ("so the total is 5 #### 72", "72"),
    "hashes_beat_boxed": ("\\boxed{3} ... #### 4", "4"),
    "hashes_commas": ("#### 1,000", "1000"),
    "hashes_dollar": ("#### $1,234.00", "1234"),
    "hashes_negative": ("#### -5", "-5"),
    "hashes_unicode_minus": ("#### −7", "-7"),
    "hashes_trailing_period": ("#### 18.", "18"),
    "float_equals_int": ("#### 18.0", "18"),
    "decimal_kept": ("#### 2.50", "2.5"),
    "leading_zeros": ("#### 007", "7"),
    "plus_sign": ("#### +3", "3"),
    "last_hashes_wins": ("#### 1\nwait, actually\n#### 2", "2"),
    "hashes_without_number_falls_back": ("the answer is 9\n####", "9"),
    "hashes_then_text_then_number": ("#### unknown, maybe 4", "4"),  # falls back to the last number
    "boxed": ("The answer is \\boxed{42}.", "42"),
    "boxed_nested": ("\\boxed{\\frac{1}{2} + \\boxed{8}}", "8"),
    "boxed_text": ("\\boxed{\\text{12 apples}}", "12"),
    "boxed_last_one": ("\\boxed{1} then \\boxed{2}", "2"),
    "boxed_unclosed_falls_back": ("\\boxed{12 and then 13", "13"),
    "last_number": ("She has 3 apples and buys 4, so 7 in total.", "7"),
    "think_block_skipped": ("<think>maybe #### 3</think> The answer is #### 5", "5"),
    "think_without_answer_after": ("<think>#### 3</think> I am not sure", None),
    "no_open_think_needed": ("pre-filled reasoning 3 4 </think> #### 12", "12"),
    "fullwidth_digits": ("#### １２", "12"),
    "arabic_indic_digits": ("#### ٤٢", "42"),
    "no_digits": ("I don't know.", None),
    "empty": ("", None),
    "zero_negative": ("#### -0", "0"),
    "decimal_only": ("#### .5", "0.5"),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_extract_answer_edge_cases(name):
    text, expected = EDGE_CASES[name]
    assert extract_answer(text) == expected


def test_verify_edge_cases():
    assert verify("#### 1000", "1,000") == 1.0
    assert verify("#### 1000.00", "#### 1,000") == 1.0
    assert verify("#### 999", "1000") == 0.0
    assert verify("no answer", "5") == 0.0
    assert verify("#### 5", "no reference number") == 0.0
    assert verify(None, "5") == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "9" * 100_000,
        "#### " + "9" * 100_000,
        "1," * 50_000,
        "\\boxed{" * 20_000 + "5",
        "\\boxed{" * 20_000 + "}" * 20_000,
        "#### " * 30_000,
        "٣" * 100_000,
        "x" * 1_000_000,
        "-" * 100_000 + "1",
    ],
    ids=[
        "100k_digits",
        "hashes_100k_digits",
        "commas",
        "open_boxes",
        "nested_boxes",
        "many_hashes",
        "unicode_digits",
        "million_letters",
        "dashes",
    ],
)
def test_pathological_inputs_are_fast_and_total(text):
    t0 = time.perf_counter()
    answer = extract_answer(text)
    reward = verify(text, "5")
    elapsed = time.perf_counter() - t0
    assert answer is None or isinstance(answer, str)
    assert reward in (0.0, 1.0)
    assert elapsed < 2.0, f"{elapsed:.2f}s"  # a stall would take minutes; typical is a few ms


def test_hundred_thousand_digits_are_compared_exactly():
    big = "9" * 100_000
    assert extract_answer(big) == big  # no int() conversion, no 4300-digit limit
    assert verify(big, big) == 1.0
    assert verify(big, big[:-1] + "8") == 0.0


def test_normalize_number():
    assert normalize_number("$1,000.50") == "1000.5"
    assert normalize_number("-018.0") == "-18"
    assert normalize_number("abc") is None
    assert normalize_number(".") is None
