"""A check's modules come out of the learner's code as they went in.

``python -m minidist check NN`` puts back every name of the checks and the engine before each of
the exercise's cells (:mod:`minidist.course.grading`), but the learner's function runs *inside*
the check, so one line of it could still change what the rest of the check reads:
``topology_checks.SLACK = 1e9`` in a flat ring's body made check 17 accept a run three times
slower than its bound. :func:`unchanged` is the guard for that: used as a decorator on a check
(or a ``with`` block), it records the names of the modules it is given and of the classes they
define before the check runs, and afterwards puts back any that were rebound, added or deleted
and fails, naming them. Objects mutated in place are not its business (the checks copy what they
hand out); nor is code that sets out to defeat the guard itself: this is not a sandbox.

    @unchanged(sys.modules[__name__], costmodel, sim)
    def check_something(fn): ...
"""
from __future__ import annotations

import contextlib

from minidist.course.checks import fail

_MISSING = object()
HINT = ("let your function compute its answer and return it: the check's own names (its constants, its helpers, "
        "the engine's functions it uses) are not yours to change")


def _namespaces(modules):
    """``(label, owner, its namespace)`` for each module and each class it defines or, for a
    package, that one of its modules defines (``sim.World``)."""
    for module in modules:
        yield module.__name__, module, vars(module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and (value.__module__ or "").partition(".")[0] == module.__name__.partition(
                    ".")[0] and (value.__module__ == module.__name__ or value.__module__.startswith(
                    module.__name__ + ".")):
                yield f"{module.__name__}.{value.__qualname__}", value, vars(value)


@contextlib.contextmanager
def unchanged(*modules):
    """Context manager and decorator: fail with AssertionError naming every name of ``modules``
    (and of the classes they define) that was rebound, added or deleted while it was active, after
    putting each back as it was. An exception raised inside (a check's own failure) wins over this
    one; the names are put back either way."""
    saved = [(label, owner, namespace, dict(namespace)) for label, owner, namespace in _namespaces(modules)]
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        changed = []
        for label, owner, namespace, before in saved:
            for name in [n for n in set(before) | set(namespace) if namespace.get(n, _MISSING) is not
                         before.get(n, _MISSING)]:
                changed.append(f"{label}.{name}")
                if name in before:
                    setattr(owner, name, before[name])
                else:
                    delattr(owner, name)
        if changed and not failed:
            fail("the check's own names", f"your code changed {', '.join(sorted(changed)[:5])} while the check ran",
                 HINT)
