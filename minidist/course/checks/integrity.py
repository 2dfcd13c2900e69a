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

numpy given, every submodule of it loaded when the check starts is guarded too (``np.allclose``
calls ``numpy._core.numeric.isclose``: rebinding that one made every comparison true). A name
added to a module that is its own submodule, imported since, is neither a change nor removed:
numpy imports some lazily (``np.unique`` reads ``np.ma``, which ``numpy.__getattr__`` imports on
first use), and deleting it would leave ``np.ma`` recursing forever in numpy's ``__getattr__``.

    @unchanged(sys.modules[__name__], costmodel, sim)
    def check_something(fn): ...
"""
from __future__ import annotations

import contextlib
import inspect
import sys

from minidist.course.checks import fail

_MISSING = object()
WITH_SUBMODULES = ("numpy",)  # packages whose loaded submodules are guarded with them
HINT = ("let your function compute its answer and return it: the check's own names (its constants, its helpers, "
        "the engine's functions it uses) are not yours to change")


def _with_submodules(modules):
    """``modules``, each of :data:`WITH_SUBMODULES` followed by its submodules loaded now."""
    found = []
    for module in modules:
        found.append(module)
        if module.__name__ in WITH_SUBMODULES:
            prefix = module.__name__ + "."
            found += [m for name, m in sorted(sys.modules.items()) if name.startswith(prefix) and m is not None]
    return list({id(m): m for m in found}.values())


def _submodule(owner, name, value) -> bool:
    """Whether ``value``, bound to ``owner.name``, is the module ``owner.name`` itself (an import)."""
    label = getattr(owner, "__name__", None)
    return inspect.ismodule(value) and isinstance(label, str) and sys.modules.get(f"{label}.{name}") is value


def _namespaces(modules):
    """``(label, owner, its namespace)`` for each module (numpy with its loaded submodules) and
    each class it defines or, for a package, that one of its modules defines (``sim.World``),
    each owner once."""
    seen = set()
    for module in _with_submodules(modules):
        yield module.__name__, module, vars(module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and id(value) not in seen and (value.__module__ or "").partition(".")[
                    0] == module.__name__.partition(".")[0] and (value.__module__ == module.__name__ or
                                                                 value.__module__.startswith(module.__name__ + ".")):
                seen.add(id(value))
                yield f"{module.__name__}.{value.__qualname__}", value, vars(value)


@contextlib.contextmanager
def unchanged(*modules):
    """Context manager and decorator: fail with AssertionError naming every name of ``modules``
    (and of the classes they define; numpy's loaded submodules with numpy) that was rebound, added
    (but a submodule imported) or deleted while it was active, after
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
                if name not in before and _submodule(owner, name, namespace[name]):
                    continue  # a submodule imported since (numpy's lazy np.ma): not the learner's doing
                changed.append(f"{label}.{name}")
                try:
                    if name in before:
                        setattr(owner, name, before[name])
                    else:
                        delattr(owner, name)
                except (AttributeError, TypeError):  # a name an extension type does not let go
                    pass
        if changed and not failed:
            fail("the check's own names", f"your code changed {', '.join(sorted(changed)[:5])} while the check ran",
                 HINT)
