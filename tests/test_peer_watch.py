"""The watch on lost ranks (crate_clip/train/loop/peer_watch.py) against a real TCPStore: a rank whose counter stops
is named with its host once `lost_after_s` has passed, a rank that left is not, and a store that is gone (node 0
lost) is said so. The node crash itself, on two network namespaces, is in test_multinode.py."""
import socket
import time
from datetime import timedelta

import torch.distributed as tdist

from crate_clip.train.loop.peer_watch import PeerWatch

LOST_AFTER_S = 0.3


def _stores(n):
    server = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2))
    clients = [tdist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=2)) for _ in range(n)]
    return server, clients


def test_a_silent_rank_is_named_a_rank_that_left_is_not_and_a_gone_store_is_said():
    server, (s0, s1, s2) = _stores(3)
    w0, w1, w2 = (PeerWatch(s, "/t", r, 3, LOST_AFTER_S) for r, s in enumerate((s0, s1, s2)))
    for w in (w0, w1, w2):
        assert w.beat() is None
    w2.leave()   # rank 2 ends normally: never lost
    for _ in range(4):   # ranks 0 and 1 beat for longer than lost_after_s: all is well
        time.sleep(LOST_AFTER_S / 2)
        assert w0.beat() is None and w1.beat() is None
    w0.beat()   # rank 1 falls silent (its node is gone) after its last beat, which rank 0 sees now
    time.sleep(LOST_AFTER_S * 1.5)
    line = w0.beat()
    assert line is not None and line.startswith(f"rank 1 (host {socket.gethostname()}) has not been heard from")
    assert "run.lost_rank_timeout_s=0.3" in line and "rank 2" not in line

    assert w1.beat() is None
    del server   # node 0, which serves the store, is gone: rank 1 cannot reach it
    assert w1.beat() is None   # not yet: a store may miss a beat
    time.sleep(LOST_AFTER_S * 1.5)
    line = w1.beat()
    assert line is not None and "the job's store (at node 0, MASTER_ADDR) has not answered" in line
