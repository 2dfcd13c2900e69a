"""Pipeline schedules as data: the orders against torch 2.13's (fixtures recorded from real gloo
runs by tests/fixtures/make_pipeline_fixtures.py), validate against hand-made broken orders,
simulate against hand-worked timelines and the papers' closed forms."""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.parallel.pipeline import schedules as S
from minidist.parallel.pipeline.schedules import Action, ScheduleError, parse_schedule

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "pipeline_schedules.json").read_text())
GENERATORS = {
    "gpipe": lambda p, m, v: S.gpipe(p, m),
    "1f1b": lambda p, m, v: S.one_f_one_b(p, m),
    "zero_bubble": lambda p, m, v: S.zero_bubble(p, m),
    "interleaved_1f1b": S.interleaved_1f1b,
}


def rows(schedule):
    return [" ".join(map(str, row)) for row in schedule]


# --- Action ---------------------------------------------------------------------------------


def test_action_str_is_torchs_form_and_parses_back():
    assert str(Action(2, "F", 0)) == "2F0"
    assert str(Action(1, "B", 3)) == "1B3"
    assert [str(Action(0, k, 1)) for k in "IW"] == ["0I1", "0W1"]
    assert repr([Action(12, "W", 34)]) == "[12W34]"
    for text in ("2F0", "1B3", "0I7", "12W34"):
        assert str(Action.from_str(text)) == text
    assert Action.from_str("1B3") == Action(1, "B", 3)
    stage, kind, microbatch = Action.from_str("3I5")
    assert (stage, kind, microbatch) == (3, "I", 5)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2F0x", "2f0", 7])
def test_action_from_str_rejects_bad_text(text):
    with pytest.raises(ValueError, match="stage.*micro-batch"):
        Action.from_str(text)


@pytest.mark.parametrize("args", [(-1, "F", 0), (0, "X", 0), (0, "F", -2), (0, "F", 1.0), (True, "F", 0)])
def test_action_rejects_bad_fields(args):
    with pytest.raises(ValueError, match="Action"):
        Action(*args)


def test_parse_schedule_takes_strings_lists_and_actions():
    expected = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    assert parse_schedule(["0F0 0B0", "1F0  1B0"]) == expected
    assert parse_schedule([["0F0", Action(0, "B", 0)], ("1F0", "1B0")]) == expected
    with pytest.raises(ValueError, match="'0Q0'"):
        parse_schedule(["0F0 0Q0"])


# --- the orders: hand-worked, then torch's ------------------------------------------------


def test_small_orders_by_hand():
    assert rows(S.gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]
    # 1F1B, p = 3, m = 4: warm-ups 3, 2, 1, then B/F alternating, then the backwards left
    assert rows(S.one_f_one_b(3, 4)) == ["0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
                                         "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
                                         "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"]
    # ZB-H1, p = 3, m = 3: rank r holds back its first r W passes until the end
    assert rows(S.zero_bubble(3, 3)) == ["0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
                                         "1F0 1F1 1I0 1F2 1I1 1W0 1I2 1W1 1W2",
                                         "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2"]
    # interleaved, p = 2, m = 2, v = 2: rank 0 holds stages 0, 2; rank 1 stages 1, 3
    assert rows(S.interleaved_1f1b(2, 2, 2)) == ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
                                                 "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]


def test_one_f_one_b_with_fewer_microbatches_than_stages_runs():
    """Our decision (torch's Schedule1F1B refuses m < p): the order is valid, the ranks whose
    warm-up covers every micro-batch run it as GPipe does, and one micro-batch is naive
    model parallelism."""
    assert rows(S.one_f_one_b(4, 2)) == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1",
                                         "3F0 3B0 3F1 3B1"]
    assert rows(S.one_f_one_b(3, 1)) == rows(S.gpipe(3, 1))
    S.validate(S.one_f_one_b(4, 2))


def test_fixtures_come_from_torch_2_13():
    assert FIXTURES["torch_version"].startswith("2.13")
    kinds = {(e["schedule"], "refused" in e) for e in FIXTURES["entries"]}
    assert kinds >= {("gpipe", False), ("1f1b", False), ("1f1b", True), ("interleaved_1f1b", False),
                     ("interleaved_1f1b", True), ("zero_bubble", False)}


