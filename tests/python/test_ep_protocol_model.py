"""A model of the IntraNode protocol between ranks (no GPU): W ranks run the same sequence of
dispatches and combines, every block of every kernel taking its steps in a random interleaving,
and the model checks what the kernels rely on:
  * nobody writes a signal slot, receive slot or arrival counter that its owner has not finished
    with (the slots of call k are rewritten only by call k + 2, same parity);
  * nobody writes a rank's buffers (dispatch output, registered combine input) while a combine
    still reads them (a peer's pull, or the rank's own push);
  * a waiting rank never sees a signal of a later call ("PEs out of step"), and the rows it sums
    are this call's; the arrival counters hold exactly this call's amount when they are reset.

Ops: "D" dispatch, "C" combine from the registered buffer (zero-copy), "X" combine from an
external tensor (the pull combine first copies it into the registered buffer). Modes: "push" (the
small-batch combine, intranode_combine_push.cpp) and "pull" (intranode_combine.cpp); dispatch as
intranode_dispatch.cpp. Mode "inter" is the InterNode family on nodes of G ranks: same-node peers
as "pull"; a rank on another node gets its dispatch rows written (RDMA, from staging) followed by a
tail word (one slot per source, not parity-buffered), and in combine returns our tokens' rows into
our landing region followed by a landing word, after waiting until we finished reading that region
in the last combine (our done signal). A kernel is a set of blocks running in parallel plus the last block's
epilogue; a rank's next kernel starts after its last one ended (stream order). The steps are
atomic: the model checks the order of the protocol's steps, not memory ordering (the fences).

`bugs` switches off one guard at a time, so the tests also show that the model can fail: one
buffer set instead of two (the push combine's first version failed so on the GPU), no wait for
the signal of ranks that pushed nothing, no done wait before the dispatch announces, no done wait
before the external-input copy."""

import random


class Violation(Exception):
    pass


class Rank:
    def __init__(self, W, parities):
        P = parities
        self.count = [[0] * W for _ in range(P)]      # countInbox [parity][src]: dispatch epoch
        self.ready = [[0] * W for _ in range(P)]      # readyInbox [parity][src]: combine epoch
        self.done = [0] * W                           # doneInbox [src]: combine epoch
        self.arrived = [0] * W                        # dispatch rows per src
        self.push_arrived = [[0] * W for _ in range(P)]
        self.push_slot = [[0] * W for _ in range(P)]  # epoch of the rows held per src
        self.readers = 0                              # combines reading our buffers now
        self.tail = [0] * W                           # interTail [src]: dispatch epoch
        self.tail_seen = [0] * W                      # last tail epoch this rank consumed
        self.landed = [0] * W                         # landingReady [dst]: combine epoch
        self.landing_readers = 0                      # our combine reading our landing region
        self.dispatch_epoch = 0
        self.combine_epoch = 0


