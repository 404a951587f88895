"""The built-in verifiers (hybridflow.reward.scorers) in verl's per-sample signature."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridflow.errors import ConfigError
from hybridflow.reward.scorers import SCORERS, countdown, default, gsm8k, scorer_target
from hybridflow.reward.scorers import math as boxed

# The math scorer needs the `math` extra (in `dev` too); the others run without it.
needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="pip install 'hybridflow[math]'"
)


def gsm(solution: str, truth: str = "72", extra_info: dict | None = None, **kw) -> dict:
    return gsm8k.compute_score("openai/gsm8k", solution, truth, extra_info, **kw)


def mth(solution: str, truth: str, **kw) -> dict:
    return boxed.compute_score("lighteval/MATH", solution, truth, **kw)


def cd(solution: str, target: int = 24, numbers: tuple[int, ...] = (3, 4, 5, 6), **kw) -> dict:
    truth = {"target": target, "numbers": list(numbers)}
    return countdown.compute_score("countdown", solution, truth, **kw)


# ---- gsm8k -------------------------------------------------------------------------------


def test_gsm8k_result_shape():
    out = gsm("so #### 72")
    assert out == {"score": 1.0, "acc": 1.0, "pred": "72"}
    assert all(type(out[k]) is float for k in ("score", "acc"))


def test_gsm8k_strict_needs_the_marker_flexible_does_not():
    text = "She sold 48 in April and 24 in May, 72 in all."
    assert gsm(text) == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert gsm(text, method="flexible") == {"score": 1.0, "acc": 1.0, "pred": "72"}


def test_gsm8k_flexible_takes_the_last_number():
    out = gsm("72 is wrong; it is 70", method="flexible")
    assert (out["acc"], out["pred"]) == (0.0, "70")


def test_gsm8k_the_last_marker_wins():
    text = "first guess #### 70\nno wait\n#### 72"
    assert gsm(text)["acc"] == 1.0
    assert gsm(text, "70") == {"score": 0.0, "acc": 0.0, "pred": "72"}


@pytest.mark.parametrize(
    ("solution", "truth", "pred"),
    [
        ("#### 1,234", "1234", "1234"),
        ("#### 1234", "1,234", "1234"),
        ("#### $18", "18", "18"),
        ("####$18.", "18", "18"),
        ("#### 5.0", "5", "5"),
        ("#### -3", "-3", "-3"),
        ("#### 0.50", ".5", "0.5"),
    ],
)
def test_gsm8k_commas_dollars_and_numeric_equality(solution, truth, pred):
    assert gsm(solution, truth) == {"score": 1.0, "acc": 1.0, "pred": pred}


def test_gsm8k_pred_is_the_same_for_equal_answers():
    # maj@n votes on pred: one answer written two ways must be one vote.
    assert gsm("#### 1,234")["pred"] == gsm("#### 1234.0")["pred"]


def test_gsm8k_ground_truth_may_be_the_full_solution():
    truth = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"
    assert gsm("#### 72", truth)["acc"] == 1.0
    assert gsm("#### 24", truth)["acc"] == 0.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 72", 72)["acc"] == 1.0


def test_gsm8k_no_number_is_zero_and_empty_pred():
    for method in gsm8k.METHODS:
        assert gsm("I do not know.", method=method) == {"score": 0.0, "acc": 0.0, "pred": ""}


def test_gsm8k_scores_and_format_score():
    assert gsm("#### 71", format_score=0.1)["score"] == 0.1
    assert gsm("#### 72", score=2.0)["score"] == 2.0
    assert gsm("no answer", format_score=0.1)["score"] == 0.0  # format_score needs an answer


def test_gsm8k_positional_verl_call_and_extra_info_options():
    # verl calls compute_score(data_source, solution_str, ground_truth, extra_info).
    out = gsm8k.compute_score("openai/gsm8k", "it is 72", "72", {"method": "flexible"})
    assert out["acc"] == 1.0
    # The sample's extra_info beats the keyword default.
    out = gsm("#### 71", extra_info={"format_score": 0.3}, format_score=0.1)
    assert out["score"] == 0.3
    # Unrelated extra_info keys (verl puts split/index there) are ignored.
    assert gsm("#### 72", extra_info={"split": "train", "index": 3})["acc"] == 1.0


@pytest.mark.parametrize(
    "kw", [{"method": "lenient"}, {"format_score": "0.1"}, {"score": float("nan")}, {"score": True}]
)
def test_gsm8k_bad_options_raise(kw):
    with pytest.raises(ValueError):
        gsm("#### 72", **kw)


def test_gsm8k_rejects_a_non_string_response():
    with pytest.raises(TypeError, match="solution_str"):
        gsm8k.compute_score("openai/gsm8k", None, "72")


def test_gsm8k_long_response_reads_only_the_tail():
    noise = "1,2,3 " * 50_000  # 300k characters of digits and commas
    t0 = time.perf_counter()
    assert gsm(noise + "so #### 72")["acc"] == 1.0
    assert time.perf_counter() - t0 < 1.0
    # Like verl: an answer further than ~300 characters from the end does not count.
    assert gsm("#### 72" + "." * 400)["pred"] == ""


def test_gsm8k_clip_does_not_cut_the_answer_in_half():
    text = "#### 123456" + "x" * 297  # the 300-character window starts inside the number
    assert len(text) - text.index("456") == 300
    assert gsm(text, "123456") == {"score": 1.0, "acc": 1.0, "pred": "123456"}


# ---- math --------------------------------------------------------------------------------


@needs_math_verify
@pytest.mark.parametrize(
    ("solution", "truth"),
    [
        (r"so \boxed{\frac12}", "0.5"),
        (r"so \boxed{\frac{1}{2}}", r"\frac12"),
        (r"so \boxed{0.5}", r"\frac{1}{2}"),
        (r"so \boxed{\dfrac{1}{2}}.", "1/2"),
        (r"$\boxed{\sqrt{2}}$", r"\sqrt2"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt 3}{2}"),
        (r"\boxed{1+x}", "x+1"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})"),
        (r"\boxed{10\%}", "0.1"),
        (r"\boxed{12\text{ cm}}", "12"),
        (r"\boxed{90^\circ}", "90"),
    ],
)
def test_math_equal_forms_verify(solution, truth):
    assert mth(solution, truth)["acc"] == 1.0
    assert mth(solution, truth)["score"] == 1.0


@needs_math_verify
@pytest.mark.parametrize(
    ("solution", "truth"),
    [
        # math-verify's README example (the gold first: verify is asymmetric).
        (r"The answer is $\boxed{\{1,2,3,4\}}$", r"{1,3} \cup {2,4}"),
        (r"The answer is $\boxed{\{1,2,3,4\}}$", r"\{1,3\} \cup \{2,4\}"),
        # math-verify's docstring examples: a rational, a float to 6 places.
        (r"The answer is $\boxed{\frac{1}{2}}$", "1/2"),
        (r"\boxed{0.333333}", r"\frac{1}{3}"),
    ],
)
def test_math_verify_readme_cases(solution, truth):
    assert mth(solution, truth)["acc"] == 1.0


@needs_math_verify
def test_math_nested_braces_and_pred():
    out = mth(r"Thus $x = \boxed{\frac{\sqrt{2}}{2}}$.", r"\frac{\sqrt{2}}{2}")
    assert out == {"score": 1.0, "acc": 1.0, "pred": r"\frac{\sqrt{2}}{2}"}
    # maj@n: one value written two ways is one vote.
    assert mth(r"\boxed{\frac12}", "1")["pred"] == mth(r"\boxed{\dfrac{1}{2}}", "1")["pred"]


@needs_math_verify
def test_math_wrong_answer_is_zero():
    assert mth(r"\boxed{3}", "2") == {"score": 0.0, "acc": 0.0, "pred": "3"}
    assert mth(r"\boxed{(2,1)}", "(1,2)")["acc"] == 0.0  # an ordered pair is not a set
    assert mth(r"\boxed{3}", "2", format_score=0.1)["score"] == 0.1


@needs_math_verify
def test_math_missing_or_broken_box_is_zero():
    assert mth("The answer is 5.", "5") == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert mth(r"\boxed{}", "5")["pred"] == ""
    # A truncated rollout: the last box is unclosed, the earlier one is not used instead.
    assert mth(r"\boxed{5} hmm, rather \boxed{\frac{1}{", "5") == {
        "score": 0.0,
        "acc": 0.0,
        "pred": "",
    }


@needs_math_verify
def test_math_the_last_box_wins_and_other_forms():
    assert mth(r"\boxed{5} no: \boxed{6}", "6")["acc"] == 1.0
    assert mth(r"\boxed{5} no: \boxed{6}", "5")["acc"] == 0.0
    assert mth(r"so $\boxed 5$ done", "5") == {"score": 1.0, "acc": 1.0, "pred": "5"}
    assert mth(r"\boxed{4} then \fbox{5}", "5")["acc"] == 1.0


@needs_math_verify
def test_math_ground_truth_may_be_a_boxed_solution():
    truth = r"Adding, we get $2+3=\boxed{5}$."
    assert mth(r"\boxed{5}", truth)["acc"] == 1.0
    assert mth(r"\boxed{2}", truth)["acc"] == 0.0


@needs_math_verify
def test_math_string_fallback_catches_what_math_verify_misses():
    # math-verify reads `3\,000` as something else than 3000; the normalisation agrees.
    mv = boxed._math_verify()
    gold, pred = list(boxed._parse(r"3\,000")), list(boxed._parse("3000"))
    assert not mv.verify(gold, pred, timeout_seconds=None)
    assert mth(r"\boxed{3\,000}", "3000")["acc"] == 1.0


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (r"\frac12", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^{\circ}", "90"),
        (r"5\text{ m}^2", "5"),
        (r"\text{Monday}", "Monday"),
        (r"x = 5", "5"),
        (r"1,000", "1000"),
        (r"1,2", "1,2"),
        ("5.0", "5"),
        (r"50\%", "50"),
        (r"\$4.50.", "4.5"),
        (r"3\!\,000", "3000"),
    ],
)
def test_math_normalize_answer(raw, normal):
    assert boxed.normalize_answer(raw) == normal


@needs_math_verify
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "answer", [r"9^{9^{9^{9}}}", r"2^{2^{30}}", r"(10^{6})!", r"\binom{1000000}{500000}"]
)
def test_math_answers_that_hang_sympy_are_not_given_to_it(answer):
    # Each of these keeps math-verify busy for minutes (seen); a worker thread could not
    # be stopped, so they must be judged by string alone, at once.
    t0 = time.perf_counter()
    assert mth(rf"\boxed{{{answer}}}", "5") == {"score": 0.0, "acc": 0.0, "pred": answer}
    assert mth(rf"\boxed{{{answer}}}", answer)["acc"] == 1.0
    assert time.perf_counter() - t0 < 5.0


@needs_math_verify
def test_math_runs_in_a_worker_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; the
    # scorer must turn them off. (Inputs unique to this test: the parse cache is cold.)
    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(mth, r"\boxed{\frac{7}{8}}", "0.875").result()
    assert out["acc"] == 1.0


def test_math_without_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import` fail
    boxed._math_verify.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'hybridflow\[math\]'"):
            mth("no box at all", "5")
    finally:
        boxed._math_verify.cache_clear()


# ---- countdown ---------------------------------------------------------------------------


def test_countdown_correct():
    text = "<think>8 * 4 = 32, 32 - 8 = 24</think> <answer>(6 - 3 + 5) * 4 - 8</answer>"
    assert cd(text, 24, (3, 4, 5, 6, 8)) == {"score": 1.0, "acc": 1.0, "pred": "(6-3+5)*4-8"}
    out = cd("<answer> 4 * (5 + 6 - 3) - 8 </answer>", 24, (3, 4, 5, 6, 8))
    assert out == {"score": 1.0, "acc": 1.0, "pred": "4*(5+6-3)-8"}


def test_countdown_exact_division():
    # (6/4)*4 is 6 exactly; float arithmetic would need a tolerance.
    assert cd("<answer>(6/4)*4*4</answer>", 24, (6, 4, 4, 4))["acc"] == 1.0
    assert cd("<answer>(1/3)*3*8</answer>", 8, (1, 3, 3, 8))["acc"] == 1.0


def test_countdown_wrong_value_gets_the_format_score():
    assert cd("<answer>3 + 4 + 5 + 6</answer>") == {"score": 0.1, "acc": 0.0, "pred": "3+4+5+6"}
    assert cd("<answer>3 + 4 + 5 + 6</answer>", format_score=0.0)["score"] == 0.0


@pytest.mark.parametrize(
    "equation",
    [
        "(6 - 3) * 4 * 2",  # 24, but 2 is not given (and 5 unused)
        "6 * 4 * (5 - 3) / 2",  # 2 not given
        "(6 + 6) * (5 - 3)",  # 6 used twice, 4 unused
        "6 * 4",  # 3 and 5 unused
        "6 * 4 * 1 * (5 - 3 - 1)",  # 1 not given, and twice
    ],
)
def test_countdown_numbers_must_be_the_given_multiset(equation):
    out = cd(f"<answer>{equation}</answer>")
    assert (out["score"], out["acc"]) == (0.1, 0.0)


def test_countdown_a_repeated_given_number_may_be_used_as_often_as_given():
    assert cd("<answer>(6 + 6) * (4 - 2)</answer>", 24, (6, 6, 4, 2))["acc"] == 1.0
    assert cd("<answer>(6 + 6) * (4 - 2) * 6 / 6</answer>", 24, (6, 6, 4, 2))["acc"] == 0.0


def test_countdown_last_answer_wins():
    text = "<answer>3+4+5+6</answer> no: <answer>(6 - 3 + 5) * 4 - 8</answer>"
    assert cd(text, 24, (3, 4, 5, 6, 8))["acc"] == 1.0


@pytest.mark.parametrize(
    "equation",
    [
        "__import__('os').system('echo pwned')",
        "(lambda: 24)()",
        "6 ** 4",
        "24 if True else 0",
        "[6, 4, 5, 3]",
        "x * 4",
        "6.0 * 4",
        "(6 - 3 + 5) * 4 = 32",
        "(" * 300 + "1" + ")" * 300,
        "",
    ],
)
def test_countdown_non_arithmetic_is_zero_and_never_run(equation, capfd):
    out = cd(f"<answer>{equation}</answer>")
    assert out == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert "pwned" not in capfd.readouterr().out


def test_countdown_evaluate_never_calls_eval(monkeypatch):
    import builtins

    def no_eval(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    value, used = countdown.evaluate("(6 - 3 + 5) * 4 - 8")
    assert (value, sorted(used)) == (24, [3, 4, 5, 6, 8])


def test_countdown_division_by_zero_is_a_wrong_equation():
    out = cd("<answer>6 * 4 / (5 - 5) + 3 - 3</answer>", 24, (6, 4, 5, 5, 3, 3))
    assert out == {"score": 0.1, "acc": 0.0, "pred": "6*4/(5-5)+3-3"}
    assert countdown.evaluate("1/0") == (None, [1, 0])


def test_countdown_no_answer_tag_is_zero():
    assert cd("(6 - 3 + 5) * 4 - 8") == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert cd("<answer>(6 - 3 + 5) * 4 - 8") == {"score": 0.0, "acc": 0.0, "pred": ""}


def test_countdown_ground_truth_forms():
    text = "<answer>(6 - 3 + 5) * 4 - 8</answer>"
    as_json = json.dumps({"target": 24, "numbers": [3, 4, 5, 6, 8]})
    assert countdown.compute_score("countdown", text, as_json)["acc"] == 1.0
    np = pytest.importorskip("numpy")  # a parquet-loaded row carries numpy integers
    truth = {"target": np.int64(24), "numbers": np.array([3, 4, 5, 6, 8])}
    assert countdown.compute_score("countdown", text, truth)["acc"] == 1.0


@pytest.mark.parametrize(
    "truth",
    [
        "not json",
        {"target": 24},
        {"target": 24, "numbers": "3456"},
        {"target": 2.5, "numbers": [1]},
    ],
)
def test_countdown_bad_ground_truth_raises(truth):
    with pytest.raises(ValueError, match="countdown"):
        countdown.compute_score("countdown", "<answer>1</answer>", truth)


# ---- dispatch and registry -----------------------------------------------------------------


@needs_math_verify
@pytest.mark.parametrize(
    ("data_source", "solution", "truth"),
    [
        ("openai/gsm8k", "#### 72", "72"),
        ("gsm8k", "#### 72", "72"),
        ("lighteval/MATH", r"\boxed{\frac12}", "0.5"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{\frac12}", "0.5"),
        ("HuggingFaceH4/MATH-500", r"\boxed{\frac12}", "0.5"),
        ("math", r"\boxed{\frac12}", "0.5"),
        ("countdown", "<answer>1+2</answer>", {"target": 3, "numbers": [1, 2]}),
        (
            "Jiayi-Pan/Countdown-Tasks-3to4",
            "<answer>1+2</answer>",
            {"target": 3, "numbers": [2, 1]},
        ),
    ],
)
def test_default_dispatches_by_data_source(data_source, solution, truth):
    assert default.default_compute_score(data_source, solution, truth)["acc"] == 1.0


@needs_math_verify
def test_default_routes_to_the_right_scorer():
    # The same text scores differently under each scorer: the route is observable.
    assert default.default_compute_score("openai/gsm8k", r"\boxed{72}", "72")["acc"] == 0.0
    assert default.default_compute_score("math", r"\boxed{72}", "72")["acc"] == 1.0


def test_default_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"'my/dataset'.*'openai/gsm8k'.*countdown"):
        default.default_compute_score("my/dataset", "#### 1", "1")


def test_registry_targets_resolve_to_the_functions():
    assert sorted(SCORERS) == ["countdown", "default", "gsm8k", "math"]
    fns = {}
    for name, target in SCORERS.items():
        module, _, attr = target.partition(":")
        fns[name] = getattr(importlib.import_module(module), attr)
    assert fns["gsm8k"] is gsm8k.compute_score
    assert fns["math"] is boxed.compute_score
    assert fns["countdown"] is countdown.compute_score
    assert fns["default"] is default.default_compute_score
    assert scorer_target("gsm8k", "reward.scorer") == SCORERS["gsm8k"]


def test_scorer_target_did_you_mean():
    with pytest.raises(ConfigError) as info:
        scorer_target("gsmk8", "stages.reward.options.scorer")
    assert info.value.path == "stages.reward.options.scorer"
    assert "unknown scorer 'gsmk8'" in str(info.value)
    assert "known: gsm8k, math, countdown, default" in str(info.value)
    assert "(did you mean 'gsm8k'?)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        scorer_target("zzzz", "x")
    assert "did you mean" not in str(info.value)


def test_importing_the_package_stays_light():
    code = (
        "import sys, hybridflow.reward.scorers, hybridflow.reward.scorers.default\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('math_verify', 'sympy', 'torch', 'latex2sympy2_extended'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
