"""What runs next to a learner's code when ``python -m minidist check NN`` grades it.

A learner's code runs in the same process as the checks that grade it (the notebook's kernel,
each rank of the mpirun script), so one line of it could otherwise change the verdict:
``get_ipython().set_custom_exc(...)`` hides every later error, ``checks.x.check_y = lambda *a:
None`` makes a check pass, ``os._exit(0)`` ends a rank with status 0 before any check ran. The
runner (:mod:`minidist.course.runner`) therefore grades with the exercise's own cells and script
(generated from ``solutions/``, not the learner's copy), and runs each of them through this
module, which, before it runs the exercise's code:

- puts back what the learner's code may have replaced: every name of every ``minidist`` module,
  of the classes they define, and of ``builtins``, ``os``, ``numpy`` (every loaded submodule of
  it: ``np.allclose`` calls ``numpy._core.numeric.isclose``) and a few other modules the checks
  use (:class:`Snapshot`, taken before the first line of the learner's code), and
  ``sys.meta_path`` and ``sys.path_hooks`` (an import hook could serve a fake module);
- imports ``minidist.course.checks`` and its modules afresh (:func:`purge_checks`), and binds
  the exercise's imports and names again in the notebook's namespace;
- in a kernel, drops the exception handlers of ``set_custom_exc`` and catches every exception
  itself;

and, since the learner's functions run *inside* the exercise's cells (the checks call them),
fails a cell during which a name was changed that the checks read: any name of the checks'
modules, or a function, class or module bound in a ``minidist`` module, in one of its classes
or in :data:`PROTECTED_MODULES` (numpy's submodules included), or a ``minidist`` function's code
(:meth:`Snapshot.changed`; ``topology_checks.SLACK = 1e9`` or ``np.array_equal = lambda *a: True``
in a learner's function body would otherwise have changed what the rest of the check saw);

and counts a cell or a rank as passed only on positive evidence: a record it appends to the
report file named by :data:`REPORT_ENV` (with the run's nonce, :data:`NONCE_ENV`, which the
runner passes in the environment and this module removes from it before any learner code
runs). A kernel or a rank that dies or exits early (``os._exit(0)``, ``sys.exit(0)``) writes no
record, and the runner counts that as a failure.

This is not a sandbox: code that reads this module and sets out to defeat it can. It makes the
verdict independent of the learner's copy of the checks and of the patches one line can make.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

REPORT_ENV = "MINIDIST_CHECK_REPORT"
NONCE_ENV = "MINIDIST_CHECK_NONCE"
CHECKS_PACKAGE = "minidist.course.checks"
# Modules outside minidist whose functions the checks call (np.allclose, os.replace, ...).
PROTECTED_MODULES = ("builtins", "os", "posixpath", "math", "time", "tempfile", "shutil", "threading",
                     "traceback", "secrets", "numpy", "numpy.random", "numpy.linalg", "numpy.testing")
# Packages whose every loaded submodule is protected too: np.allclose calls the isclose of
# numpy._core.numeric, np.max the _amax of numpy._core._methods, ... so one line such as
# ``numpy._core.numeric.isclose = lambda *a, **k: True`` would otherwise make every comparison
# of the checks true (about 100 modules, 5,000 names: a tenth of a millisecond to snapshot).
PROTECTED_PACKAGES = ("numpy",)
_MISSING = object()


def _is_minidist(name: str) -> bool:
    return name == "minidist" or name.startswith("minidist.")


def _is_protected(name: str) -> bool:
    """A module :class:`Snapshot` watches besides ``minidist``'s: one of :data:`PROTECTED_MODULES`
    or a submodule of one of :data:`PROTECTED_PACKAGES`."""
    return name in PROTECTED_MODULES or any(name.startswith(package + ".") for package in PROTECTED_PACKAGES)


def describe(error: BaseException) -> str:
    """``"AssertionError: message"`` (the class's own name, as IPython shows it), or the name
    alone when the message is empty."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Snapshot:
    """The namespaces a learner's code could patch, as they are when the snapshot is taken:
    every loaded ``minidist`` module, :data:`PROTECTED_MODULES` and the loaded submodules of
    :data:`PROTECTED_PACKAGES` (numpy's: their ``sys.modules`` entry
    and every name in them), the classes the ``minidist`` modules define (every attribute), the
    code object of every ``minidist`` function and method in them (``f.__code__ = ...``),
    ``sys.meta_path`` and ``sys.path_hooks``. :meth:`restore` puts all of it back."""

    def __init__(self):
        self.modules, self.classes = {}, []
        for name, module in list(sys.modules.items()):
            if module is None or not (_is_minidist(name) or _is_protected(name)):
                continue
            self.modules[name] = (module, dict(vars(module)))
            if _is_minidist(name):
                self.classes += [(value, dict(vars(value))) for value in vars(module).values()
                                 if isinstance(value, type) and value.__module__ == name]
        namespaces = [saved for _, saved in self.modules.values()] + [saved for _, saved in self.classes]
        self.code = {value: value.__code__ for saved in namespaces for value in saved.values()
                     if inspect.isfunction(value) and _is_minidist(value.__module__ or "")}
        self.code.update({value.__func__: value.__func__.__code__ for saved in namespaces for value in saved.values()
                          if isinstance(value, (staticmethod, classmethod)) and inspect.isfunction(value.__func__)})
        self.import_hooks = {attr: list(getattr(sys, attr)) for attr in ("meta_path", "path_hooks")}

    def restore(self) -> None:
        """Undo every change to the snapshot's namespaces: replaced or deleted names come back,
        names added to a class are removed (names added to a module are left: a submodule
        imported since is one), and a ``minidist`` module loaded since is dropped from
        ``sys.modules`` so that the next import loads it afresh."""
        for name, (module, saved) in self.modules.items():
            sys.modules[name] = module
            current = vars(module)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        for cls, saved in self.classes:
            current = vars(cls)
            for key in [k for k in current if k not in saved]:
                try:
                    delattr(cls, key)
                except (AttributeError, TypeError):
                    pass
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    try:
                        setattr(cls, key, value)
                    except (AttributeError, TypeError):
                        pass
        for function, code in self.code.items():
            if function.__code__ is not code:
                function.__code__ = code
        for attr, saved in self.import_hooks.items():
            getattr(sys, attr)[:] = saved
        for name in [n for n in sys.modules if _is_minidist(n) and n not in self.modules]:
            _forget(name)


    def changed(self) -> list[str]:
        """What was changed since the snapshot that a check could be fooled by (sorted
        ``module.name`` labels): a name of a module of :data:`CHECKS_PACKAGE` rebound or deleted;
        in any other module of the snapshot or class of a ``minidist`` module, a function,
        class, module or other callable rebound or deleted, or a name that held plain data
        rebound to one of those (the engine's own state, a deadline or a counter, may change);
        a ``minidist`` function's code replaced. Names added to a module are not counted (a
        submodule imported since is one); names added to a class are."""
        def suspicious(before, now) -> bool:
            return callable(before) or inspect.ismodule(before) or callable(now) or inspect.ismodule(now)

        found = []
        for name, (module, saved) in self.modules.items():
            current, strict = vars(module), name == CHECKS_PACKAGE or name.startswith(CHECKS_PACKAGE + ".")
            for key, value in saved.items():
                now = current.get(key, _MISSING)
                if now is not value and not key.startswith("__") and (strict or now is _MISSING or
                                                                     suspicious(value, now)):
                    found.append(f"{name}.{key}")
        for cls, saved in self.classes:
            current = vars(cls)
            for key in set(current) | set(saved):
                value, now = saved.get(key, _MISSING), current.get(key, _MISSING)
                if now is not value and not key.startswith("__") and (value is _MISSING or now is _MISSING or
                                                                     suspicious(value, now)):
                    found.append(f"{cls.__module__}.{cls.__qualname__}.{key}")
        found += [f"{f.__module__}.{f.__qualname__}.__code__" for f, code in self.code.items()
                  if f.__code__ is not code]
        return sorted(found)


CHANGED_HINT = ("let your function compute its answer and return it: the checks' names, the engine's functions and "
                "numpy's are not yours to change while the check runs (in your own cells they are put back anyway)")


def _forget(name: str) -> None:
    """Drop module ``name`` from ``sys.modules`` and from its package's attributes."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    package = sys.modules.get(parent)
    if package is not None and child in vars(package):
        delattr(package, child)


def purge_checks() -> None:
    """Forget :data:`CHECKS_PACKAGE` and its modules, so that the next import runs their
    source again: a check replaced or mutated in the old module objects is gone."""
    for name in sorted((n for n in sys.modules if n == CHECKS_PACKAGE or n.startswith(CHECKS_PACKAGE + ".")),
                       reverse=True):
        _forget(name)


def import_statements(sources) -> str:
    """The top-level ``import`` and ``from ... import`` statements of the Python ``sources``
    (cells of a notebook, a script), one per line, in order, without repeats; ``from
    __future__`` imports and sources that do not parse are left out."""
    lines = []
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:  # an IPython magic, a half-written cell: not the exercise's imports
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__":
                line = ast.unparse(node)
                if line not in lines:
                    lines.append(line)
    return "\n".join(lines)


class Report:
    """The report file: one JSON line per cell or rank graded, each carrying the nonce.

    ``Report(path, nonce).write(key, passed, error)`` appends ``{"nonce", "key", "passed",
    "error"}``; :meth:`read` returns ``{key: (passed, error)}`` of the lines with the nonce
    (anything else in the file is ignored), the last line of each key. :meth:`from_env` takes the path and nonce from
    :data:`REPORT_ENV` and :data:`NONCE_ENV` and removes both from ``os.environ``."""

    def __init__(self, path, nonce: str):
        self.path, self.nonce = str(path), nonce

    @classmethod
    def from_env(cls) -> Report:
        path, nonce = os.environ.pop(REPORT_ENV, None), os.environ.pop(NONCE_ENV, None)
        if not path or not nonce:
            raise RuntimeError(f"grading needs {REPORT_ENV} and {NONCE_ENV} in the environment: "
                               "run it through `python -m minidist check NN`")
        return cls(path, nonce)

    def write(self, key, passed: bool, error: str = "") -> None:
        line = json.dumps({"nonce": self.nonce, "key": key, "passed": bool(passed), "error": error})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def records(self) -> list[tuple]:
        """Every ``(key, passed, error)`` written with this nonce, in order."""
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError:
            return []
        found = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("nonce") == self.nonce:
                found.append((record.get("key"), record.get("passed") is True, str(record.get("error", ""))))
        return found

    def read(self) -> dict:
        """``{key: (passed, error)}``, the last record of each key."""
        return {key: (passed, error) for key, passed, error in self.records()}

    def count(self, key) -> int:
        """How many records of ``key`` there are."""
        return sum(1 for k, _, _ in self.records() if k == key)


# ----------------------------------------------------------------------------- in the notebook's kernel


def install(shell, name: str, sources: list[str]) -> None:
    """Set up grading in an IPython kernel before any learner code runs (the runner's first
    cell calls it): import everything the exercise's cells ``sources`` import, take the
    :class:`Snapshot`, and bind in the user namespace, under ``name``, the function
    ``name(k)`` that runs the exercise's cell ``sources[k]`` as the module docstring says
    and writes its record (key ``k``) to the :class:`Report` of the environment.

    Inside, the cell's source goes through IPython's ``transform_cell`` (magics work) and runs
    in the user namespace, after the names the exercise's earlier cells bound are bound again;
    every exception is caught, recorded and printed (so a cell that fails shows its traceback),
    KeyboardInterrupt (the runner's timeout) is re-raised after the record."""
    report = Report.from_env()
    user_ns = shell.user_ns
    imports = import_statements(sources)
    exec(compile(imports, "<the exercise's imports>", "exec"), {})  # the exercise's own imports
    snapshot = Snapshot()
    bound: dict = {}  # names the exercise's own cells bound, and their values

    def run_exercise_cell(index: int) -> None:
        snapshot.restore()
        purge_checks()
        shell.custom_exceptions = ()  # set_custom_exc's handlers no longer see anything
        sys.settrace(None)
        sys.setprofile(None)
        user_ns.update(bound)
        before = dict(user_ns)
        passed, error = False, "did not finish"
        try:
            exec(compile(imports, "<the exercise's imports>", "exec"), user_ns)  # fresh checks
            guard = Snapshot()  # the checks just imported, the engine as restored
            code = compile(shell.transform_cell(sources[index]), f"<exercise cell {index}>", "exec")
            exec(code, user_ns)  # the exercise's cell, from solutions/
            changed = guard.changed()
            if changed:
                raise AssertionError(f"your code changed {', '.join(changed[:5])}"
                                     f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''} while this "
                                     f"cell's checks ran\nHint: {CHANGED_HINT}")
            passed, error = True, ""
        except BaseException as exception:  # every way out of a cell is recorded
            error = describe(exception)
            traceback.print_exc()
            if isinstance(exception, KeyboardInterrupt):
                report.write(index, False, error)
                raise
        finally:
            for key, value in list(user_ns.items()):
                if not key.startswith("_") and before.get(key, _MISSING) is not value:
                    bound[key] = value
        report.write(index, passed, error)

    user_ns[name] = run_exercise_cell


# ----------------------------------------------------------------------------- on every rank of a script


def grade_script(truth_file, answer_file, names) -> int:
    """Grade the learner's mpirun script ``answer_file`` on this rank (under mpiexec): run its
    top level (its ``if __name__ == "__main__":`` part does not run), then the exercise's own
    script ``truth_file`` (generated from ``solutions/``, stubs included) as a module in which
    ``names`` (what the learner writes) are the learner's, and call its ``main()``.

    Before the exercise's script runs, the :class:`Snapshot` taken before the learner's code is
    restored and the checks are imported afresh (:func:`purge_checks`). The rank passes when
    ``main()`` returns 0 or None; it then writes its record (key: the rank) to the
    :class:`Report` of the environment, as it does when it fails. Returns the exit status: 0,
    or 1 (the exception's traceback printed to stderr, as Python prints it)."""
    from mpi4py import MPI  # noqa: PLC0415 (optional dependency: only a script under mpiexec needs it)

    report = Report.from_env()
    rank = MPI.COMM_WORLD.Get_rank()
    truth = Path(truth_file).read_text(encoding="utf-8")
    code = compile(truth, str(truth_file), "exec")
    exec(compile(import_statements([truth]), str(truth_file), "exec"), {})  # loaded before the snapshot
    snapshot = Snapshot()
    try:
        learner = runpy.run_path(str(answer_file), run_name="__exercise__")
        missing = [n for n in names if n not in learner]
        if missing:
            raise AssertionError(f"{Path(answer_file).name} no longer defines {', '.join(missing)}\n"
                                 f"Hint: keep the definitions the exercise gave (write your code inside them)")
        snapshot.restore()
        purge_checks()
        sys.settrace(None)
        sys.setprofile(None)
        namespace = {"__name__": "__check__", "__file__": str(answer_file)}
        exec(code, namespace)  # the exercise's script, from solutions/
        namespace.update({n: learner[n] for n in names})
        guard = Snapshot()  # the checks the script imported, the engine as restored
        status = namespace["main"]()
        changed = guard.changed()
        if changed:
            raise AssertionError(f"your code changed {', '.join(changed[:5])} while the checks ran\n"
                                 f"Hint: {CHANGED_HINT}")
    except BaseException as exception:  # SystemExit and KeyboardInterrupt included
        if isinstance(exception, SystemExit) and exception.code in (0, None):
            exception = AssertionError("your code called sys.exit before the checks finished")
        sys.stderr.write("".join(traceback.format_exception(exception)) if not isinstance(exception, AssertionError)
                         else f"AssertionError: {exception}\n")
        sys.stderr.flush()
        report.write(rank, False, describe(exception))
        return 1
    passed = status in (0, None)
    report.write(rank, passed, "" if passed else f"main() returned {status!r}")
    return 0 if passed else 1