def run(W, ops, seed, mode="push", bugs=(), vecs=3, G=None):
    rnd = random.Random(seed)
    G = G or W
    remote = lambda a, b: mode == "inter" and a // G != b // G  # noqa: E731
    P = 1 if "one_parity" in bugs else 2
    ranks = [Rank(W, P) for _ in range(W)]
    sends = {}  # dispatch epoch -> rows[src][dst]

    def rows(k):
        if k not in sends:
            sends[k] = [[rnd.randint(0, 2) for _ in range(W)] for _ in range(W)]
        return sends[k]

    def need_free(q, owner_epoch, e, what, me):
        if owner_epoch < e - P:
            raise Violation(f"rank {me} call {e}: wrote {what} on rank {q}, which is still in call {owner_epoch + 1}")

    def write_buffers(q, me, what):
        if ranks[q].readers:
            raise Violation(f"rank {me}: {what} into rank {q}'s buffers while a combine reads them")

    def dispatch(me):
        R = ranks[me]
        k = R.dispatch_epoch + 1
        par = k % P
        cnt = rows(k)

        def block0():
            if "no_done_wait" not in bugs:
                yield lambda: all(R.done[p] >= R.combine_epoch for p in range(W))
            for q in range(W):  # count(me -> every d), to every rank
                need_free(q, ranks[q].dispatch_epoch, k, "count signal", me)
                ranks[q].count[par][me] = k
            yield None
            # receive side: every count, then every row
            def arrived_all():
                for s in range(W):
                    if R.count[par][s] > k:
                        raise Violation(f"rank {me} dispatch {k}: count from {s} of call {R.count[par][s]}")
                    if R.count[par][s] < k:
                        return False
                    if remote(s, me):
                        if cnt[s][me] > 0 and R.tail[s] != k:
                            if R.tail[s] > k:
                                raise Violation(f"rank {me} dispatch {k}: tail from {s} of call {R.tail[s]}")
                            return False
                    elif R.arrived[s] < cnt[s][me]:
                        return False
                return True
            yield arrived_all
            for s in range(W):
                if remote(s, me):
                    if cnt[s][me] > 0:
                        R.tail_seen[s] = k
                    continue
                if R.arrived[s] != cnt[s][me]:
                    raise Violation(f"rank {me} dispatch {k}: {R.arrived[s]} rows from {s}, expected {cnt[s][me]}")
                R.arrived[s] = 0

        def copy(d):
            # counts of lower ranks (our rows' offset on d) and d's own count (d's buffers free)
            yield lambda: all(R.count[par][s] >= k for s in range(me)) and R.count[par][d] >= k
            write_buffers(d, me, f"dispatch {k} rows")
            if remote(me, d):
                D = ranks[d]
                last = max((j for j in sends if j < k and sends[j][me][d] > 0), default=0)
                if D.tail_seen[me] != last:
                    raise Violation(f"rank {me} dispatch {k}: tail on {d} rewritten before it read call {last}'s")
                D.tail[me] = k
                return
            if ranks[d].arrived[me] != 0:
                raise Violation(f"rank {me} dispatch {k}: arrival counter on {d} not reset")
            ranks[d].arrived[me] += cnt[me][d]

        def epilogue():
            R.dispatch_epoch = k

        return [block0()] + [copy(d) for d in range(W) if cnt[me][d] > 0], epilogue

    def combine(me, external):
        R = ranks[me]
        e = R.combine_epoch + 1
        par = e % P
        cnt = rows(R.dispatch_epoch)  # rows[s][me]: what we received from s, i.e. hold for s

        def signal(value_done):
            for q in range(W):
                need_free(q, ranks[q].combine_epoch, e, "ready signal", me)
                ranks[q].ready[par][me] = e
                if value_done:
                    ranks[q].done[me] = e

        def wait_ready(p):
            def ok():
                if R.ready[par][p] > e:
                    raise Violation(f"rank {me} combine {e}: ready from {p} of call {R.ready[par][p]}")
                return R.ready[par][p] == e
            return ok

        if mode == "push":
            R.readers += 1  # our own input, read by the pushes until the kernel ends

            def block0():
                signal(True)
                yield None
                for p in range(W):
                    if p == me:
                        continue
                    if "skip_zero_row_ready" in bugs and cnt[me][p] == 0:
                        continue
                    yield wait_ready(p)
                    yield lambda p=p: R.push_arrived[par][p] >= cnt[me][p] * vecs
                for p in range(W):
                    if p != me and cnt[me][p] > 0 and R.push_slot[par][p] != e:
                        raise Violation(f"rank {me} combine {e}: rows from {p} of call {R.push_slot[par][p]}")

            def push(s):
                S = ranks[s]
                need_free(s, S.combine_epoch, e, "pushed rows", me)
                if S.push_arrived[par][me] != 0:
                    raise Violation(f"rank {me} combine {e}: push counter on {s} not reset")
                S.push_slot[par][me] = e
                S.push_arrived[par][me] += cnt[s][me] * vecs
                yield None

            def epilogue():
                for p in range(W):
                    if p != me and R.push_arrived[par][p] != cnt[me][p] * vecs:
                        raise Violation(f"rank {me} combine {e}: push counter from {p} is {R.push_arrived[par][p]}")
                    R.push_arrived[par][p] = 0
                R.readers -= 1
                R.combine_epoch = e

            blocks = [block0()] + [push(s) for s in range(W) if s != me and cnt[s][me] > 0]
            return blocks, epilogue

        # pull (and inter)
        def block0():
            if external:
                if "no_copy_wait" not in bugs:  # nobody still reads our registered buffer
                    yield lambda: all(R.done[p] >= e - 1 for p in range(W))
                write_buffers(me, me, f"combine {e} input copy")
                yield None
            for q in range(W):
                if remote(me, q):
                    continue
                need_free(q, ranks[q].combine_epoch, e, "ready signal", me)
                ranks[q].ready[par][me] = e
            yield None
            for s in range(W):  # return other nodes' rows into their landing regions
                if not remote(me, s) or cnt[s][me] == 0:
                    continue
                if "no_landing_done_wait" not in bugs:
                    yield lambda s=s: R.done[s] >= e - 1
                S = ranks[s]
                if S.landing_readers:
                    raise Violation(f"rank {me} combine {e}: rows into {s}'s landing while it reads it")
                if S.landed[me] > e - 1:
                    raise Violation(f"rank {me} combine {e}: landing word on {s} of call {S.landed[me]}")
                S.landed[me] = e
            for p in range(W):
                if remote(me, p):
                    if cnt[me][p] > 0:
                        yield lambda p=p: R.landed[p] == e
                else:
                    yield wait_ready(p)
            for p in range(W):
                if not remote(me, p):
                    ranks[p].readers += 1
            R.landing_readers += 1
            yield None
            for p in range(W):
                if not remote(me, p):
                    ranks[p].readers -= 1
            R.landing_readers -= 1

        def epilogue():
            for q in range(W):
                ranks[q].done[me] = e
            R.combine_epoch = e

        return [block0()], epilogue

    def program(me):
        for op in ops:
            yield dispatch(me) if op == "D" else combine(me, op == "X")

    progs = [program(r) for r in range(W)]
    running = [None] * W  # per rank: [list of [generator, pending condition]], epilogue
    finished = [False] * W

    def start(r):
        k = next(progs[r], None)
        if k is None:
            finished[r] = True
            running[r] = None
            return
        blocks, epi = k
        running[r] = ([[b, None, False] for b in blocks], epi)

    for r in range(W):
        start(r)
    while not all(finished):
        choices = []
        for r in range(W):
            if running[r] is None:
                continue
            blocks, epi = running[r]
            live = [b for b in blocks if not b[2]]
            if not live:
                choices.append((r, None))
                continue
            for b in live:
                if b[1] is None or b[1]():
                    choices.append((r, b))
        if not choices:
            raise Violation("deadlock: no block can move")
        r, b = rnd.choice(choices)
        if b is None:
            running[r][1]()
            start(r)
            continue
        try:
            b[1] = next(b[0])
        except StopIteration:
            b[2] = True


