"""Flashcards and quizzes for the lesson notebooks, built on ipywidgets.

A chapter ends with two cells::

    from minidist.course import quiz
    quiz.show_flashcards("01_autograd")
    quiz.show_quiz("01_autograd")

Decks
-----
One JSON file per chapter, ``minidist/course/quizzes/NN_topic.json``, holding an object::

    {
      "title": "01 · Autograd",
      "flashcards": [{"id": "tensor", "front": "...", "back": "..."}],
      "questions":  [{"id": "graph-kind", "question": "...", "type": "multiple_choice",
                      "answers": [{"answer": "...", "correct": true, "feedback": "..."}, ...]}]
    }

``questions`` is a list in jupyterquiz's format (``display_quiz(deck["questions"])`` shows it
there too): ``type`` is ``"multiple_choice"`` (radio buttons, exactly one correct answer),
``"many_choice"`` (tick every correct answer, at least one) or ``"numeric"``, whose answers are
``{"value": v, "correct": bool}`` or ``{"range": [lo, hi], "correct": bool}`` (inclusive), each
with an optional ``"feedback"``, plus at most one ``{"type": "default", "feedback": "..."}`` for
anything else; an optional question-level ``"tolerance"`` (absolute) widens ``value`` matches.
``flashcards`` is a list in JupyterCards' shape (``front``/``back``). ``id`` is our addition
(jupyterquiz ignores unknown keys): a slug, unique among the deck's questions (and among its
cards); ``notebooks/README.md`` cites question ids to show which question asks which fact, and
a card that drills the same fact as a question takes the question's id.

Every widget here has a plain-text form (``repr``, and the ``text/plain`` part of its display
bundle) that shows the question and its options and nothing random: a front end without
widgets, a rendered notebook on the web and nbval all see the same stable text. It never gives
an answer away: a quiz shows its options unmarked, flashcards show their fronts only. Answer
texts are shown as they are (radio buttons and checkboxes do not render markup), so a deck
writes code in options as plain words or plain code, without backticks.

A numeric answer may be typed as a decimal (``0.75``, `` 0.75 ``, ``7.5e-1``), a fraction
(``3/4``) or a percentage (``75%``): :func:`parse_number` reads all three.

Headless use (tests, scripts): construct a widget, set the input's ``.value``, call
``.check_button.click()``, read ``.result`` and ``.feedback_text``.

Longer than 400 lines: the flashcards, the three kinds of question, their plain-text fallbacks and
the deck loader are one widget family the notebooks share.
"""
from __future__ import annotations

import html
import json
import math
import random
import re
from pathlib import Path

import ipywidgets as widgets
from IPython.display import display

QUIZ_DIR = Path(__file__).resolve().parent / "quizzes"

# jupyterquiz's type name -> what we tell the learner to do.
QUESTION_TYPES = {
    "multiple_choice": "choose one",
    "many_choice": "choose all that apply",
    "numeric": "type a number",
}
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")
NUMBER_FORMS = "a number such as 0.75, 3/4, 75% or 7.5e-1"
# What the plain text of a deck of flashcards says in place of the answers.
PLAIN_TEXT_CARDS_NOTE = "(answers hidden: run this cell in Jupyter for the interactive cards, then Flip)"


class DeckError(ValueError):
    """A deck or question that breaks the format described in this module's docstring.
    The message names the deck and the item."""


# ----------------------------------------------------------------------------- decks


def deck_names() -> list[str]:
    """Names of the decks shipped in ``minidist/course/quizzes`` (file stems, sorted)."""
    return sorted(p.stem for p in QUIZ_DIR.glob("*.json"))


def deck_path(name: str) -> Path:
    """Path of deck ``name``: a stem (``"01_autograd"``), a chapter number (``"01"``) or a
    path to a ``.json`` file. Raises :class:`DeckError` when no single deck matches."""
    if name.endswith(".json"):
        return Path(name)
    exact = QUIZ_DIR / f"{name}.json"
    if exact.exists():
        return exact
    matches = sorted(QUIZ_DIR.glob(f"{name}_*.json"))
    if len(matches) == 1:
        return matches[0]
    raise DeckError(f"no deck named {name!r} (decks: {', '.join(deck_names()) or 'none'})")


