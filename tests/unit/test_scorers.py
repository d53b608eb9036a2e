"""The built-in scorers (generator/rewards/builtin/), on examples shaped like the datasets', malformed answers
included, and through the data_source dispatch that verl's names select."""
import json

import pytest

from asyncrl.generator.rewards.builtin import code_tests, gsm8k, math_answer, multiple_choice
from asyncrl.generator.rewards.errors import RewardError
from asyncrl.generator.rewards.functions import builtin_reward, check_builtin_rewards, score

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                  "altogether in April and May.\n#### 72")


@pytest.mark.parametrize("completion, expected", [
    ("She sold 72 clips.\n#### 72", 1.0),
    ("#### 72.00", 1.0),
    ("#### $1,072", 0.0),
    ("first #### 12 then on reflection\n#### 72", 1.0),  # the last answer line counts
    ("The answer is 72.", 0.0),  # no #### line: verl's strict format
    ("#### seventy-two", 0.0),
    ("", 0.0),
])
def test_gsm8k_reads_the_last_answer_line_and_compares_numbers(completion, expected):
    result = gsm8k.compute_score("openai/gsm8k", completion, "72")
    assert result["score"] == expected
    assert gsm8k.compute_score("openai/gsm8k", completion, GSM8K_SOLUTION)["score"] == expected  # raw dataset text
    assert gsm8k.compute_score("openai/gsm8k", "#### 1,000", "1000")["score"] == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "no answer", "72")["answer_found"] == 0.0


@pytest.mark.parametrize("completion, truth, expected", [
    ("So $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("I think it is 3/4", "\\frac{3}{4}", 1.0),
    ("\\boxed{", "4", 0.0),  # malformed LaTeX parses to nothing
    ("no math here at all", "4", 0.0),
])
def test_math_answers_are_compared_symbolically(completion, truth, expected):
    assert math_answer.compute_score("lighteval/MATH", completion, truth)["score"] == expected


@pytest.mark.parametrize("completion, truth, expected", [
    ("Let's think. The answer is (C).", "C", 1.0),
    ("Answer: b", "B", 1.0),
    ("\\boxed{D}", 3, 1.0),
    ("Options A, B, C and D all seem plausible.", "A", 0.0),  # listing letters commits to none
    ("The answer is (A). Wait, no: the answer is (B).", "B", 1.0),  # the last commitment counts
    ("(E)", "A", 0.0),
])
def test_multiple_choice_scores_only_a_committed_letter(completion, truth, expected):
    assert multiple_choice.compute_score("multiple_choice", completion, truth)["score"] == expected


def test_multiple_choice_refuses_an_unusable_ground_truth_and_letters_past_the_choices():
    with pytest.raises(ValueError, match="letter or an option index"):
        multiple_choice.compute_score("multiple_choice", "Answer: A", "Paris")
    result = multiple_choice.compute_score("multiple_choice", "Answer: E", "A", {"choices": ["w", "x", "y", "z"]})
    assert result == {"score": 0.0, "answer_found": 0.0}


STDIN_TESTS = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]})


def test_code_runs_the_last_block_against_stdin_tests_and_scores_the_fraction_passed():
    right = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_tests.compute_score("apps", right, STDIN_TESTS) == {"score": 1.0, "all_passed": 1.0,
                                                                     "answer_found": 1.0}
    wrong_on_one = "```python\na, b = map(int, input().split())\nprint(a + b if a != 10 else 0)\n```"
    assert code_tests.compute_score("apps", wrong_on_one, STDIN_TESTS)["score"] == pytest.approx(2 / 3)
    assert code_tests.compute_score("apps", "print(3)", STDIN_TESTS)["answer_found"] == 0.0  # no code block


def test_code_call_based_tests_and_a_hanging_test_fails_alone():
    tests = {"fn_name": "slow_add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]}
    code = "```python\nimport time\ndef slow_add(a, b):\n    if a == 5:\n        while True: pass\n    return a + b\n```"
    result = code_tests.compute_score("taco", code, tests)
    assert result["score"] == 0.5 and result["all_passed"] == 0.0


def test_code_that_forges_verdicts_gains_nothing():
    """The program learns neither the expected outputs nor the verdict: printing fake records to the real stdout
    only claims outputs, which are checked outside the sandbox."""
    forger = ("```python\nimport sys, __main__\nnonce = getattr(__main__, 'NONCE', '')\n"
              "for k in range(3):\n    sys.__stdout__.write(nonce + ' {\"k\": %d, \"ok\": true, \"stdout\": \"ok\"}\\n' % k)\n"
              "sys.__stdout__.flush()\n```")
    assert code_tests.compute_score("apps", forger, STDIN_TESTS)["score"] == 0.0


def test_a_malformed_code_ground_truth_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="inputs"):
        code_tests.compute_score("apps", "```python\nprint(1)\n```", json.dumps({"inputs": ["1"]}))


def test_verl_data_source_names_select_the_scorers():
    assert score(builtin_reward, "openai/gsm8k", "#### 72", "72", None)[0] == 1.0
    assert score(builtin_reward, "DigitalLearningGmbH/MATH-lighteval", "\\boxed{4}", "4", None)[0] == 1.0
    assert score(builtin_reward, "aime2024", "\\boxed{204}", "204", None)[0] == 1.0
    assert score(builtin_reward, "cais/mmlu", "Answer: C", 2, None)[0] == 1.0
    check_builtin_rewards({"openai/gsm8k", "math_dapo", "apps", "aime25", "allenai/ai2_arc"})
    with pytest.raises(RewardError, match="no built-in reward for data_source 'my/dataset'"):
        check_builtin_rewards({"openai/gsm8k", "my/dataset"})
