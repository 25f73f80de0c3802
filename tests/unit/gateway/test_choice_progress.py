"""One choice's answer as its tokens come (`epd.gateway.choice_progress`): the steps' tokens, text
and logprobs joined in order, the finish and stop reasons from the step that carries them, and a
decoder that sends a step's tokens without one logprob each (to a request that asked) stopped with
a clear error rather than answered with logprobs that no longer line up with the tokens."""

from __future__ import annotations

import pytest

from epd.gateway.ask_types import ChoiceSummary
from epd.gateway.choice_progress import ChoiceProgress
from epd.model_runtime.logprobs import TokenLogprob
from epd.stages.contracts import TokenStep


def _lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, f"t{token_id}", -0.5)


def test_a_choices_steps_join_into_its_summary_with_one_logprob_per_token():
    choice = ChoiceProgress(1, logprobs=[])
    choice.add(TokenStep([5], " a", logprobs=[_lp(5)], index=1))
    choice.add(TokenStep([], "", logprobs=None, index=1))  # a step of no token (text held back) has none
    choice.add(TokenStep([6, 7], " red dot", "stop", stop_reason="\n", logprobs=[_lp(6), _lp(7)], index=1))
    assert choice.summary() == ChoiceSummary(
        1, " a red dot", [5, 6, 7], "stop", "\n", [_lp(5), _lp(6), _lp(7)]
    )


def test_a_choice_that_did_not_ask_for_logprobs_keeps_none():
    choice = ChoiceProgress(0)
    choice.add(TokenStep([5], " a", "length", logprobs=[_lp(5)]))
    assert choice.summary() == ChoiceSummary(0, " a", [5], "length", None, None)


@pytest.mark.parametrize("logprobs", [None, [_lp(5)]])
def test_a_decoder_step_without_a_logprob_per_token_is_an_error(logprobs):
    choice = ChoiceProgress(0, logprobs=[])
    with pytest.raises(
        RuntimeError, match=r"the decoder sent 2 tokens with \d logprobs to a request that asked"
    ):
        choice.add(TokenStep([5, 6], " a b", logprobs=logprobs))
