"""minidist.course.checks.schedules (exercise 08): the engine's 1F1B passes; orders that are
wrong in each way the check looks for fail, each with its own hint; a stub says it is one."""
import pytest

from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import schedules as schedule_checks
from minidist.parallel.pipeline import schedules
from minidist.parallel.pipeline.pipedream import pipedream_1f1b
from minidist.parallel.pipeline.schedules import Action, gpipe, one_f_one_b


def with_warmup(warmup):
    """1F1B's shape with another warm-up count ``warmup(rank, p, m)``."""
    def order(rank, p, m):
        w = min(m, warmup(rank, p, m))
        out = [Action(rank, "F", k) for k in range(w)]
        for k in range(m - w):
            out += [Action(rank, "B", k), Action(rank, "F", w + k)]
        return out + [Action(rank, "B", k) for k in range(m - w, m)]
    return order


# 1F1B written here (warm-up min(m, p - r)), not the engine's: the engine's may not be an answer.
ORDER = with_warmup(lambda r, p, m: p - r)


def engine_order(rank, num_stages, num_microbatches):
    return ORDER(rank, num_stages, num_microbatches)


def test_an_order_like_the_engines_passes_and_so_do_its_strings():
    assert all(ORDER(r, p, m) == one_f_one_b(p, m)[r] for p, m in schedule_checks.GRID for r in range(p))
    verdict = schedule_checks.check_one_f_one_b_order(engine_order)
    assert verdict.startswith("1F1B order: ok (35 pipelines")
    assert schedule_checks.check_one_f_one_b_order(lambda r, p, m: [str(a) for a in engine_order(r, p, m)])
    assert any(m < p for p, m in schedule_checks.GRID)


@pytest.mark.parametrize("answer, named", [
    (lambda rank, p, m: one_f_one_b(p, m)[rank], "minidist.parallel.pipeline.schedules.one_f_one_b"),
    (lambda rank, p, m: schedules.one_f_one_b_order(rank, m, min(m, p - rank)),
     "minidist.parallel.pipeline.schedules.one_f_one_b_order"),
    (lambda rank, p, m: pipedream_1f1b(p, m)[rank], "minidist.parallel.pipeline.pipedream.pipedream_1f1b"),
])
def test_calling_the_engines_1f1b_is_not_an_answer(answer, named):
    """The old check passed these: they return torch's order, computed by the engine."""
    with pytest.raises(LearnerError, match=f"called {named}, the engine's own implementation, not yours"):
        schedule_checks.check_one_f_one_b_order(answer)
    assert one_f_one_b(3, 4) == [engine_order(r, 3, 4) for r in range(3)]  # the engine works again afterwards


def test_the_engines_function_itself_is_not_an_answer():
    with pytest.raises(AssertionError, match=r"this is minidist.parallel.pipeline.schedules.one_f_one_b_order, the "
                                             r"engine's own implementation, not yours"):
        schedule_checks.check_one_f_one_b_order(schedules.one_f_one_b_order)


@pytest.mark.parametrize("extra", [1, 2])
def test_a_warmup_too_long_gets_a_hint_about_the_warmup_count(extra):
    """One or two forwards more than min(m, p - r) before the first backward: same makespan,
    more activations held. The old hint spoke of the steady state only."""
    with pytest.raises(AssertionError) as failure:
        schedule_checks.check_one_f_one_b_order(with_warmup(lambda r, p, m: p - r + extra))
    message = str(failure.value)
    assert "p = 1 stage, m = 2 micro-batches: rank 0 holds up to 2 micro-batches' activations" in message
    assert "Hint: rank 0's warm-up is 2 forwards before its first backward; 1F1B's is min(m, p - r) = 1" in message
    assert "each forward past min(m, p - r) holds one more micro-batch's activations" in message


def test_gpipes_order_has_the_same_makespan_and_fails_on_memory():
    expected = (r"(?s)p = 1 stage, m = 2 micro-batches: rank 0 holds up to 2 .*min\(m, p - r\) = 1"
                r".*Hint: rank 0's warm-up is 2 forwards before its first backward.*GPipe's order")
    with pytest.raises(AssertionError, match=expected):
        schedule_checks.check_one_f_one_b_order(lambda r, p, m: gpipe(p, m)[r])


