"""minidist.course.quiz: widgets driven headless (set .value, click, read the feedback), the schema
of every shipped deck, and the coverage table in notebooks/README.md."""
import json
import re
from pathlib import Path

import pytest

from minidist.course import quiz

ROOT = Path(__file__).resolve().parents[1]

SINGLE = {"question": "Which pass computes gradients?", "type": "multiple_choice", "answers": [
    {"answer": "forward", "correct": False, "feedback": "That computes the loss."},
    {"answer": "backward", "correct": True, "feedback": "Reverse mode."},
    {"answer": "update", "correct": False}]}
MANY = {"question": "Which are collectives?", "type": "many_choice", "answers": [
    {"answer": "all-reduce", "correct": True},
    {"answer": "broadcast", "correct": True},
    {"answer": "Send", "correct": False, "feedback": "Point-to-point."}]}
NUMERIC = {"question": "2 + 2?", "type": "numeric", "tolerance": 0.01, "answers": [
    {"value": 4, "correct": True, "feedback": "Yes."},
    {"range": [5, 10], "correct": False, "feedback": "Too big."},
    {"type": "default", "feedback": "Count again."}]}


def test_single_choice_feedback_per_answer():
    q = quiz.SingleChoice(SINGLE, number=1)
    q.check_button.click()
    assert q.result is None and q.feedback_text == "Pick an answer first."
    q.choices.value = "forward"
    q.check_button.click()
    assert q.result is False and q.feedback_text == "Not quite. That computes the loss."
    assert "That computes the loss." in q.feedback.value
    q.choices.value = "update"  # no feedback text: the verdict alone
    assert q.check() is False and q.feedback_text == "Not quite."
    q.choices.value = "backward"
    q.check_button.click()
    assert q.result is True and q.feedback_text == "Correct. Reverse mode."


def test_multiple_choice_needs_every_correct_answer_and_no_wrong_one():
    q = quiz.MultipleChoice(MANY)
    boxes = {box.description: box for box in q.choices}
    q.check_button.click()
    assert q.result is None
    boxes["all-reduce"].value = True
    q.check_button.click()
    assert q.result is False and "1 correct answer not ticked" in q.feedback_text
    boxes["broadcast"].value = True
    boxes["Send"].value = True
    q.check_button.click()
    assert q.result is False and "Point-to-point." in q.feedback_text
    boxes["Send"].value = False
    q.check_button.click()
    assert q.result is True and q.feedback_text.startswith("Correct.")


