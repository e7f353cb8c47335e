"""The shared tool-choice output rules (frontends/toolcheck.py)."""

from __future__ import annotations

from helios.domain.conversation import ToolChoice
from helios.domain.events import FinishCause, ReasoningDelta, TextDelta, ToolCall
from helios.serving.toolcheck import ToolCallCheck

DECLARED = frozenset({"a", "b"})


def call(name: str) -> ToolCall:
    return ToolCall(id="call_1", name=name, arguments="{}")


def test_auto_accepts_undeclared_calls_and_never_requires_one() -> None:
    check = ToolCallCheck(ToolChoice("auto"), True, DECLARED)
    assert check.check_call(call("zzz")) is None
    assert check.check_finish(FinishCause.EOS) is None
    assert ToolCallCheck(ToolChoice("auto"), True, DECLARED).check_finish(FinishCause.EOS) is None


def test_required_needs_a_declared_call_even_when_truncated() -> None:
    check = ToolCallCheck(ToolChoice("required"), True, DECLARED)
    assert check.check_call(call("zzz")) is None
    assert "no completed call" in (check.check_finish(FinishCause.EOS) or "")
    assert "output limit" in (check.check_finish(FinishCause.LENGTH) or "")
    assert check.check_call(call("a")) is None
    assert check.check_finish(FinishCause.LENGTH) is None
    assert check.check_finish(FinishCause.ERROR) is None  # the caller reports the error itself


def test_named_drops_text_and_fails_on_another_tool_before_it() -> None:
    check = ToolCallCheck(ToolChoice("named", "a"), True, DECLARED)
    events, failure = check.screen([ReasoningDelta("r"), TextDelta("t"), call("a"), call("b"), TextDelta("x")])
    assert events == [ReasoningDelta("r"), call("a")]
    assert failure is not None and "'b'" in failure


def test_parallel_disabled_fails_at_the_second_call() -> None:
    check = ToolCallCheck(ToolChoice("auto"), False, DECLARED)
    events, failure = check.screen([call("a"), TextDelta("between"), call("b")])
    assert events == [call("a"), TextDelta("between")]
    assert failure is not None and "second tool call" in failure
    assert check.num_calls == 1
