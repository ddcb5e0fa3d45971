"""The serve worker's queue: a client that asks again the moment it is answered is not refused, even with the
queue at its limit."""
import threading
from types import SimpleNamespace

import pytest

from m1.schema import Question
from m1.serve.batcher import Batcher
from m1.serve.limits import Limits
from m1.serve.protocol import ApiError


class _Team:
    """Answers each question with its id, one batch at a time, once the test opens the gate."""

    def __init__(self):
        self.cfg = SimpleNamespace(limits=SimpleNamespace(batch_episodes=4))
        self.gate, self.batches = threading.Event(), []

    def run(self, questions):
        self.gate.wait(30)
        self.batches.append([q.id for q in questions])
        return [q.id for q in questions]

    def forget_video(self, video):
        pass


def _q(i: int) -> Question:
    return Question(id=f"q{i}", video="/nowhere.mp4", text="What?")


def test_a_client_answered_can_ask_again_at_once_with_the_queue_at_its_limit():
    team = _Team()
    batcher = Batcher(team, Limits(max_queue=2, gather_s=0.0))
    first = batcher.submit(_q(0), None)
    for _ in range(300):  # the worker took q0 and waits at the gate
        if batcher.pending == 1 and not batcher._queue:
            break
        threading.Event().wait(0.01)
    second = batcher.submit(_q(1), None)  # waits: one running, one queued = max_queue
    with pytest.raises(ApiError) as full:
        batcher.submit(_q(9), None)
    assert full.value.status == 429
    again: list = []
    # q0's client sends its next question the moment its answer is out (the callback runs as the reply is set)
    first.future.add_done_callback(lambda f: again.append(batcher.submit(_q(2), None)))
    team.gate.set()
    assert first.future.result(30) == "q0" and second.future.result(30) == "q1"
    assert again and again[0].future.result(30) == "q2"
    assert team.batches[0] == ["q0"] and sorted(sum(team.batches[1:], [])) == ["q1", "q2"]
    batcher.drain(30)