SEQUENCES = ["DC", "DCC", "DXXC", "DCDCCDXCC", "DXCCDCDXCC", "DDCX"]


def test_protocol_holds_in_random_interleavings():
    for mode in ("push", "pull"):
        for W in (2, 3, 4):
            for ops in SEQUENCES:
                for seed in range(60):
                    run(W, ops * 2, seed=seed * 31 + W, mode=mode)


def caught(mode, bug, ops="DCCXCDCC", W=3, seeds=200):
    n = 0
    for seed in range(seeds):
        try:
            run(W, ops, seed=seed, mode=mode, bugs=(bug,))
        except Violation:
            n += 1
    return n


def test_model_finds_one_buffer_set():
    assert caught("push", "one_parity") > 0
    assert caught("pull", "one_parity") > 0


def test_model_finds_missing_ready_wait_for_ranks_that_pushed_nothing():
    assert caught("push", "skip_zero_row_ready") > 0


def test_model_finds_missing_done_waits():
    assert caught("pull", "no_done_wait") > 0
    assert caught("pull", "no_copy_wait") > 0


def test_internode_protocol_holds_in_random_interleavings():
    for W, G in ((2, 1), (4, 2), (4, 1), (6, 3)):
        for ops in SEQUENCES:
            for seed in range(40):
                run(W, ops * 2, seed=seed * 37 + W, mode="inter", G=G)


def test_model_finds_missing_landing_done_wait():
    n = 0
    for seed in range(300):
        try:
            run(2, "DCCCDCC", seed=seed, mode="inter", G=1, bugs=("no_landing_done_wait",))
        except Violation:
            n += 1
    assert n > 0