@pytest.mark.parametrize("typed, result, feedback", [
    ("", None, "Type a number first."),
    ("four", None, "`four` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("4.005", True, "Correct. Yes."),  # within the tolerance
    ("4.5", False, "Not quite. Count again."),  # the default answer
    ("7", False, "Not quite. Too big."),  # a wrong range, with its own feedback
    ("1e1", False, "Not quite. Too big."),  # range ends are inclusive
])
def test_numeric_tolerance_ranges_and_default(typed, result, feedback):
    q = quiz.Numeric(NUMERIC)
    q.entry.value = typed
    q.check_button.click()
    assert (q.result, q.feedback_text) == (result, feedback)


THREE_QUARTERS = {"question": "What fraction of the time is the pipeline busy?", "type": "numeric", "answers": [
    {"value": 0.75, "correct": True, "feedback": "Yes."},
    {"type": "default", "feedback": "Count the idle slots."}]}


@pytest.mark.parametrize("typed", ["0.75", " 0.75 ", "7.5e-1", "3/4", " 3 / 4 ", "75%", "75 %", "6/8", ".75"])
def test_numeric_answers_as_fractions_percentages_and_exponents(typed):
    """The old widget read only float(): "3/4" and "75%" were "not a number"."""
    q = quiz.Numeric(THREE_QUARTERS)
    q.entry.value = typed
    q.check_button.click()
    assert (q.result, q.feedback_text) == (True, "Correct. Yes.")


@pytest.mark.parametrize("typed, feedback", [
    ("three quarters", "`three quarters` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("3/0", "`3/0` divides by zero: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("nan", "`nan` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("inf", "`inf` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("1/2/3", "`1/2/3` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("0,75", "`0,75` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
    ("%", "`%` is not a number: type a number such as 0.75, 3/4, 75% or 7.5e-1."),
])
def test_numeric_text_that_is_no_number_says_so(typed, feedback):
    q = quiz.Numeric(THREE_QUARTERS)
    q.entry.value = typed
    q.check_button.click()
    assert (q.result, q.feedback_text) == (None, feedback)


def test_parse_number_values_and_errors():
    assert quiz.parse_number("\u22121/4") == -0.25
    assert quiz.parse_number("12.5%") == 0.125
    assert quiz.parse_number("1e-3") == 0.001
    with pytest.raises(ValueError, match="is not a finite number"):
        quiz.parse_number("1e308/1e-308")


def test_quiz_score_summary_follows_the_checks():
    z = quiz.Quiz([SINGLE, MANY, NUMERIC], title="T", seed=0)
    assert (z.score, z.answered, z.total) == (0, 0, 3)
    assert z.summary_text == "Score: 0 / 3 (0 answered)"
    z.questions[0].choices.value = "backward"
    z.questions[0].check_button.click()
    z.questions[2].entry.value = "9"
    z.questions[2].check_button.click()
    assert (z.score, z.answered) == (1, 2)
    assert "Score: 1 / 3 (2 answered)" in z.summary.value


def test_seeded_answer_shuffle_is_deterministic_and_keeps_question_order():
    a = quiz.Quiz([SINGLE, MANY], seed=3)
    b = quiz.Quiz([SINGLE, MANY], seed=3)
    assert repr(a) == repr(b)
    assert [q.spec["question"] for q in a.questions] == [SINGLE["question"], MANY["question"]]
    unshuffled = quiz.Quiz([SINGLE], seed=None)
    assert list(unshuffled.questions[0].choices.options) == ["forward", "backward", "update"]
    orders = {tuple(quiz.Quiz([SINGLE], seed=s).questions[0].choices.options) for s in range(10)}
    assert len(orders) > 1


def test_plain_text_repr_is_stable_and_shows_question_and_options():
    z = quiz.Quiz([SINGLE, NUMERIC], title="Demo", seed=None)
    text = repr(z)
    assert text.startswith("Quiz: Demo (2 questions)")
    assert "Q1. Which pass computes gradients? (choose one)\n   ( ) forward\n   ( ) backward" in text
    assert "Q2. 2 + 2? (type a number)" in text
    assert "0x" not in text and "model_id" not in text
    bundle = z._repr_mimebundle_()
    assert bundle["text/plain"] == text  # full text: ipywidgets would cut it at 110 characters
    assert "application/vnd.jupyter.widget-view+json" in bundle
    z.questions[0].choices.value = "backward"
    z.questions[0].check_button.click()
    assert repr(z) == text  # answering does not change what nbval compares


def test_flashcards_flip_next_previous_position_and_seeded_order():
    cards = [{"front": f"f{i}", "back": f"b{i}"} for i in range(5)]
    plain = quiz.Flashcards(cards, seed=None)
    assert (plain.position.value, plain.text) == ("1 / 5", "f0")
    plain.flip_button.click()
    assert plain.text == "b0" and "b0" in plain.face.value
    plain.next_button.click()
    assert (plain.position.value, plain.text, plain.showing_back) == ("2 / 5", "f1", False)
    plain.previous_button.click()
    plain.previous_button.click()  # wraps around to the last card
    assert (plain.position.value, plain.text) == ("5 / 5", "f4")
    shuffled = quiz.Flashcards(cards, seed=1)
    assert shuffled.order == quiz.Flashcards(cards, seed=1).order != [0, 1, 2, 3, 4]
    assert sorted(shuffled.order) == [0, 1, 2, 3, 4]
    shuffled.next_button.click()
    shuffled.shuffle_button.click()
    assert shuffled.index == 0 and sorted(shuffled.order) == [0, 1, 2, 3, 4]
    text = repr(shuffled)
    assert text.startswith("Flashcards (5 cards, shuffled with seed 1)")
    assert text == repr(quiz.Flashcards(cards, seed=1))  # initial order, whatever was clicked
    assert shuffled._repr_mimebundle_()["text/plain"] == text


def test_show_functions_display_text_without_a_front_end(capsys):
    quiz.show_quiz([SINGLE], seed=None)
    quiz.show_flashcards([{"front": "a", "back": "b"}])
    out = capsys.readouterr().out
    assert "Q1. Which pass computes gradients?" in out and "1. a\n" in out


def test_plain_text_of_flashcards_shows_every_front_and_no_back():
    # A saved notebook shows this text to a learner who has not run it yet: no answers in it.
    cards = [{"front": f"question {i}?", "back": f"answer {i}."} for i in range(4)]
    text = repr(quiz.Flashcards(cards, title="T", seed=0))
    assert text.splitlines()[:2] == ["Flashcards: T (4 cards, shuffled with seed 0)", quiz.PLAIN_TEXT_CARDS_NOTE]
    assert "run this cell" in quiz.PLAIN_TEXT_CARDS_NOTE
    assert all(f"question {i}?" in text and f"answer {i}." not in text for i in range(4))
    for name in DECKS:  # the shipped decks too
        deck = quiz.read_deck(name)
        text = repr(quiz.Flashcards.from_deck(name))
        assert all(card["front"] in text for card in deck["flashcards"])
        assert not any(card["back"] in text for card in deck["flashcards"]), name


@pytest.mark.parametrize("spec, message", [
    ({**SINGLE, "answers": [{**a, "correct": True} for a in SINGLE["answers"]]}, "exactly one correct"),
    ({**SINGLE, "answers": [{**a, "correct": False} for a in SINGLE["answers"]]}, "exactly one correct"),
    ({**MANY, "answers": [{**a, "correct": False} for a in MANY["answers"]]}, "at least one correct"),
    ({**SINGLE, "answers": SINGLE["answers"] + [SINGLE["answers"][0]]}, "unique"),
    ({**NUMERIC, "answers": [{"range": [3, 1], "correct": True}]}, "lo <= hi"),
    ({**NUMERIC, "answers": [{"value": 1, "correct": False}]}, "at least one correct"),
    ({**NUMERIC, "tolerance": -1}, "tolerance"),
    ({**SINGLE, "type": "essay"}, "type must be"),
    ({**SINGLE, "question": " "}, "question"),
    ({**MANY, "answers": MANY["answers"] + [{"answer": "`Send`", "correct": False}]}, "backticks"),
])
def test_invalid_questions_are_rejected(spec, message):
    with pytest.raises(quiz.DeckError, match=message):
        quiz.make_question(spec)


def test_deck_lookup():
    assert quiz.deck_path("01") == quiz.deck_path("01_autograd")
    with pytest.raises(quiz.DeckError, match="no deck named"):
        quiz.deck_path("99_nothing")
    assert quiz.load_deck("00_start_here", "flashcards")[0]["front"]


# ----------------------------------------------------------------------------- every shipped deck

DECKS = quiz.deck_names()


def test_decks_for_chapters_00_to_02_exist():
    assert {"00_start_here", "01_autograd", "02_sgd_and_input_pipelines"} <= set(DECKS)


@pytest.mark.parametrize("name", DECKS)
def test_deck_schema(name):
    deck = quiz.read_deck(name)  # validates ids, questions and cards; raises DeckError
    assert re.fullmatch(r"\d\d_[a-z0-9_]+", name)
    assert deck["questions"] and deck["flashcards"]
    for spec in deck["questions"]:
        correct = [a for a in spec["answers"] if a.get("correct")]
        if spec["type"] == "multiple_choice":
            assert len(correct) == 1, spec["id"]
        elif spec["type"] == "many_choice":
            assert len(correct) >= 1, spec["id"]
        else:
            assert correct, spec["id"]
            for a in spec["answers"]:
                if "range" in a:
                    lo, hi = a["range"]
                    assert lo <= hi, spec["id"]
    for card in deck["flashcards"]:
        assert card["front"].strip() and card["back"].strip()
    # Every question builds, and its correct answer is accepted (numeric: its value or range).
    for q in quiz.Quiz(deck["questions"]).questions:
        if isinstance(q, quiz.SingleChoice):
            q.choices.value = next(a["answer"] for a in q.answers if a["correct"])
        elif isinstance(q, quiz.MultipleChoice):
            for a, box in zip(q.answers, q.choices):
                box.value = a["correct"]
        else:
            a = next(a for a in q.answers if a.get("correct"))
            q.entry.value = repr(a["value"] if "value" in a else sum(a["range"]) / 2)
        assert q.check() is True, q.spec["id"]


def correct_option_is_longest(spec: dict) -> bool:
    """True when a single-choice question's correct option is strictly longer than every other."""
    correct = next(a["answer"] for a in spec["answers"] if a["correct"])
    return all(len(correct) > len(a["answer"]) for a in spec["answers"] if not a["correct"])


def test_option_length_does_not_give_the_answer_away():
    # Over all decks, the share of single-choice questions whose right option is strictly the
    # longest stays near chance (1 / number of options), never above 35 %.
    singles = [(name, spec) for name in DECKS for spec in quiz.load_deck(name) if spec["type"] == "multiple_choice"]
    longest = [f"{name}:{spec['id']}" for name, spec in singles if correct_option_is_longest(spec)]
    assert len(singles) >= 40
    assert len(longest) <= 0.35 * len(singles), f"{len(longest)} of {len(singles)}: {longest}"
    # ... and within each deck too: a learner who sees one chapter's quiz would spot a pattern
    # there (deck 11 once had the right option longest in 4 of its 4 single-choice questions).
    for name in DECKS:
        mine = [spec for deck, spec in singles if deck == name]
        hits = [spec["id"] for spec in mine if correct_option_is_longest(spec)]
        assert len(hits) <= max(1, len(mine) // 2), f"deck {name}: {len(hits)} of {len(mine)}: {hits}"


def test_no_option_of_any_deck_shows_backticks():
    for name in DECKS:
        for spec in quiz.load_deck(name):
            for a in spec["answers"]:
                assert "`" not in a.get("answer", ""), f"{name}:{spec['id']}: {a['answer']!r}"


# ----------------------------------------------------------------------------- coverage table

TABLE_ROW = re.compile(r"^\|\s*(00[01])\s*#\s*(\d+)\s*\|[^|]*\|\s*([^|]+?)\s*\|\s*([^|]*?)\s*\|\s*$")


def coverage_rows():
    text = (ROOT / "notebooks" / "README.md").read_text(encoding="utf-8")
    return [m.groups() for m in map(TABLE_ROW.match, text.splitlines()) if m]


def test_coverage_table_lists_every_card_of_both_flashcard_files_once():
    rows = coverage_rows()
    numbers = {"000": [], "001": []}
    for source, number, _, _ in rows:
        numbers[source].append(int(number))
    # Cards counted in the seed files: 15 in 000 (ML pipelines, week 3), 49 in 001 (Systems for ML).
    assert numbers["000"] == list(range(1, 16))
    assert numbers["001"] == list(range(1, 50))


def test_coverage_table_cites_existing_questions():
    decks = {name: {q["id"] for q in quiz.load_deck(name)} for name in DECKS}
    planned = re.compile(r"planned: (03_collectives|04_ring_allreduce|05_data_parallel|06_parameter_servers"
                         r"|later \(pipeline\))$")
    for source, number, deck, asked_by in coverage_rows():
        where = f"card {source} #{number}"
        if deck in decks:
            ids = re.findall(r"`([a-z0-9-]+)`", asked_by)
            assert ids, f"{where}: name the question ids that ask it"
            missing = set(ids) - decks[deck]
            assert not missing, f"{where}: no question {sorted(missing)} in deck {deck}"
        else:
            assert planned.match(deck), f"{where}: {deck!r} is neither a deck nor a planned chapter"


@pytest.mark.parametrize("correct,feedback,shown", [
    (True, "Right: each step ends when its slowest message arrives.",
     "Correct. Each step ends when its slowest message arrives."),
    (True, "Correct, the ring.", "Correct. The ring."),
    (False, "Wrong: the tree.", "Not quite. The tree."),
    (False, "No. Count again.", "Not quite. Count again."),
    (True, "Yes.", "Correct. Yes."),  # a whole feedback is kept
    (True, "Rightly so.", "Correct. Rightly so."),
])
def test_the_verdict_is_not_said_twice(correct, feedback, shown):
    """Deck feedback that starts with its own verdict ("Right: ...", 17_topology's) read "Correct.
    Right: ..."; the verdict is said once."""
    spec = {"question": "Which?", "type": "multiple_choice", "answers": [
        {"answer": "a", "correct": correct, "feedback": feedback}, {"answer": "b", "correct": not correct}]}
    q = quiz.SingleChoice(spec, number=1)
    q.choices.value = "a"
    q.check()
    assert q.feedback_text == shown


LATER_CHAPTERS = sorted(p.name[:2] for p in (Path(quiz.__file__).parent / "quizzes").glob("*.json")
                        if p.name[:2].isdigit() and int(p.name[:2]) >= 13)  # every chapter added since is held to it


def test_every_deck_from_13_is_held_to_the_rule():
    assert LATER_CHAPTERS[:6] == ["13", "14", "15", "16", "17", "18"] and len(LATER_CHAPTERS) >= 7


@pytest.mark.parametrize("chapter", LATER_CHAPTERS)
def test_the_decks_of_13_on_ask_twelve_questions_some_numeric_none_guessable_by_length(chapter):
    """Issue 35, item 4: every deck of chapter 13 and after holds at least 12 questions, at least
    three of them numeric, and no single-choice question whose right option is strictly the
    longest or strictly the shortest of its options."""
    path = next((Path(quiz.__file__).parent / "quizzes").glob(f"{chapter}_*.json"))
    questions = json.loads(path.read_text())["questions"]
    assert len(questions) >= 12 and sum(q["type"] == "numeric" for q in questions) >= 3, path.name
    for q in questions:
        if q["type"] == "multiple_choice":
            right = [len(a["answer"]) for a in q["answers"] if a["correct"]][0]
            others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
            assert min(others) <= right <= max(others), (path.name, q["id"])
