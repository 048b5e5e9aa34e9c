"""spec.rules: what counts as a rule firing (the campaigns' rule-id coverage reads HITS)."""
import pytest

from spec import rules
from spec.rules import HITS, RULES, rule


@pytest.fixture
def scratch_rules():
    """Rules registered by a test leave no trace in the registry or the counts (the
    generated docs list every registered rule)."""
    saved_rules, saved_hits = dict(RULES), dict(HITS)
    yield
    RULES.clear(), RULES.update(saved_rules)
    HITS.clear(), HITS.update(saved_hits)


def test_every_call_counts_unless_applies_says_no(scratch_rules):
    @rule("TEST.EVERY_CALL")
    def every(x, *, scale=1):
        """A rule that fires on every call."""
        return x * scale

    @rule("TEST.WHEN_TRUE", applies=bool)
    def when_true(x):
        """A predicate rule: fires when it returns True."""
        return x > 0

    assert every(2, scale=3) == 6 and every(0) == 0  # arguments (keywords too) reach the function
    assert [when_true(v) for v in (1, 0, 5, -1)] == [True, False, True, False]
    assert HITS["TEST.EVERY_CALL"] == 2
    assert HITS["TEST.WHEN_TRUE"] == 2
    assert every.rule_id == "TEST.EVERY_CALL" and every.__doc__ == "A rule that fires on every call."
    assert RULES["TEST.WHEN_TRUE"].statement == "A predicate rule: fires when it returns True."


def test_a_call_that_raises_does_not_count(scratch_rules):
    @rule("TEST.RAISES")
    def raises():
        """Always fails."""
        raise ValueError("no decision")

    with pytest.raises(ValueError):
        raises()
    assert "TEST.RAISES" not in HITS


def test_a_rule_that_never_fired_reads_zero_without_being_added(scratch_rules):
    assert HITS["TEST.NEVER"] == 0
    assert "TEST.NEVER" not in HITS  # campaigns list sorted(HITS) as the rules that fired
    rules.fired("TEST.NEVER_DECLARED")  # fired() counts by id
    assert HITS["TEST.NEVER_DECLARED"] == 1


def test_priority_queue_lists_in_the_order_it_pops():
    """The waiting queue's listing (the step record's ``computed`` order, the queue trace) is
    the order admission takes requests: priority, then arrival time, then id as a string."""
    from types import SimpleNamespace

    from spec.queues import PriorityQueue

    q = PriorityQueue()
    reqs = [SimpleNamespace(request_id=rid, priority=p, arrival_seq=seq, tie_time=t)
            for rid, p, seq, t in [("2", 1, 0, 5.0), ("10", 1, 1, 5.0), ("a", 0, 2, 9.0), ("b", 1, 3, 1.0), ("c", 2, 4, 0.0)]]
    for r in reqs:
        q.add(r)
    listed = [r.request_id for r in q]
    popped = [q.pop().request_id for _ in reqs]
    assert listed == popped == ["a", "b", "10", "2", "c"]
