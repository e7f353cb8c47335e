"""The shared tool-choice output rules (helios/serving/toolcheck.py), as the serving drivers apply them."""

from __future__ import annotations

from helios.domain.conversation import ConversationRequest, Message, TextPart, Tool, ToolChoice
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


def test_arguments_must_be_a_json_object_in_every_mode() -> None:
    for choice in (ToolChoice("auto"), ToolChoice("required"), ToolChoice("named", "a")):
        check = ToolCallCheck(choice, True, DECLARED)
        assert "not valid JSON" in (check.check_call(ToolCall("c", "a", "{oops")) or "")
        assert "not a JSON object" in (check.check_call(ToolCall("c", "a", "[1]")) or "")
        assert "not a JSON object" in (check.check_call(ToolCall("c", "a", '"x"')) or "")
        assert check.num_calls == 0  # a rejected call is not counted
        assert check.check_call(ToolCall("c", "a", "  ")) is None  # no arguments: an empty object
        assert check.check_call(ToolCall("c2", "a", '{"q": 1}')) is None and check.num_calls == 2
    events, failure = ToolCallCheck(ToolChoice("auto"), True, DECLARED).screen(
        [TextDelta("t"), ToolCall("c", "a", "[]"), TextDelta("after")])
    assert events == [TextDelta("t")] and failure is not None and "'a'" in failure


def test_for_conversation_takes_the_choice_parallelism_and_declared_names() -> None:
    conv = ConversationRequest(messages=(Message("user", (TextPart("hi"),)),),
                               tools=(Tool("a", None, {}), Tool("b", None, {})),
                               tool_choice=ToolChoice("required"), parallel_tool_calls=False)
    check = ToolCallCheck.for_conversation(conv)
    assert (check.choice, check.parallel, check.declared) == (ToolChoice("required"), False, DECLARED)
    assert check.check_call(call("zzz")) is None and check.num_satisfying == 0  # undeclared: not satisfying
    assert "second tool call" in (check.check_call(call("a")) or "")
    assert ToolCallCheck.for_conversation(conv, declared=["zzz"]).declared == frozenset({"zzz"})