@pytest.mark.parametrize("entry", [e for e in FIXTURES["entries"] if "refused" not in e],
                         ids=lambda e: f"{e['schedule']}-p{e['num_ranks']}-m{e['num_microbatches']}"
                                       f"-v{e['stages_per_rank']}")
def test_orders_equal_what_torch_executes(entry):
    p, m, v = entry["num_ranks"], entry["num_microbatches"], entry["stages_per_rank"]
    assert rows(GENERATORS[entry["schedule"]](p, m, v)) == entry["executed"]


def test_torch_refusals():
    refused = [e for e in FIXTURES["entries"] if "refused" in e]
    for e in refused:
        p, m, v = e["num_ranks"], e["num_microbatches"], e["stages_per_rank"]
        if e["schedule"] == "1f1b":  # torch refuses m < p; we run it (see the test above)
            assert m < p
            S.validate(S.one_f_one_b(p, m))
        else:  # interleaved: torch refuses m that does not split into equal rounds; our rounds differ by one
            assert e["schedule"] == "interleaved_1f1b"
            schedule = S.interleaved_1f1b(p, m, v)
            S.validate(schedule)
            assert sorted(a.microbatch for a in schedule[0] if a.kind == "F" and a.stage == 0) == list(range(m))


# --- every schedule is valid, on a grid including m < p ------------------------------------


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), v=st.integers(1, 3))
def test_every_schedule_validates(p, m, v):
    for schedule in (S.gpipe(p, m), S.one_f_one_b(p, m), S.zero_bubble(p, m)):
        S.validate(schedule)
        assert len(schedule) == p
    schedule = S.interleaved_1f1b(p, m, v)  # any m: rounds that differ by at most one micro-batch
    S.validate(schedule)
    assert [sorted({a.stage for a in row}) for row in schedule] == [list(range(r, p * v, p)) for r in range(p)]


@pytest.mark.parametrize("call, message", [
    (lambda: S.gpipe(0, 4), "num_stages must be an integer >= 1"),
    (lambda: S.one_f_one_b(2, 0), "num_microbatches must be an integer >= 1"),
    (lambda: S.zero_bubble(2.0, 4), "num_stages"),
    (lambda: S.interleaved_1f1b(2, 4, 0), "stages_per_rank"),
    (lambda: S.interleaved_1f1b(True, 4, 2), "num_ranks"),
])
def test_generators_reject_bad_counts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- validate catches broken orders ----------------------------------------------------------