def read_deck(name: str) -> dict:
    """The whole deck ``name`` (see :func:`deck_path`) as a dict with ``title``,
    ``flashcards`` and ``questions``, validated. Raises :class:`DeckError`."""
    path = deck_path(name)
    try:
        deck = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise DeckError(f"{path}: cannot read deck: {error}") from error
    validate_deck(deck, path.stem)
    deck.setdefault("title", path.stem)
    deck.setdefault("flashcards", [])
    deck.setdefault("questions", [])
    return deck


def load_deck(name: str, part: str = "questions") -> list[dict]:
    """One part of deck ``name``: ``part="questions"`` (jupyterquiz list) or
    ``"flashcards"`` (list of ``{"front", "back"}``). Raises :class:`DeckError`."""
    if part not in ("questions", "flashcards"):
        raise DeckError(f"part must be 'questions' or 'flashcards', not {part!r}")
    return read_deck(name)[part]


def validate_deck(deck: dict, where: str = "deck") -> None:
    """Raise :class:`DeckError` unless ``deck`` follows the format: ids present and unique per part,
    every question valid (:func:`validate_question`), every flashcard with front and back."""
    if not isinstance(deck, dict):
        raise DeckError(f"{where}: a deck is a JSON object with 'flashcards' and 'questions'")
    unknown = set(deck) - {"title", "flashcards", "questions"}
    if unknown:
        raise DeckError(f"{where}: unknown keys {sorted(unknown)}")
    for part in ("flashcards", "questions"):
        seen: set[str] = set()
        items = deck.get(part, [])
        if not isinstance(items, list):
            raise DeckError(f"{where}: {part!r} must be a list")
        for i, item in enumerate(items):
            label = f"{where} {part}[{i}]"
            ident = item.get("id") if isinstance(item, dict) else None
            if not isinstance(ident, str) or not _ID.match(ident):
                raise DeckError(f"{label}: needs an 'id' slug (lowercase letters, digits, '-')")
            if ident in seen:
                raise DeckError(f"{label}: id {ident!r} is used twice in {part}")
            seen.add(ident)
            if part == "questions":
                validate_question(item, f"{label} ({ident})")
            else:
                validate_flashcard(item, f"{label} ({ident})")


