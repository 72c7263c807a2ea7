"""format_reward and the answer-extraction helpers."""
import fractions

import pytest

from rollouts_jax import rewards


@pytest.mark.parametrize("completion,think_answer,answer_tag", [
    ("<think>3+5=8</think><answer>8</answer>", 1.0, 1.0),
    ("  <think>\n3+5=8\n</think>\n\n<answer> 8 </answer>\n", 1.0, 1.0),
    ("3+5=8</think>\n<answer>8</answer>", 1.0, 1.0),        # <think> was in the prompt
    ("<think>3+5=8</think><answer>8</answer> trailing", 0.0, 0.0),
    ("<think></think><answer>8</answer>", 0.0, 1.0),        # empty thinking
    ("<think>x</think><answer>  </answer>", 0.0, 0.0),      # empty answer
    ("<think>x</think><answer>8</answer><answer>9</answer>", 0.0, 0.0),
    ("<answer>8</answer><think>x</think>", 0.0, 0.0),
    ("<think>x</think><think>y</think><answer>8</answer>", 0.0, 1.0),
    ("text <think>x</think><answer>8</answer>", 0.0, 1.0),  # <think> not at the start
    ("<think>x<answer>8</answer></think>", 0.0, 0.0),
    ("The answer is 8.", 0.0, 0.0),
])
def test_format_styles(completion, think_answer, answer_tag):
    assert rewards.format_reward(completion) == think_answer
    assert rewards.format_reward(completion, None, style="answer_tag") == answer_tag
    assert rewards.get_reward_fn("format")(completion, None) == think_answer


def test_boxed_style_and_errors():
    assert rewards.format_reward(r"so \boxed{\frac{1}{2}}", style="boxed") == 1.0
    assert rewards.format_reward(r"so \boxed{}", style="boxed") == 0.0
    assert rewards.format_reward(r"so \boxed{\frac{1}{2}", style="boxed") == 0.0
    with pytest.raises(ValueError, match="unknown format style"):
        rewards.format_reward("x", style="xml")


def _best_times(*fns, repeats=3):
    """The fastest of `repeats` runs of each function, the functions alternating."""
    import time
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _long_completion(k):
    return "<think>" + "a<b " * k + "</think><answer>1</answer>"


def test_long_completion_is_linear_time():
    for k in (12500, 50000):
        assert rewards.format_reward(_long_completion(k)) == 1.0
        assert rewards.format_reward(_long_completion(k) + "</answer>") == 0.0
    small, large = _long_completion(12500), _long_completion(50000)
    t_small, t_large = _best_times(lambda: rewards.format_reward(small), lambda: rewards.format_reward(large))
    # 4x the text: linear time gives ~4x, quadratic ~16x.
    assert t_large < 8 * t_small, (t_small, t_large)


@pytest.mark.parametrize("text,expected", [
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"first \boxed{1} then \boxed{ {2}+1 }", "{2}+1"),
    (r"\fbox{7} and later \boxed{8}", "8"),
    (r"\boxed{8} and later \fbox{7}", "7"),
    (r"\boxed 42 apples", "42"),
    (r"\boxed{3} then an unclosed \boxed{4", "3"),
    (r"\boxedx{3}", None),
    ("nothing", None),
])
def test_find_boxed(text, expected):
    assert rewards.find_boxed(text) == expected


def test_extract_answer_kinds():
    text = "Work: 2 + 3 = 5.\n<answer> 5 </answer>\n#### 1,000\nso $\\boxed{\\dfrac{1}{2}}$ or 7"
    assert rewards.extract_answer(text, "boxed") == r"\frac{1}{2}"
    assert rewards.extract_answer(text, "boxed", normalize=False) == r"\dfrac{1}{2}"
    assert rewards.extract_answer(text, "answer_tag") == "5"
    assert rewards.extract_answer(text, "hash") == "1000"
    assert rewards.extract_answer(text, "gsm8k") == "1000"
    assert rewards.extract_answer(text, "last_number") == "7"
    assert rewards.extract_answer(text, "auto") == r"\frac{1}{2}"
    assert rewards.extract_answer("only 3 and 4", "auto") == "4"
    assert rewards.extract_answer("no digits", "auto") is None
    assert rewards.extract_answer(None, "boxed") is None
    assert rewards.extract_answers(["#### 3", "x"], "hash") == ["3", None]
    with pytest.raises(ValueError, match="unknown answer kind"):
        rewards.extract_answer("x", "latex")


@pytest.mark.parametrize("raw,normalized", [
    ("1,000", "1000"), ("1000.00", "1000"), (".50", "0.5"), ("-0.0", "0"), ("$18", "18"),
    (r"\$18.90", "18.9"), (r"\dfrac{1}{2}", r"\frac{1}{2}"), (r"\left( 1, 2 \right)", "(1,2)"),
    ("90^\\circ", "90"), ("90°", "90"), (r"\text{Evelyn}", "Evelyn"), ("x = 5.", "x=5"),
    ("  ", None), (None, None),
])
def test_normalize_answer(raw, normalized):
    assert rewards.normalize_answer(raw) == normalized


def test_numbers_and_parsing():
    from rollouts_jax.rewards.extract import find_numbers
    assert find_numbers("a 1,234,567 b 12,34 c -5 d 3-2 e .5 f x2") == [
        "1,234,567", "12", "34", "-5", "3", "2", ".5"]
    assert rewards.parse_number("3/4") == fractions.Fraction(3, 4)
    assert rewards.parse_number("12%") == 12
    assert rewards.parse_number(27.0) == 27
    for bad in ("", "abc", "1/0", "1.2.3", True, None, float("nan")):
        assert rewards.parse_number(bad) is None


DEGENERATE = {
    "open_boxed": lambda k: "\\boxed{" * k,
    "open_answer": lambda k: "<answer>" * k + "7",
    "deep_braces": lambda k: "{" * (5 * k // 2) + "\\boxed{1" + "}" * 10,
    "hashes": lambda k: "#### " * k,
    "commas": lambda k: "1," * (5 * k // 2),
}


def _score_everything(text):
    for kind in rewards.ANSWER_KINDS:
        rewards.extract_answer(text, kind)
    rewards.gsm8k_reward(text, "1")
    rewards.countdown_reward(text, ([1, 2], 3))
    rewards.format_reward(text)


@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_degenerate_repetitions_are_linear_time(name):
    small, large = DEGENERATE[name](5000), DEGENERATE[name](20000)
    t_small, t_large = _best_times(lambda: _score_everything(small), lambda: _score_everything(large))
    # 4x the text: linear time gives ~4x, quadratic (backtracking) ~16x.
    assert t_large < 8 * t_small, (t_small, t_large)


def test_degenerate_boxed_answers():
    assert rewards.find_boxed("\\boxed{" * 20000) is None
    assert rewards.find_boxed("{" * 50000 + "\\boxed{1" + "}" * 10) == "1"


def test_answer_tag_takes_the_innermost_last_block():
    assert rewards.find_answer_tag("<answer>1</answer> then <ANSWER> 2 </Answer>") == "2"
    assert rewards.find_answer_tag("<answer> a <answer> b </answer>") == "b"
    assert rewards.find_answer_tag("<answer>1</answer><answer>2") == "1"
    assert rewards.find_answer_tag("</answer><answer>") is None