@pytest.mark.parametrize("schedule, message", [
    (["0B0 0F0", "1F0 1B0"], r"rank 0 position 0: 0B0 comes before 0F0"),
    (["0F0 0W0 0I0", "1F0 1B0"], r"0W0 comes before 0I0"),
    # rank 0 waits for 1B0 before it sends 0F1; rank 1 waits for 0F1 before it runs 1B0
    (["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], r"deadlock.*rank 0 waits at 0B0 for 1B0.*rank 1 waits at 1F1 for 0F1"),
    # on one rank: stage 1's forward before stage 0's
    (["1F0 0F0 0B0 1B0"], r"deadlock.*rank 0 waits at 1F0 for 0F0"),
    (["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"], r"missing 1B1"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1B1"], r"missing 1F1"),
    (["0F0 0B0 0B0", "1F0 1B0"], r"0B0 appears twice"),
    (["1F0 1B0", "0F0 0B0 1F1 1B1 0F1 0B1"], r"1F1: stage 1 runs on rank 0 and on rank 1"),
    (["0F0 0I0", "1F0 1B0"], r"missing 0W0"),
    (["0F0 0I0 0W0 0B0", "1F0 1B0"], r"0B0 and 0I0 both present"),
    (["0F0 0B0", "2F0 2B0"], r"stage 1 has no actions"),
])
def test_validate_names_the_fault(schedule, message):
    with pytest.raises(ScheduleError, match=message):
        S.validate(parse_schedule(schedule))


def test_validate_rejects_non_schedules():
    for bad in ([], [["0F0"]], "0F0 0B0", [[(0, "F", 0)]]):
        with pytest.raises(ScheduleError):
            S.validate(bad)
    assert issubclass(ScheduleError, ValueError)


def test_a_deadlock_is_reported_not_hung_at_scale():
    """Rank 3 of an 8-stage 1F1B runs one micro-batch at a time (F0 B0 F1 B1 ...): it waits for
    4B0, while rank 4 waits for 3F1 in its warm-up."""
    schedule = S.one_f_one_b(8, 16)
    schedule[3] = [Action(3, kind, k) for k in range(16) for kind in "FB"]
    with pytest.raises(ScheduleError, match="rank 3 waits at 3B0 for 4B0 .*rank 4 waits at 4F1 for 3F1"):
        S.validate(schedule)


# --- simulate: hand-worked timelines ---------------------------------------------------------


def test_simulate_timeline_by_hand():
    # 1F1B, p = 2, m = 2, t_f = 1, t_b = 2:
    # rank 0: F0 [0,1] F1 [1,2] ........ B0 [4,6] . B1 [7,9]
    # rank 1:          F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    result = S.simulate(S.one_f_one_b(2, 2), t_forward=1, t_backward=2)
    times = {str(a): (result.start[a], result.end[a]) for a in result.start}
    assert times == {"0F0": (0, 1), "0F1": (1, 2), "0B0": (4, 6), "0B1": (7, 9),
                     "1F0": (1, 2), "1B0": (2, 4), "1F1": (4, 5), "1B1": (5, 7)}
    assert result.makespan == 9
    assert result.busy == [6, 6]
    assert result.bubble_fraction == pytest.approx(1 - 12 / 18)
    assert result.timeline(S.one_f_one_b(2, 2)[1])[0] == (Action(1, "F", 0), 1, 2)


def test_simulate_communication_and_uneven_stages_by_hand():
    # GPipe p = 2, m = 1, one message each way costs 0.5; stage 1 is twice as slow
    result = S.simulate(S.gpipe(2, 1), t_forward=[1, 2], t_backward=[1, 2], t_comm=0.5)
    # 0F0 [0,1], 1F0 [1.5,3.5], 1B0 [3.5,5.5], 0B0 [6,7]
    assert [result.end[a] for row in S.gpipe(2, 1) for a in row] == [1, 7, 3.5, 5.5]
    # a whole backward costs t_backward + t_weight; I and W apart
    split = S.simulate(parse_schedule(["0F0 0I0 0W0"]), t_forward=1, t_backward=2, t_weight=3)
    whole = S.simulate(parse_schedule(["0F0 0B0"]), t_forward=1, t_backward=2, t_weight=3)
    assert split.makespan == whole.makespan == 6


@pytest.mark.parametrize("kwargs, message", [
    ({"t_forward": -1}, "t_forward"), ({"t_backward": float("nan")}, "t_backward"),
    ({"t_weight": [1, 2, 3]}, "one per stage"), ({"t_comm": -0.1}, "t_comm"), ({"t_forward": "1"}, "t_forward"),
])
def test_simulate_rejects_bad_times(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S.simulate(S.gpipe(2, 2), **kwargs)


def test_simulate_validates_first():
    with pytest.raises(ScheduleError, match="deadlock"):
        S.simulate(parse_schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]))


# --- simulate: the closed forms ---------------------------------------------------------------

TIMES = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])  # dyadic: sums are exact