def validate_flashcard(card: dict, where: str = "flashcard") -> None:
    """Raise :class:`DeckError` unless ``card`` has non-empty string ``front`` and ``back``."""
    for side in ("front", "back"):
        if not isinstance(card.get(side), str) or not card[side].strip():
            raise DeckError(f"{where}: needs a non-empty {side!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_number(text: str) -> float:
    """The number a learner typed: a decimal (``"0.75"``, ``"7.5e-1"``, ``"-2"``), a fraction
    of two such numbers (``"3/4"``) or a percentage (``"75%"``, i.e. 0.75), spaces around any
    part ignored (``" 3 / 4 "``); the minus sign may be the typographic one (U+2212).

    Returns a finite float. Raises ValueError, whose message says what was typed and which forms
    are read, for anything else: words, an empty string, ``nan``/``inf``, a zero denominator.
    """
    cleaned = str(text).strip().replace("\u2212", "-")
    try:
        if cleaned.endswith("%"):
            value = _decimal(cleaned[:-1]) / 100
        elif cleaned.count("/") == 1:
            top, bottom = (_decimal(part) for part in cleaned.split("/"))
            if bottom == 0:
                raise ValueError(f"`{str(text).strip()}` divides by zero: type {NUMBER_FORMS}")
            value = top / bottom
        else:
            value = _decimal(cleaned)
    except ValueError as error:
        if "divides by zero" in str(error):
            raise
        raise ValueError(f"`{str(text).strip()}` is not a number: type {NUMBER_FORMS}") from None
    if not math.isfinite(value):
        raise ValueError(f"`{str(text).strip()}` is not a finite number: type {NUMBER_FORMS}")
    return value


def _decimal(text: str) -> float:
    """float(text) for a plain decimal only (no ``nan``, ``inf`` or ``1_000``: float() reads those)."""
    text = text.strip()
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
        raise ValueError(text)
    return float(text)


def validate_question(spec: dict, where: str = "question") -> None:
    """Raise :class:`DeckError` unless ``spec`` is a valid jupyterquiz question: a non-empty
    ``question``; for ``multiple_choice`` exactly one correct answer, for ``many_choice`` at
    least one, answer texts unique; for ``numeric`` at least one correct ``value`` or ``range``
    (``lo <= hi``, finite), at most one default, a non-negative ``tolerance``."""
    if not isinstance(spec, dict):
        raise DeckError(f"{where}: a question is a JSON object")
    if not isinstance(spec.get("question"), str) or not spec["question"].strip():
        raise DeckError(f"{where}: needs a non-empty 'question'")
    kind = spec.get("type")
    if kind not in QUESTION_TYPES:
        raise DeckError(f"{where}: type must be one of {sorted(QUESTION_TYPES)}, not {kind!r}")
    answers = spec.get("answers")
    if not isinstance(answers, list) or not answers:
        raise DeckError(f"{where}: needs a non-empty 'answers' list")
    for a in answers:
        if not isinstance(a, dict):
            raise DeckError(f"{where}: every answer is a JSON object")
        if "feedback" in a and not isinstance(a["feedback"], str):
            raise DeckError(f"{where}: feedback must be a string")
    if kind == "numeric":
        _validate_numeric(spec, answers, where)
        return
    texts = [a.get("answer") for a in answers]
    if any(not isinstance(t, str) or not t.strip() for t in texts):
        raise DeckError(f"{where}: every answer needs a non-empty 'answer' text")
    if len(set(texts)) != len(texts):
        raise DeckError(f"{where}: answer texts must be unique")
    marked = [t for t in texts if "`" in t]
    if marked:
        raise DeckError(f"{where}: answer {marked[0]!r} has backticks, which the buttons would show as they "
                        f"are: write the code without them")
    if len(answers) < 2:
        raise DeckError(f"{where}: a choice question needs at least two answers")
    if any(not isinstance(a.get("correct"), bool) for a in answers):
        raise DeckError(f"{where}: every answer needs 'correct': true or false")
    n_correct = sum(a["correct"] for a in answers)
    if kind == "multiple_choice" and n_correct != 1:
        raise DeckError(f"{where}: multiple_choice needs exactly one correct answer, has {n_correct}")
    if kind == "many_choice" and n_correct < 1:
        raise DeckError(f"{where}: many_choice needs at least one correct answer")


def _validate_numeric(spec: dict, answers: list, where: str) -> None:
    tolerance = spec.get("tolerance", 0)
    if not _is_number(tolerance) or tolerance < 0:
        raise DeckError(f"{where}: tolerance must be a finite number >= 0")
    defaults = 0
    n_correct = 0
    for a in answers:
        if a.get("type") == "default":
            defaults += 1
            if not isinstance(a.get("feedback"), str):
                raise DeckError(f"{where}: a default answer needs 'feedback'")
            continue
        if not isinstance(a.get("correct"), bool):
            raise DeckError(f"{where}: every numeric answer needs 'correct': true or false")
        if "value" in a:
            if not _is_number(a["value"]):
                raise DeckError(f"{where}: value {a['value']!r} is not a finite number")
        elif "range" in a:
            r = a["range"]
            if not (isinstance(r, list) and len(r) == 2 and all(map(_is_number, r)) and r[0] <= r[1]):
                raise DeckError(f"{where}: range {r!r} must be [lo, hi] with finite lo <= hi")
        else:
            raise DeckError(f"{where}: a numeric answer needs 'value' or 'range'")
        n_correct += a["correct"]
    if defaults > 1:
        raise DeckError(f"{where}: at most one default answer")
    if n_correct < 1:
        raise DeckError(f"{where}: numeric needs at least one correct value or range")


# ----------------------------------------------------------------------------- questions


def _inline_html(text: str) -> str:
    """Escape ``text`` for HTML and turn `backticks` into <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


class _PlainTextRepr:
    """Mixin: ``repr``, IPython's pretty printer and the display bundle's ``text/plain`` all
    show ``plain_text()``; the widget view itself stays in the bundle for live front ends."""

    def plain_text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.plain_text()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.plain_text())

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self.plain_text()
        return bundle


class Question(_PlainTextRepr, widgets.VBox):
    """One question as a widget: the prompt, an input, a Check button and feedback.

    Use a subclass (or :func:`make_question`): :class:`SingleChoice`, :class:`MultipleChoice`,
    :class:`Numeric`. After a check, ``result`` is True (right), False (wrong) or None (nothing
    answered yet), and ``feedback_text`` says why in plain text.

    ``spec`` is a jupyterquiz question dict (validated; raises :class:`DeckError`);
    ``number`` is shown as "Q3."; ``seed`` (int or None) shuffles the answer order.
    """

    kind = ""

    def __init__(self, spec: dict, *, number: int | None = None, seed: int | None = None):
        validate_question(spec, f"question {spec.get('id', number)!r}" if isinstance(spec, dict) else "question")
        if spec["type"] != self.kind:
            raise DeckError(f"{type(self).__name__} takes type {self.kind!r}, not {spec['type']!r}")
        self.spec = spec
        self.number = number
        self.result: bool | None = None
        self.feedback_text = ""
        self.answers = list(spec["answers"])
        if seed is not None and self.kind != "numeric":
            random.Random(seed).shuffle(self.answers)
        self._listeners: list = []
        self.prompt = widgets.HTML(f"<b>{self._heading()}</b> {_inline_html(spec['question'])} "
                                   f"<i>({QUESTION_TYPES[self.kind]})</i>")
        self.check_button = widgets.Button(description="Check", button_style="primary")
        self.check_button.on_click(lambda _button: self.check())
        self.feedback = widgets.HTML("")
        super().__init__(children=[self.prompt, self._input(), widgets.HBox([self.check_button, self.feedback])],
                         layout=widgets.Layout(margin="0 0 14px 0"))

    def _heading(self) -> str:
        return f"Q{self.number}." if self.number is not None else "Q."

    def _input(self) -> widgets.Widget:
        raise NotImplementedError

    def _evaluate(self) -> tuple[bool | None, str]:
        raise NotImplementedError

    def _option_lines(self) -> list[str]:
        raise NotImplementedError

    def check(self) -> bool | None:
        """Grade the current input, show the feedback, tell listeners; return ``result``."""
        self.result, self.feedback_text = self._evaluate()
        color, mark = {True: ("#1a7f37", "✔"), False: ("#b42318", "✘"), None: ("#555", "•")}[self.result]
        self.feedback.value = f'<span style="color:{color}">{mark} {_inline_html(self.feedback_text)}</span>'
        for listener in self._listeners:
            listener(self)
        return self.result

    def on_check(self, callback) -> None:
        """Call ``callback(question)`` after every check (the :class:`Quiz` score uses it)."""
        self._listeners.append(callback)

    def plain_text(self) -> str:
        """The question and its options as stable plain text (no answers, no widget ids)."""
        head = f"{self._heading()} {self.spec['question']} ({QUESTION_TYPES[self.kind]})"
        return "\n".join([head] + [f"   {line}" for line in self._option_lines()])


# Feedback that opens with its own verdict ("Right: ..."): the verdict is said once, by _verdict.
_OWN_VERDICT = {True: re.compile(r"(?:right|correct|yes)\s*[:,.;!-]\s+(?=\S)", re.IGNORECASE),
                False: re.compile(r"(?:wrong|incorrect|no)\s*[:,.;!-]\s+(?=\S)", re.IGNORECASE)}


def _verdict(correct: bool, feedback: str) -> str:
    lead = "Correct." if correct else "Not quite."
    said = _OWN_VERDICT[bool(correct)].match(feedback.strip())
    if said:
        rest = feedback.strip()[said.end():]
        feedback = rest[:1].upper() + rest[1:]
    return f"{lead} {feedback}".strip()


class SingleChoice(Question):
    """jupyterquiz ``multiple_choice``: radio buttons, exactly one right answer.
    Input: ``choices`` (``RadioButtons``; ``.value`` is the chosen answer text or None)."""

    kind = "multiple_choice"

    def _input(self):
        self.choices = widgets.RadioButtons(options=[a["answer"] for a in self.answers], value=None,
                                            layout=widgets.Layout(width="max-content"))
        return self.choices

    def _evaluate(self):
        if self.choices.value is None:
            return None, "Pick an answer first."
        answer = next(a for a in self.answers if a["answer"] == self.choices.value)
        return answer["correct"], _verdict(answer["correct"], answer.get("feedback", ""))

    def _option_lines(self):
        return [f"( ) {a['answer']}" for a in self.answers]


class MultipleChoice(Question):
    """jupyterquiz ``many_choice``: tick every right answer (one or more).
    Input: ``choices``, a list of ``Checkbox`` (``.value`` True when ticked), in display order."""

    kind = "many_choice"

    def _input(self):
        self.choices = [widgets.Checkbox(value=False, description=a["answer"], indent=False,
                                         layout=widgets.Layout(width="max-content")) for a in self.answers]
        return widgets.VBox(self.choices)

    def _evaluate(self):
        ticked = [a for a, box in zip(self.answers, self.choices) if box.value]
        if not ticked:
            return None, "Tick at least one answer first."
        wrong = [a for a in ticked if not a["correct"]]
        missed = sum(a["correct"] for a in self.answers) - (len(ticked) - len(wrong))
        if not wrong and not missed:
            return True, _verdict(True, " ".join(a.get("feedback", "") for a in ticked))
        notes = [f"“{a['answer']}”: {a.get('feedback', 'not this one.')}" for a in wrong]
        if missed:
            notes.append(f"{missed} correct answer{'s' if missed > 1 else ''} not ticked yet.")
        return False, _verdict(False, " ".join(notes))

    def _option_lines(self):
        return [f"[ ] {a['answer']}" for a in self.answers]


class Numeric(Question):
    """jupyterquiz ``numeric``: type a number; matched against ``value`` (within the question's
    ``tolerance``) and ``range`` answers in order, then the default. Input: ``entry`` (``Text``;
    ``.value`` is what the learner typed, e.g. ``"0.25"``, ``"1e-3"``, ``"1/4"`` or ``"25%"``,
    read by :func:`parse_number`)."""

    kind = "numeric"

    def _input(self):
        self.entry = widgets.Text(value="", placeholder="e.g. 0.75, 3/4 or 75%", layout=widgets.Layout(width="12em"))
        return self.entry

    def match(self, x: float) -> dict | None:
        """The first answer dict that ``x`` matches (value, range), else the default, else None."""
        tolerance = self.spec.get("tolerance", 0)
        for a in self.answers:
            if "value" in a and abs(x - a["value"]) <= tolerance + 1e-12 * max(1.0, abs(a["value"])):
                return a
            if "range" in a and a["range"][0] <= x <= a["range"][1]:
                return a
        return next((a for a in self.answers if a.get("type") == "default"), None)

    def _evaluate(self):
        text = self.entry.value.strip()
        if not text:
            return None, "Type a number first."
        try:
            x = parse_number(text)
        except ValueError as error:
            return None, f"{error}."
        answer = self.match(x)
        correct = bool(answer and answer.get("correct", False))
        return correct, _verdict(correct, answer.get("feedback", "") if answer else "")

    def _option_lines(self):
        return ["answer: ______"]


_QUESTION_CLASSES = {cls.kind: cls for cls in (SingleChoice, MultipleChoice, Numeric)}


def make_question(spec: dict, *, number: int | None = None, seed: int | None = None) -> Question:
    """The widget for a jupyterquiz question dict (class chosen by ``spec["type"]``)."""
    validate_question(spec)
    return _QUESTION_CLASSES[spec["type"]](spec, number=number, seed=seed)


# ----------------------------------------------------------------------------- quiz and cards


def _title_and_items(deck: str | list, part: str) -> tuple[str, list[dict]]:
    if isinstance(deck, str):
        data = read_deck(deck)
        return data["title"], data[part]
    return "", list(deck)


class Quiz(_PlainTextRepr, widgets.VBox):
    """A list of questions with a running score.

    ``questions``: a list of jupyterquiz dicts; ``seed`` (int or None) shuffles the answers
    of each choice question (the question order stays the lesson's order unless
    ``shuffle_questions``). ``score`` counts questions whose last check was right, ``answered``
    those checked with an answer, ``total`` all; ``summary`` shows "Score: 2 / 5 (3 answered)".
    """

    def __init__(self, questions: list[dict], *, title: str = "", seed: int | None = 0,
                 shuffle_questions: bool = False):
        rng = random.Random(seed)
        specs = list(questions)
        if shuffle_questions and seed is not None:
            rng.shuffle(specs)
        self.title = title
        self.questions = [make_question(spec, number=i + 1, seed=None if seed is None else rng.randrange(2**32))
                          for i, spec in enumerate(specs)]
        self.summary = widgets.HTML("")
        for q in self.questions:
            q.on_check(lambda _q: self._update_summary())
        self._update_summary()
        header = [widgets.HTML(f"<h3>{_inline_html(title)}</h3>")] if title else []
        super().__init__(children=header + self.questions + [self.summary])

    @classmethod
    def from_deck(cls, deck: str | list, seed: int | None = 0, **kwargs) -> Quiz:
        """A quiz from a deck name (see :func:`deck_path`) or a list of question dicts."""
        title, specs = _title_and_items(deck, "questions")
        return cls(specs, title=kwargs.pop("title", title), seed=seed, **kwargs)

    @property
    def score(self) -> int:
        return sum(q.result is True for q in self.questions)

    @property
    def answered(self) -> int:
        return sum(q.result is not None for q in self.questions)

    @property
    def total(self) -> int:
        return len(self.questions)

    @property
    def summary_text(self) -> str:
        return f"Score: {self.score} / {self.total} ({self.answered} answered)"

    def _update_summary(self) -> None:
        self.summary.value = f"<b>{self.summary_text}</b>"

    def plain_text(self) -> str:
        """Title and every question with its options, as stable plain text."""
        head = f"Quiz: {self.title} ({self.total} questions)" if self.title else f"Quiz ({self.total} questions)"
        return "\n\n".join([head] + [q.plain_text() for q in self.questions])


class Flashcards(_PlainTextRepr, widgets.VBox):
    """A deck of two-sided cards: Previous / Flip / Next (wrapping around) and Shuffle.

    ``cards``: list of ``{"front", "back"}`` dicts (validated; :class:`DeckError`); ``seed``
    (int or None) shuffles the order (None keeps the deck's order; Shuffle draws a new order
    from the same seeded generator). ``index`` is the position in ``order``, ``showing_back``
    the side shown, ``position.value`` reads "3 / 12".
    """

    def __init__(self, cards: list[dict], *, title: str = "", seed: int | None = 0):
        for i, card in enumerate(cards):
            validate_flashcard(card, f"flashcard {i}")
        if not cards:
            raise DeckError("a flashcard deck needs at least one card")
        self.cards = list(cards)
        self.title = title
        self.seed = seed
        self._rng = random.Random(seed)
        self.order = list(range(len(cards)))
        if seed is not None:
            self._rng.shuffle(self.order)
        self.index = 0
        self.showing_back = False
        self.face = widgets.HTML(layout=widgets.Layout(border="1px solid #999", padding="10px 16px",
                                                       min_height="90px", width="560px"))
        self.position = widgets.Label()
        self.previous_button = widgets.Button(description="◀ Previous")
        self.flip_button = widgets.Button(description="Flip", button_style="primary")
        self.next_button = widgets.Button(description="Next ▶")
        self.shuffle_button = widgets.Button(description="Shuffle")
        self.previous_button.on_click(lambda _b: self.previous())
        self.flip_button.on_click(lambda _b: self.flip())
        self.next_button.on_click(lambda _b: self.next())
        self.shuffle_button.on_click(lambda _b: self.shuffle())
        self._render()
        header = [widgets.HTML(f"<h3>{_inline_html(title)}</h3>")] if title else []
        buttons = widgets.HBox([self.previous_button, self.flip_button, self.next_button,
                                self.shuffle_button, self.position])
        super().__init__(children=header + [self.face, buttons])

    @classmethod
    def from_deck(cls, deck: str | list, seed: int | None = 0, **kwargs) -> Flashcards:
        """Cards from a deck name (see :func:`deck_path`) or a list of card dicts."""
        title, cards = _title_and_items(deck, "flashcards")
        return cls(cards, title=kwargs.pop("title", title), seed=seed, **kwargs)

    @property
    def current(self) -> dict:
        """The card dict shown now."""
        return self.cards[self.order[self.index]]

    @property
    def text(self) -> str:
        """The side shown now, as plain text."""
        return self.current["back" if self.showing_back else "front"]

    def _render(self) -> None:
        side = "back" if self.showing_back else "front"
        self.face.value = (f'<div style="color:#777;font-size:small">{side}</div>'
                           f"<div>{_inline_html(self.text)}</div>")
        self.position.value = f"{self.index + 1} / {len(self.cards)}"

    def flip(self) -> None:
        """Show the other side of the current card."""
        self.showing_back = not self.showing_back
        self._render()

    def next(self) -> None:
        """Go to the next card (front side up); after the last comes the first."""
        self.index = (self.index + 1) % len(self.cards)
        self.showing_back = False
        self._render()

    def previous(self) -> None:
        """Go to the previous card (front side up); before the first comes the last."""
        self.index = (self.index - 1) % len(self.cards)
        self.showing_back = False
        self._render()

    def shuffle(self) -> None:
        """A new order from the seeded generator; back to the first card."""
        self._rng.shuffle(self.order)
        self.index = 0
        self.showing_back = False
        self._render()

    def plain_text(self) -> str:
        """The fronts of every card in the initial order, and no backs: a saved notebook shows this
        text, and a learner who opens it should meet the questions before the answers."""
        order = "deck order" if self.seed is None else f"shuffled with seed {self.seed}"
        name = f"Flashcards: {self.title}" if self.title else "Flashcards"
        count = f"{len(self.cards)} card{'s' if len(self.cards) != 1 else ''}"
        lines = [f"{name} ({count}, {order})", PLAIN_TEXT_CARDS_NOTE]
        initial = list(range(len(self.cards)))
        if self.seed is not None:
            random.Random(self.seed).shuffle(initial)
        lines += [f"{n}. {self.cards[i]['front']}" for n, i in enumerate(initial, 1)]
        return "\n".join(lines)


def show_quiz(deck: str | list, seed: int | None = 0, **kwargs) -> None:
    """Display the quiz of deck ``deck`` (a name such as ``"01_autograd"``, or a list of
    jupyterquiz dicts). Keyword arguments go to :class:`Quiz`."""
    display(Quiz.from_deck(deck, seed=seed, **kwargs))


def show_flashcards(deck: str | list, seed: int | None = 0, **kwargs) -> None:
    """Display the flashcards of deck ``deck`` (a name or a list of ``{"front", "back"}``)."""
    display(Flashcards.from_deck(deck, seed=seed, **kwargs))
