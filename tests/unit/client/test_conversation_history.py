"""`epd.client.conversation.History`: what each turn of a conversation sends, and the checks a
conversation makes before any call (no servers)."""

from __future__ import annotations

import pytest

from epd.client import VIDEO, EpdClient, Message
from epd.client.conversation import History
from epd.stages.messages import check_messages


def test_each_turn_sends_the_history_then_the_question():
    history = History()
    assert history.messages_for("how many?") == [Message.user(VIDEO, "how many?")]
    history.add("how many?", "two")
    history.add("which first?", "the circle")
    assert history.num_turns == 2
    third = history.messages_for("and last?")
    assert third == [
        Message.user(VIDEO, "how many?"), Message.assistant("two"),
        Message.user("which first?"), Message.assistant("the circle"),
        Message.user("and last?"),
    ]  # fmt: skip
    check_messages(third)  # one media part, in the first user turn; ends with the user's
    assert history.messages == third[:-1] and history.messages is not history.messages
    history.reset()
    assert history.messages == [] and history.messages_for("again") == [Message.user(VIDEO, "again")]


def test_a_system_message_goes_first_once():
    history = History(system="answer briefly")
    history.add("how many?", "two")
    assert history.messages_for("which?") == [
        Message.system("answer briefly"), Message.user(VIDEO, "how many?"), Message.assistant("two"),
        Message.user("which?"),
    ]  # fmt: skip


def test_a_text_only_history_has_no_media_part():
    history = History(system="answer briefly", with_media=False)
    history.add("name a colour", "red")
    turn = history.messages_for("another?")
    assert turn == [Message.system("answer briefly"), Message.user("name a colour"), Message.assistant("red"),
                    Message.user("another?")]  # fmt: skip
    check_messages(turn)


def test_an_empty_question_is_refused_before_any_call():
    with pytest.raises(ValueError, match="the question is empty"):
        History().messages_for("  ")


def test_an_unknown_option_is_refused_when_the_conversation_is_made(tmp_path):
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"not really a video")
    # No server listens there: the options are checked before any call is made.
    with EpdClient("127.0.0.1:1", timeout_s=1) as client:
        with pytest.raises(TypeError, match="unknown options"):
            client.conversation(video, num_frame=8)
        chat = client.conversation(video, num_frames=8, timeout_s=5)
        assert chat.history == [] and chat.options == {"num_frames": 8, "timeout_s": 5}
        assert len(chat.media_sha256) == 64
