"""The course machinery, kept apart from the engine.

- ``quiz``       flashcards and quizzes on ipywidgets; decks in ``quizzes/``
- ``exercises``  writes ``exercises/`` from ``solutions/`` (one source of truth)
- ``checks``     the assert-based checks exercises call, one module per topic
- ``runner``     ``python -m minidist check NN``: runs an exercise as the grader does
"""
