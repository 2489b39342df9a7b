"""A model of the push combine's protocol between ranks (no GPU): W ranks run the same sequence of
dispatches and combines, each step of each rank's kernels taken in a random interleaving, and the
model checks what the kernels rely on:
  * a rank never overwrites a receive slot, a ready signal or an arrival counter that its owner
    has not finished with (the slots of call k are rewritten only by call k + 2, same parity);
  * a waiting rank never sees a signal of a later call ("PEs out of step"), and when its wait ends
    every row it sums is the one pushed in this call;
  * the arrival counters hold exactly this call's vectors when the last block resets them.

Steps mirror src/ops/dispatch_combine/intranode_combine_push.cpp (and the dispatch's done wait and
count exchange, intranode_dispatch.cpp): within one combine the ready/done signal (block 0) and the
pushes to each peer (other blocks) happen in any order; the wait needs every peer's signal and
rows; then the reduce reads the slots; then the last block checks and resets the counters and
bumps the epoch. The next call on a rank starts only after that (stream order). With one buffer
instead of two (parities=1) the model finds the race that the first version of the kernel had
on the GPU ("PEs out of step" in back-to-back combines)."""

import random


class Violation(Exception):
    pass


class Rank:
    def __init__(self, r, W, parities):
        self.r = r
        self.ready = [[0] * W for _ in range(parities)]    # [parity][src]: epoch tag
        self.done = [0] * W                                 # [src]: epoch tag
        self.arrived = [[0] * W for _ in range(parities)]   # [parity][src]: vectors
        self.slot = [[0] * W for _ in range(parities)]      # [parity][src]: epoch of the rows held
        self.combine_epoch = 0
        self.dispatch_epoch = 0
        self.announced = 0


def run(W, ops, seed, parities=2, vecs=3):
    """Runs `ops` ("D" dispatch, "C" combine) on W ranks in a random interleaving. Every rank sends
    every other rank a random number of rows in each dispatch (0 allowed: no push, no wait)."""
    rnd = random.Random(seed)
    ranks = [Rank(r, W, parities) for r in range(W)]
    send = {}  # dispatch epoch -> send[r][d] rows

    def sends(k):
        if k not in send:
            send[k] = [[rnd.randint(0, 2) for _ in range(W)] for _ in range(W)]
        return send[k]

    # Each rank's program: a generator of steps; a step is (ready_fn, do_fn).
    def program(me):
        R = ranks[me]
        for op in ops:
            if op == "D":
                k = R.dispatch_epoch + 1
                # block 0 waits for every rank's "done reading your buffers" of our last combine
                yield (lambda: all(R.done[p] >= R.combine_epoch for p in range(W)), lambda: None)

                def announce(k=k):
                    R.announced = k
                yield (lambda: True, announce)
                # the receive side waits for every rank's count (the rows themselves are not
                # modelled: the push combine only needs the counts, kept per rank)
                yield (lambda k=k: all(ranks[s].announced >= k for s in range(W)), lambda: None)

                def finish(k=k):
                    R.dispatch_epoch = k
                yield (lambda: True, finish)
                continue
            e = R.combine_epoch + 1
            par = e % parities
            cnt = sends(R.dispatch_epoch)
            steps = []

            # Call e reuses the signal slot, receive slots and counters of call e - parities on the
            # target: the target must have finished that call.
            def check_free(q, what, e, par):
                if ranks[q].combine_epoch < e - parities:
                    raise Violation(f"rank {me} call {e}: wrote {what} [{par}][{me}] on rank {q}, "
                                    f"which has finished only call {ranks[q].combine_epoch}")

            def signal(e=e, par=par):
                for q in range(W):
                    check_free(q, "ready signal", e, par)
                    ranks[q].ready[par][me] = e
                    ranks[q].done[me] = e
            steps.append(signal)
            # rows we received from s in the last dispatch go back to s (self rows stay in place)
            for s in range(W):
                if s == me or cnt[s][me] == 0:
                    continue

                def push(s=s, e=e, par=par, n=cnt[s][me]):
                    S = ranks[s]
                    check_free(s, "rows", e, par)
                    if S.arrived[par][me] != 0:
                        raise Violation(f"rank {me} call {e}: arrival counter [{par}][{me}] on rank {s} "
                                        f"not reset yet ({S.arrived[par][me]})")
                    S.slot[par][me] = e
                    S.arrived[par][me] += n * vecs
                steps.append(push)
            rnd.shuffle(steps)  # block 0's signal and the other blocks' pushes: any order
            for st in steps:
                yield (lambda: True, st)

            def can_sum(e=e, par=par):
                for p in range(W):
                    if p == me:
                        continue
                    if R.ready[par][p] > e:
                        raise Violation(f"rank {me} call {e}: ready from {p} is already {R.ready[par][p]} (out of step)")
                    if R.ready[par][p] < e:
                        return False
                    if R.arrived[par][p] < cnt[me][p] * vecs:
                        return False
                return True

            def reduce(e=e, par=par):
                for p in range(W):
                    if p != me and cnt[me][p] > 0:
                        if R.slot[par][p] != e:
                            raise Violation(f"rank {me} call {e}: slot from {p} holds call {R.slot[par][p]}")
            yield (can_sum, reduce)

            def reset(e=e, par=par):
                for p in range(W):
                    if p == me:
                        continue
                    if R.arrived[par][p] != cnt[me][p] * vecs:
                        raise Violation(f"rank {me} call {e}: counter from {p} is {R.arrived[par][p]}, "
                                        f"expected {cnt[me][p] * vecs}")
                    R.arrived[par][p] = 0
                R.combine_epoch = e
            yield (lambda: True, reset)

    progs = [program(r) for r in range(W)]
    pending = [next(p, None) for p in progs]
    while any(s is not None for s in pending):
        runnable = [r for r in range(W) if pending[r] is not None and pending[r][0]()]
        if not runnable:
            raise Violation("deadlock: no rank can move")
        r = rnd.choice(runnable)
        pending[r][1]()
        pending[r] = next(progs[r], None)


SEQUENCES = ["DC", "DCC", "DCCCC", "DCDCCDCCC", "DCCCDCDCCC", "DDCC"]


def test_push_protocol_double_buffered_holds_in_random_interleavings():
    for W in (2, 3, 4):
        for ops in SEQUENCES:
            for seed in range(150):
                run(W, ops * 2, seed=seed * 31 + W)


def test_push_protocol_single_buffer_fails():
    """The model can fail: one buffer set (no parity) is caught in back-to-back combines."""
    caught = 0
    for seed in range(200):
        try:
            run(3, "DCCCC", seed=seed, parities=1)
        except Violation:
            caught += 1
    assert caught > 0
