"""The stage sender's bucket loop (weights/pipeline.py): bucket k is sent on one thread while
the caller builds bucket k + 1, never two in flight, in order; a failed send drops the later
buckets and is reported; the thread is joined when the block ends, also on an error."""

from __future__ import annotations

import threading

import pytest

from megatron_fr.weights.pipeline import THREAD_NAME, BucketSender


def sender_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


class GatedSend:
    """A send that blocks until the test releases it, recording what overlapped."""

    def __init__(self, fail_at: int | None = None, raise_at: int | None = None):
        self.fail_at, self.raise_at = fail_at, raise_at
        self.sent: list[str] = []
        self.threads: set[str] = set()
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def __call__(self, bucket) -> str | None:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.threads.add(threading.current_thread().name)
        self.started.release()
        self.release.acquire()
        with self.lock:
            self.in_flight -= 1
        index = len(self.sent) + 1
        self.sent.append(bucket)
        if index == self.raise_at:
            raise ValueError(f"bug in bucket {index}")
        return f"bucket {index} lost" if index == self.fail_at else None


def test_the_next_bucket_is_built_while_one_is_sent_and_never_two_are_in_flight():
    send = GatedSend()
    with BucketSender(send, overlap=True) as sender:
        sender.submit("b1")
        assert send.started.acquire(timeout=10)  # b1 is on the wire, the caller is free:
        built_meanwhile = "b2"  # here the caller builds the next bucket
        waiter = threading.Thread(target=sender.submit, args=(built_meanwhile,))
        waiter.start()
        waiter.join(timeout=0.2)
        assert waiter.is_alive(), "submit(b2) must wait until b1 is sent"
        send.release.release()  # b1 done: b2 goes
        waiter.join(timeout=10)
        assert send.started.acquire(timeout=10)
        send.release.release()
        sender.submit("b3")
        send.release.release()
        assert sender.finish() is None
    assert send.sent == ["b1", "b2", "b3"] and send.most_in_flight == 1
    assert len(send.threads) == 1 and next(iter(send.threads)).startswith(THREAD_NAME)
    assert not sender_threads()


def test_a_failed_send_drops_the_later_buckets_and_is_reported_after_the_thread_joined():
    send = GatedSend(fail_at=2)
    for _ in range(5):
        send.release.release()
    with BucketSender(send, overlap=True) as sender:
        for bucket in ("b1", "b2", "b3", "b4"):
            sender.submit(bucket)  # the caller goes on (its peers wait in its exchanges)
        assert sender.finish() == "bucket 2 lost"
    assert send.sent == ["b1", "b2"]
    assert not sender_threads()


def test_in_line_sending_is_the_same_loop_on_the_callers_thread():
    send = GatedSend(fail_at=2)
    for _ in range(5):
        send.release.release()
    with BucketSender(send, overlap=False) as sender:
        for bucket in ("b1", "b2", "b3"):
            sender.submit(bucket)
        assert sender.finish() == "bucket 2 lost"
    assert send.sent == ["b1", "b2"] and send.threads == {threading.current_thread().name}


def test_an_unexpected_error_in_a_send_is_raised_to_the_caller_and_the_thread_joined():
    send = GatedSend(raise_at=1)
    for _ in range(3):
        send.release.release()
    with pytest.raises(ValueError, match="bug in bucket 1"), BucketSender(send) as sender:
        sender.submit("b1")
        sender.submit("b2")
    assert send.sent == ["b1"]
    assert not sender_threads()


@pytest.mark.gpu
def test_the_send_thread_runs_on_the_senders_cuda_device():
    """A PP stage's sending rank on GPU d sends from a thread whose current device is d too (a
    new thread starts on GPU 0). On a one-GPU machine d is 0 and this shows only that the
    thread's setup runs."""
    import torch

    device = torch.cuda.device_count() - 1
    torch.cuda.set_device(device)
    seen: list[int] = []
    with BucketSender(lambda bucket: seen.append(torch.cuda.current_device()), overlap=True) as s:
        s.submit([])
        assert s.finish() is None
    assert seen == [device]
