"""The byte counter keeps no module-level state (issue 32 item 3): a counter sees the collectives of
the context that opened it (nested blocks each theirs, another thread none of them), and autograd's
device threads, which run a CUDA backward outside the caller's context, count into the caller's
counters through the context autograd stashes for them at ``backward()``."""
import contextvars
import threading

import pytest
import torch

from seqpar.distributed import count_comm
from seqpar.distributed.comm_counter import open_counters, record


def test_a_counter_counts_its_own_contexts_collectives():
    x = torch.zeros(4)  # 16 bytes
    elsewhere = []

    def other_thread():
        with count_comm() as c:
            record("all_reduce", x, None)
        elsewhere.append(c.bytes)

    with count_comm() as outer:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        record("all_gather", x, None)
        with count_comm() as inner:
            record("all_reduce", x, None)
    record("all_reduce", x, None)  # no counter open
    assert outer.bytes == {"all_gather": 16, "all_reduce": 16} and inner.bytes == {"all_reduce": 16}
    assert elsewhere == [{"all_reduce": 16}] and open_counters() == ()


@pytest.mark.skipif(not hasattr(torch._C, "_stash_obj_in_tls"), reason="this torch stashes no context")
def test_a_backward_device_thread_counts_into_the_callers_counter():
    x = torch.zeros(2)
    with count_comm() as c:
        at_backward = contextvars.copy_context()  # what autograd stashes when backward() starts

    def device_thread():  # a thread of its own context, as the engine's CUDA threads are
        torch._C._stash_obj_in_tls("context", at_backward)
        try:
            record("send_recv", x, None, ops=2)
        finally:
            torch._C._remove_obj_from_tls("context")

    worker = threading.Thread(target=device_thread)
    worker.start()
    worker.join()
    assert c.calls == {"send_recv": 1} and c.bytes == {"send_recv": 8}