@settings(max_examples=80, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), t_f=TIMES, t_b=TIMES)
def test_gpipe_and_1f1b_closed_forms(p, m, t_f, t_b):
    """Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (1F1B): the same bubble,
    (p - 1)/(m + p - 1); GPipe holds m micro-batches on every stage, 1F1B min(m, p - s)."""
    for schedule in (S.gpipe(p, m), S.one_f_one_b(p, m)):
        result = S.simulate(schedule, t_forward=t_f, t_backward=t_b)
        assert result.makespan == (m + p - 1) * (t_f + t_b)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert S.simulate(S.gpipe(p, m)).peak_in_flight == [m] * p
    assert S.simulate(S.one_f_one_b(p, m)).peak_in_flight == [min(m, p - s) for s in range(p)]


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 8), c=TIMES)
def test_gpipe_with_communication(p, m, c):
    """Each micro-batch crosses p - 1 boundaries forward and p - 1 back on the critical path."""
    result = S.simulate(S.gpipe(p, m), t_forward=1, t_backward=2, t_comm=c)
    assert result.makespan == (m + p - 1) * 3 + 2 * (p - 1) * c
    assert S.simulate(S.one_f_one_b(p, m), t_forward=1, t_backward=2, t_comm=c).makespan >= result.makespan


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_over_ideal_is_p_minus_1_over_v_m(p, rounds, v):
    """Narayanan et al. 2021, sec. 2.2.2: with v stages per rank the bubble shrinks to
    (p - 1)/(v m) of the ideal time (m a multiple of p; times per stage, 1/v of a rank's)."""
    m = rounds * p
    t_f, t_b = 1.0, 2.0
    result = S.simulate(S.interleaved_1f1b(p, m, v), t_forward=t_f, t_backward=t_b)
    ideal = v * m * (t_f + t_b)
    assert (result.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)
    if v == 1:  # one stage per rank: the 1F1B bubble (with a longer warm-up)
        assert result.makespan == S.simulate(S.one_f_one_b(p, m)).makespan


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b(p, extra):
    """Qi et al. 2024, sec. 2.1: at t_f = t_b = t_w, ZB-H1's bubble is 1/3 of 1F1B's (the issue
    asks for at most 40 %), with every rank holding p micro-batches, 1F1B's first-rank peak."""
    m = p + extra
    zb = S.simulate(S.zero_bubble(p, m), t_forward=1, t_backward=1, t_weight=1)
    ofob = S.simulate(S.one_f_one_b(p, m), t_forward=1, t_backward=1, t_weight=1)
    assert zb.busy == ofob.busy
    assert zb.bubble_time <= 0.4 * ofob.bubble_time
    assert zb.bubble_time == pytest.approx(ofob.bubble_time / 3)
    assert zb.peak_in_flight == [p] * p
    assert max(zb.peak_in_flight) == max(ofob.peak_in_flight)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 5), extra=st.integers(0, 6), t_f=TIMES, t_b=TIMES, data=st.data())
def test_zero_bubble_h1_makespan(p, extra, t_f, t_b, data):
    """Qi et al. 2024: ZB-H1's bubble per rank is (p - 1)(t_f + t_b - t_w) when W is the
    shortest pass, against 1F1B's (p - 1)(t_f + t_b + t_w)."""
    t_w = data.draw(st.sampled_from([t for t in (0.25, 0.5, 1.0, 1.5, 2.0) if t <= min(t_f, t_b)]))
    m = p + extra
    result = S.simulate(S.zero_bubble(p, m), t_forward=t_f, t_backward=t_b, t_weight=t_w)
    assert result.makespan == m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w)


def test_zero_bubble_with_few_microbatches_still_beats_1f1b():
    for p in (2, 3, 4):
        for m in range(1, p):
            zb = S.simulate(S.zero_bubble(p, m), 1, 1, 1)
            ofob = S.simulate(S.one_f_one_b(p, m), 1, 1, 1)
            assert zb.bubble_time < ofob.bubble_time
            assert zb.peak_in_flight == [m] * p


def test_single_stage_has_no_bubble():
    for schedule in (S.gpipe(1, 5), S.one_f_one_b(1, 5), S.zero_bubble(1, 5), S.interleaved_1f1b(1, 5, 3)):
        result = S.simulate(schedule, t_forward=1, t_backward=2, t_weight=1)
        assert result.bubble_fraction == 0
        assert result.makespan == sum(result.busy)
    assert S.simulate(S.gpipe(2, 2), 0, 0, 0).bubble_fraction == 0  # nothing to do: no bubble, no 0/0