def test_too_few_warmup_forwards_fill_the_pipeline_too_slowly():
    # One forward, then its backward: naive model parallelism, valid but slower.
    expected = r"(?s)p = 2 stages, m = 2 .*makespan .* is 12, .* = 9.*Hint: rank 0's warm-up is 1 forward before its"
    with pytest.raises(AssertionError, match=expected):
        schedule_checks.check_one_f_one_b_order(with_warmup(lambda r, p, m: 1))


def test_an_order_that_deadlocks_is_named_with_a_hint():
    # More warm-up on later ranks: rank 0 waits for rank 1's backward, which waits for rank 0's forward.
    expected = r"(?s)p = 2 stages, m = 2 .*deadlock: no rank can go on.*Hint: a rank waits for a backward's gradient"
    with pytest.raises(AssertionError, match=expected):
        schedule_checks.check_one_f_one_b_order(with_warmup(lambda r, p, m: r + 1))


def test_a_backward_before_its_forward_is_refused():
    with pytest.raises(AssertionError, match=r"(?s)comes before 0F0.*Hint: a backward needs its own"):
        schedule_checks.check_one_f_one_b_order(lambda r, p, m: [Action(r, "B", 0), Action(r, "F", 0)]
                                                + engine_order(r, p, m)[2:])


def test_backwards_out_of_order_are_slower_and_named():
    def reversed_cooldown(r, p, m):
        order = engine_order(r, p, m)
        tail = order[-min(m, p - r):]
        return order[:len(order) - len(tail)] + sorted(tail, key=lambda a: -a.microbatch)

    with pytest.raises(AssertionError, match=r"(?s)p = 2 stages, m = 2 .*makespan .* is 11, .* = 9.*Hint: take the "
                                             r"micro-batches in order"):
        schedule_checks.check_one_f_one_b_order(reversed_cooldown)


def test_relabelled_microbatches_match_the_closed_forms_but_not_torchs_order():
    # Micro-batches 0 and 1 swapped everywhere: valid, as fast, as lean; not the order torch runs.
    def swapped(r, p, m):
        swap = {0: 1, 1: 0} if m > 1 else {}
        return [Action(a.stage, a.kind, swap.get(a.microbatch, a.microbatch)) for a in engine_order(r, p, m)]

    with pytest.raises(AssertionError, match=r"(?s)p = 1 stage, m = 2 micro-batches: rank 0 position 0: 0F1, where "
                                             r"torch's Schedule1F1B runs 0F0.*Hint: take the micro-batches in order"):
        schedule_checks.check_one_f_one_b_order(swapped)


@pytest.mark.parametrize("bad, message", [
    (lambda r, p, m: None, r"returned None"),
    (lambda r, p, m: "0F0 0B0", r"expected a list of Actions, got str"),
    (lambda r, p, m: [("F", 0)], r"item 0 is \('F', 0\), not an Action"),
    (lambda r, p, m: [Action(0, a.kind, a.microbatch) for a in engine_order(r, p, m)], r"rank=1.*an action of stage 0"),
    (lambda r, p, m: [Action(r, "F", 0), Action(r, "I", 0), Action(r, "W", 0)], r"1F1B runs whole backwards"),
    (lambda r, p, m: [Action(r, "F", 0), Action(r, "B", 0), Action(r, "B", 0)], r"backwards \[0\] repeated"),
    (lambda r, p, m: [Action(r, "F", 0)], r"missing backwards of micro-batches \[0\]"),
])
def test_malformed_lists_fail_with_what_is_wrong(bad, message):
    with pytest.raises(AssertionError, match=message):
        schedule_checks.check_one_f_one_b_order(bad)


def test_a_stub_says_it_is_one_and_other_errors_name_the_learners_line():
    def stub(rank, num_stages, num_microbatches):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT.split(":")[0]):
        schedule_checks.check_one_f_one_b_order(stub)

    def broken(rank, num_stages, num_microbatches):
        return [Action(rank, "F", k) for k in range(num_microbatches)][num_microbatches]

    with pytest.raises(LearnerError, match=r"(?s)raised IndexError.*your line \d+ in broken"):
        schedule_checks.check_one_f_one_b_order(broken)
