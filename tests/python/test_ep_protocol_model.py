"""A model of the IntraNode protocol between ranks (no GPU): W ranks run the same sequence of
dispatches and combines, every block of every kernel taking its steps in a random interleaving,
and the model checks what the kernels rely on:
  * nobody writes a signal slot, receive slot or arrival counter that its owner has not finished
    with (the slots of call k are rewritten only by call k + 2, same parity);
  * nobody writes a rank's buffers (dispatch output, registered combine input) while a combine
    still reads them (a peer's pull, or the rank's own push);
  * a waiting rank never sees a signal of a later call ("PEs out of step"), and the rows it sums
    are this call's; the arrival counters hold exactly this call's amount when they are reset.

Ops: "D" dispatch, "S" split-phase dispatch (dispatch_send and dispatch_recv, two kernels: the
send stages rows in the receivers' staging of its parity and waits for nothing; the receive waits
for every rank's count and staged rows and compacts them into its own outputs), "C" combine from
the registered buffer (zero-copy), "X" combine from an external tensor (the pull combine first copies it into the registered buffer), "Y" the same with the
copy beside the combine (EpCombinePrecopyKernel: ready marked "copying" first, then each reader's
rows and that reader's tag, while the combine runs; readers of a "copying" rank wait for its tag).
`ops` may be a list of W strings, one per rank (e.g. one rank's zero-copy combine where the
others copy beside it). Modes: "push" (the
small-batch combine, combine_push_body.hpp) and "pull" (combine_body.hpp); dispatch as
dispatch_body.hpp. Mode "inter" is the InterNode family on nodes of G ranks: same-node peers
as "pull"; a rank on another node gets its dispatch rows written (RDMA, from staging) followed by a
tail word (one slot per source, not parity-buffered), and in combine returns our tokens' rows into
our landing region followed by a landing word, after waiting until we finished reading that region
in the last combine (our done signal). A kernel is a set of blocks running in parallel plus the last block's
epilogue; a rank's next kernel starts after its last one ended (stream order). The steps are
atomic: the model checks the order of the protocol's steps, not memory ordering (the fences).

`bugs` switches off one guard at a time, so the tests also show that the model can fail: one
buffer set instead of two (the push combine's first version failed so on the GPU), no wait for
the signal of ranks that pushed nothing, no done wait before the dispatch announces, no done wait
before the external-input copy, a split dispatch that leaves the combine's per-peer counts
(EpDeviceState sendCount / recvCount, which the model's combines use as the kernels do) stale.

Mode "inter_push" is the push combine across nodes (docs/ep_split_phase.md, "Combine across
nodes"; built in combine_push_body.hpp): a rank on another node gets its rows by RDMA into a
landing of the combine's parity, followed on one QP by a tail word and "done", sent also with no
rows; op "K" is combine_send then combine_recv (two kernels), "C"/"X" the same protocol fused.

Modes "v1" and "v1ll" (run_v1) model InterNodeV1 and InterNodeV1LL, rail-aligned and
node-deduplicated (internode_v1_dispatch.cpp, internode_v1_combine.cpp; docs/ep_internode_v1.md
says the same with sizes and the build's choices:
the kernels' V1 sender waits for the credit once per remote node, also with nothing to send, which
the model's per-channel wait implies). W ranks, nodes of G consecutive ranks, N = W / G; rank r is on node r // G with local index r % G.
The rail peer of r on node n is n*G + r % G: r sends everything for node n to it (the "proxy"), and
r is in turn the proxy, on its own node, of every rail peer. Q channels (QPs) per rail peer; a
list of c records is split into Q contiguous shares [c*i//Q, c*(i+1)//Q); V1 cuts each share into
chunks of C records, V1LL sends each share as one chunk. Dispatch epoch k, combine epoch e
(per op, per kind, as IntraNode). Every signal is one tagged word {epoch, value}; a waiter waits
for its call's tag and reports a later tag as "out of step".

Symmetric, written by peers (P2P = same node, RDMA = WRITE from a rail peer):
  countInbox[k%2][s] on j     {k, count(s->j)}: P2P, by s (same node) or by the proxy relaying
                              s's count record; read by j's receiver, and by every writer of
                              j's rows (their base is the sum of the lower sources' counts);
                              count(j->j) also says "j started call k: its buffers are free".
  arrived[s] on j             rows of s that landed in j's output (P2P add after a fence);
                              j's receiver waits for count(s->j), checks and resets it.
  dispatchOut[pos] on j       rows at base(s->j) + idx(s->j,t): P2P, by s (same node) or by the
                              proxy of s on j's node; read by the user and the local combines.
  countRec[k%2][m] on p       RDMA from s = p's rail peer on node m, first on QP 0: per-GPU counts
                              count(s->j) for the G ranks j of p's node, and the record count
                              c(s, node(p)); read by p's relay.
  proxyInbox[P][m][i] on p    record i of s's list for p's node (the token's row, metadata and
                              idx(s->j,t) per local j, -1 = not needed): RDMA from s's staging;
                              read by p's forwarders. V1: P = 1, V1LL: P = k%2.
  tail[P][m][c] on p          {k, records of channel c landed}: RDMA from s on QP c after each
                              chunk's WRITE (same QP: RC delivers it after the data). V1LL sends
                              it on every QP (also for an empty share); V1 skips empty shares
                              (p knows every share's size from the count record).
  credit[n] on s              V1 only: {k} when s's rail peer on node n forwarded all of s's call
                              k records (RDMA, also when there were none); s waits credit >= k-1
                              before posting any record of call k (packing may go ahead).
  readyInbox[e%2][j], doneInbox[j] on q: P2P, as IntraNode, among the ranks of one node only
                              (nobody reads another node's buffers directly).
  landing[L][n][i] on o       partial i of o's list for node n (i = position in the dispatch
                              list): RDMA from o's rail peer on node n; read by o's final sum.
                              V1: L = 1, V1LL: L = e%2.
  landTail[L][n][c] on o      {e, partials of channel c landed}: after each chunk, same QP.
                              V1LL: on every QP, also for an empty share; V1: non-empty ones.
  landFree[m] on p            V1 only: {e} when the owner on node m (p's rail peer) finished
                              reading its landing region in combine e (RDMA, every combine, to
                              every rail peer); p waits landFree[m] >= e-1 before writing.
Local (this rank only): send staging stage[n][i] and countSend[n] (read by the NIC until the
WRITE completes), partialOut[m][i] (same), and route[m][i][j] (where the forwarder put record i
on local j: the combine's routing, kept from the last dispatch, never taken from the caller).

Dispatch on rank r, call k: (a) wait doneInbox[q] >= combine epoch for the local q, store
count(r->j) on every local j; post the count record to every rail peer; (b) per (node, channel):
pack chunks into staging, V1: wait credit >= k-1, post WRITE + tail per chunk; (c) per same-node j:
wait count(s->j) for s < r and count(j->j), copy rows, add arrived; (d) proxy, per rail peer s:
wait countRec, relay count(s->j) to every local j; per channel: wait the tail, forward each
record to every local j that needs it (after j's counts for sources below s and count(j->j)),
add arrived[s] on j; V1: the last channel posts credit {k} to s; (e) receiver: every count, then
arrived; (f) the kernel ends only after its WRITEs completed (quiet: staging reusable).
Combine on rank r, call e: (a) external input: wait done >= e-1 of the local ranks, copy; store
ready on every local rank; (b) proxy, per rail peer o: wait ready of the local ranks, V1: wait
landFree >= e-1, sum each record's rows from the local j (ascending), stage the partial, post
WRITE + landing tail per chunk; (c) owner: own-node partials from the local j; wait the landing
tails, sum the partials in ascending node order; V1: post landFree {e} to every rail peer;
(d) done to every local rank, quiet, epoch.

V1LL has no credits: parity and the count record every rank always sends (and the landing tail on
every QP) carry the IntraNode push-combine argument. r writes proxyInbox of call k+2 on p only
after it finished call k+1, which needed count(p->r) of call k+1, which r relays from p's count
record: p posted it after it finished call k (so forwarded all of call k). Landing likewise: p's
combine e+1 waited for o's landing tails of e+1 on every QP, posted by o after it finished e.

The model moves rows as (source, token, call) triples and partials as the tuple of local ranks
they summed, so it checks values, not only the order of steps. The NIC is modelled: a post puts a
WRITE into its QP's FIFO, and delivery is a step of its own (RC: in order per QP, QPs unordered);
the WRITE reads its staging when it is delivered. Checked: no WRITE into a slot, record, landing
partial or count record its reader has not consumed, and no staging rewritten while a WRITE reads
it; no waiter sees a later call's tag; every row lands exactly once at its IntraNode position on
every destination that needs it (checked against the routing when the receiver ends) and the
arrival counts and tails are exact; every token's combine is the partials of exactly its nodes in
ascending node order, each the ascending local ranks of that node.

V1/V1LL `bugs`: "count_one_parity" (count records single-buffered), "no_credit_wait" (V1),
"no_land_free_wait" (V1), "ll_one_parity_inbox", "ll_one_parity_landing", "ll_skip_empty_tail"
(V1LL: no landing tail for an empty share, and no wait for it), "tail_other_qp" (the tail on
another QP than its data), "no_quiet" (a kernel ends with WRITEs in flight), "no_done_wait",
"no_copy_wait", "no_base_wait" (forwarding before the lower sources' counts), "no_dest_wait"
(forwarding before the destination announced its call). What the runs show: the V1 credit
matters only in dispatch-only loops (a combine between two dispatches waits for the landing of
every record sent, so for its forwarding); the quiet guards the dispatch staging in dispatch-only
loops (V1 packs before its credit wait) and, in V1LL, the partial staging between combines of one
dispatch (V1's landFree wait implies the earlier partials were delivered).
"""

import random

import pytest


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
        self.split_arrived = [[0] * W for _ in range(P)]  # split dispatch: rows staged per src
        self.split_slot = [[0] * W for _ in range(P)]     # epoch of the rows staged per src
        self.split_tail = [[0] * W for _ in range(P)]     # inter: split tail word per src (epoch)
        self.readers = 0                              # combines reading our buffers now
        self.seg_readers = [0] * W                    # ... of them, by reader (its rows' segment)
        self.copying = [[False] * W for _ in range(P)]  # ready value's "copying" bit [parity][src]
        self.tag = [0] * W                            # combineRowsReady [src]: combine epoch
        self.tail = [0] * W                           # interTail [src]: dispatch epoch
        self.tail_seen = [0] * W                      # last tail epoch this rank consumed
        self.landed = [0] * W                         # landingReady [dst]: combine epoch
        self.landing_readers = 0                      # our combine reading our landing region
        self.landing_rows = [0] * W                   # rows the last landing word of [dst] announced
        self.push_tail = [[0] * W for _ in range(P)]  # inter_push: landing tail [parity][src] (epoch)
        self.push_land_slot = [[0] * W for _ in range(P)]  # inter_push: epoch of the rows landed per src
        self.push_land_rows = [[0] * W for _ in range(P)]  # inter_push: rows the tail announced
        self.send_count = [0] * W                     # EpDeviceState::sendCount, written by dispatch
        self.recv_count = [0] * W                     # EpDeviceState::recvCount, written by dispatch
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        self.flag = [[False] * W for _ in range(P)]   # the count signal's input-error flag [parity][src]
        self.report = {}                              # inputErrorInbox (parity, src) -> [epoch, value, consumed]
        self.agreed = {}                              # dispatch epoch -> the report this rank recorded


class Reports:
    """Input errors (docs/ep.md, "Errors"): in dispatch call k, each rank in bad(k) had an expert id
    outside [-1, E). It flags every count it announces and writes its report, value (rank, k), into
    the receiver's inputErrorInbox slot [parity][rank] before the count signal that publishes it;
    every receiver reads the reports of the ranks that flagged their count for it and records the
    lowest one's. Checked: a report slot is rewritten only after its reader read it, a reader finds
    this call's report, and every rank records the same report in every call."""

    def __init__(self, rnd, W, prob, slots):
        self.rnd, self.W, self.prob, self.slots = rnd, W, prob, slots
        self.bad_of = {}

    def bad(self, k):
        if k not in self.bad_of:
            self.bad_of[k] = {s for s in range(self.W) if self.rnd.random() < self.prob}
        return self.bad_of[k]

    def write(self, slots, par, s, k, writer):
        old = slots.get((par % self.slots, s))
        if old is not None and not old[2]:
            raise Violation(f"rank {writer} call {k}: report of {s} written over call {old[0]}'s, unread")
        slots[par % self.slots, s] = [k, (s, k), False]

    def read(self, slots, par, s, k, who):
        got = slots.get((par % self.slots, s))
        if got is None or got[0] != k or got[1] != (s, k):
            raise Violation(f"{who}: report of {s} is {got and got[:2]}, not call {k}'s")
        got[2] = True

    def record(self, agreed, k, flagged, who):
        if sorted(flagged) != sorted(self.bad(k)):
            raise Violation(f"{who}: flagged counts from {sorted(flagged)}, but {sorted(self.bad(k))} had input errors")
        agreed[k] = min(flagged) if flagged else None

    def check(self, ranks, calls):
        for k in calls:
            got = {r: R.agreed.get(k, "missing") for r, R in enumerate(ranks)}
            want = min(self.bad(k)) if self.bad(k) else None
            if any(v != want for v in got.values()):
                raise Violation(f"dispatch {k}: ranks recorded {got}, expected {want} on every rank")


def run(W, ops, seed, mode="push", bugs=(), vecs=3, G=None, bad=0.0):
    """bad: probability that a rank's input of a dispatch call has an input error (Reports)."""
    if mode in ("v1", "v1ll"):
        return run_v1(W, G or W, ops, seed, ll=mode == "v1ll", bugs=bugs, bad=bad)
    rnd = random.Random(seed)
    G = G or W
    remote = lambda a, b: mode in ("inter", "inter_push") and a // G != b // G  # noqa: E731
    P = 1 if "one_parity" in bugs else 2
    ranks = [Rank(W, P) for _ in range(W)]
    sends = {}  # dispatch epoch -> rows[src][dst]
    split_calls = set()  # dispatch epochs made by dispatch_send / dispatch_recv (their own tail slots)
    reports = Reports(random.Random(seed * 7 + 1), W, bad, 1 if "report_one_parity" in bugs else 2)

    def announce_counts(me, k, par, what):
        # the leaders: this rank's count (and, with an input error, its report first) to every rank
        R = ranks[me]
        for q in range(W):
            need_free(q, ranks[q].dispatch_epoch, k, what, me)
            if me in reports.bad(k):
                reports.write(ranks[q].report, par, me, k, me)
            ranks[q].flag[par][me] = me in reports.bad(k)
            ranks[q].count[par][me] = k
            R.send_count[q] = rows(k)[me][q]  # the leaders' sendCount[dest]

    def record_reports(me, k, par, who):
        # the receive step: every count's flag, the flagging ranks' reports, the lowest recorded
        R = ranks[me]
        flagged = [s for s in range(W) if R.flag[par][s]]
        for s in flagged:
            reports.read(R.report, par, s, k, who)
        reports.record(R.agreed, k, flagged, who)

    def rows(k):
        if k not in sends:
            sends[k] = [[rnd.randint(0, 2) for _ in range(W)] for _ in range(W)]
        return sends[k]

    def need_free(q, owner_epoch, e, what, me):
        if owner_epoch < e - P:
            raise Violation(f"rank {me} call {e}: wrote {what} on rank {q}, which is still in call {owner_epoch + 1}")

    def write_buffers(q, me, what, segment=None):
        # segment: only the rows that rank `segment` reads (the copy beside the combine)
        busy = ranks[q].readers if segment is None else ranks[q].seg_readers[segment]
        if busy:
            raise Violation(f"rank {me}: {what} into rank {q}'s buffers while a combine reads them")

    def dispatch(me):
        R = ranks[me]
        k = R.dispatch_epoch + 1
        par = k % P
        cnt = rows(k)

        def block0():
            if "no_done_wait" not in bugs:
                yield lambda: all(R.done[p] >= R.combine_epoch for p in range(W))
            announce_counts(me, k, par, "count signal")  # count(me -> every d), to every rank
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
            record_reports(me, k, par, f"rank {me} dispatch {k}")
            for s in range(W):
                if remote(s, me):
                    if cnt[s][me] > 0:
                        R.tail_seen[s] = k
                    continue
                if R.arrived[s] != cnt[s][me]:
                    raise Violation(f"rank {me} dispatch {k}: {R.arrived[s]} rows from {s}, expected {cnt[s][me]}")
                R.arrived[s] = 0
            for s in range(W):  # EpDispatchReceive: recvCount[s]
                R.recv_count[s] = cnt[s][me]

        def copy(d):
            # counts of lower ranks (our rows' offset on d) and d's own count (d's buffers free)
            yield lambda: all(R.count[par][s] >= k for s in range(me)) and R.count[par][d] >= k
            write_buffers(d, me, f"dispatch {k} rows")
            if remote(me, d):
                D = ranks[d]
                last = max((j for j in sends if j < k and j not in split_calls and sends[j][me][d] > 0), default=0)
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

    def dispatch_send(me):
        # Split-phase dispatch, send half: count(me -> d) to every rank, rows into d's staging
        # [parity][me]; nothing waits. The epoch advances with the receive half.
        R = ranks[me]
        k = R.dispatch_epoch + 1
        par = k % P
        cnt = rows(k)
        split_calls.add(k)

        def announce():
            saved = list(R.send_count)
            announce_counts(me, k, par, "count signal")
            if "split_no_send_count" in bugs:
                R.send_count[:] = saved
            yield None

        def stage(d):
            D = ranks[d]
            need_free(d, D.dispatch_epoch, k, "staged rows", me)
            D.split_slot[par][me] = k
            if remote(me, d):  # RDMA WRITEs, then the tail word of this parity
                if D.split_tail[par][me] >= k:
                    raise Violation(f"rank {me} dispatch_send {k}: tail on {d} of call {D.split_tail[par][me]}")
                D.split_tail[par][me] = k
                yield None
                return
            if D.split_arrived[par][me] != 0:
                raise Violation(f"rank {me} dispatch_send {k}: staging counter on {d} not reset")
            D.split_arrived[par][me] += cnt[me][d]
            yield None

        return [announce()] + [stage(d) for d in range(W) if cnt[me][d] > 0], lambda: None

    def dispatch_recv(me):
        # Receive half: every rank's count (also zero counts), its staged rows, done (nobody reads
        # our outputs), then the compaction into our own outputs.
        R = ranks[me]
        k = R.dispatch_epoch + 1
        par = k % P
        cnt = rows(k)

        def receive():
            def counted(s):
                def ok():
                    if R.count[par][s] > k:
                        raise Violation(f"rank {me} dispatch_recv {k}: count from {s} of call {R.count[par][s]}")
                    return R.count[par][s] == k
                return ok
            for s in range(W):
                if "split_skip_zero_count" in bugs and cnt[s][me] == 0:
                    continue
                yield counted(s)
                if remote(s, me):
                    if cnt[s][me] > 0:
                        yield lambda s=s: R.split_tail[par][s] == k
                else:
                    yield lambda s=s: R.split_arrived[par][s] >= cnt[s][me]
            record_reports(me, k, par, f"rank {me} dispatch_recv {k}")
            if "no_done_wait" not in bugs:
                yield lambda: all(R.done[p] >= R.combine_epoch for p in range(W))
            write_buffers(me, me, f"dispatch_recv {k} compaction")
            for s in range(W):
                if cnt[s][me] > 0 and R.split_slot[par][s] != k:
                    raise Violation(f"rank {me} dispatch_recv {k}: rows from {s} of call {R.split_slot[par][s]}")
            if "split_no_recv_count" not in bugs:
                for s in range(W):  # block 0 (R5): recvCount[s]
                    R.recv_count[s] = cnt[s][me]

        def epilogue():
            for s in range(W):
                if remote(s, me):
                    continue
                if R.split_arrived[par][s] != cnt[s][me]:
                    raise Violation(f"rank {me} dispatch_recv {k}: {R.split_arrived[par][s]} rows staged by {s}")
                R.split_arrived[par][s] = 0
            R.dispatch_epoch = k

        return [receive()], epilogue

    def combine(me, external, beside=False):
        R = ranks[me]
        e = R.combine_epoch + 1
        par = e % P
        # Whom we return rows to and whom we wait for: what our last dispatch recorded
        # (recvCount[s]: rows we hold for s; sendCount[d]: our rows on d), as the kernels do.
        dk = R.dispatch_epoch
        dpar = dk % P

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

        if mode == "inter_push":
            blocks_send, blocks_recv, epilogue = push_combine_parts(me, e, par)
            return blocks_send + blocks_recv, epilogue

        if mode == "push":
            R.readers += 1  # our own input, read by the pushes until the kernel ends

            def block0():
                signal(True)
                yield None
                for p in range(W):
                    if p == me:
                        continue
                    if "skip_zero_row_ready" in bugs and R.send_count[p] == 0:
                        continue
                    yield wait_ready(p)
                    yield lambda p=p: R.push_arrived[par][p] >= R.send_count[p] * vecs
                for p in range(W):
                    if p != me and R.send_count[p] > 0 and R.push_slot[par][p] != e:
                        raise Violation(f"rank {me} combine {e}: rows from {p} of call {R.push_slot[par][p]}")

            def push(s):
                S = ranks[s]
                need_free(s, S.combine_epoch, e, "pushed rows", me)
                if S.push_arrived[par][me] != 0:
                    raise Violation(f"rank {me} combine {e}: push counter on {s} not reset")
                S.push_slot[par][me] = e
                S.push_arrived[par][me] += ranks[me].recv_count[s] * vecs
                yield None

            def epilogue():
                for p in range(W):
                    if p != me and R.push_arrived[par][p] != R.send_count[p] * vecs:
                        raise Violation(f"rank {me} combine {e}: push counter from {p} is {R.push_arrived[par][p]}")
                    R.push_arrived[par][p] = 0
                R.readers -= 1
                R.combine_epoch = e

            blocks = [block0()] + [push(s) for s in range(W) if s != me and R.recv_count[s] > 0]
            return blocks, epilogue

        # pull (and inter)
        def copier():
            # "Y": EpCombinePrecopyKernel, beside this rank's combine kernel (one kernel here: the
            # combine's last block waits for it, so the epilogue runs after both). Ready ("copying")
            # first, then each reader's rows and that reader's tag.
            if "no_copy_wait" not in bugs:
                yield lambda: all(R.done[p] >= e - 1 for p in range(W))
            for q in range(W):
                need_free(q, ranks[q].combine_epoch, e, "ready signal", me)
                ranks[q].ready[par][me] = e
                ranks[q].copying[par][me] = True
            yield None
            for q in rnd.sample(range(W), W):
                if q == me:
                    continue
                write_buffers(me, me, f"combine {e} copy of {q}'s rows", segment=q)
                yield None
                ranks[q].tag[me] = e
                yield None

        def block0():
            if external and not beside:
                if "no_copy_wait" not in bugs:  # nobody still reads our registered buffer
                    yield lambda: all(R.done[p] >= e - 1 for p in range(W))
                write_buffers(me, me, f"combine {e} input copy")
                yield None
            if not beside:
                for q in range(W):
                    if remote(me, q):
                        continue
                    need_free(q, ranks[q].combine_epoch, e, "ready signal", me)
                    ranks[q].ready[par][me] = e
                    ranks[q].copying[par][me] = False
                yield None
            for s in range(W):  # return other nodes' rows into their landing regions
                if not remote(me, s) or R.recv_count[s] == 0:
                    continue
                if any(remote(s, d) for d in range(me)):
                    # landing base on s: s's count words of the last dispatch for the PEs below us
                    # of other nodes (InterReturnRows reads them with the dispatch's parity)
                    def counted(s=s):
                        if R.count[dpar][s] > dk:
                            raise Violation(f"rank {me} combine {e}: count word of {s} of call {R.count[dpar][s]}, not {dk}")
                        return R.count[dpar][s] == dk
                    yield counted
                if "no_landing_done_wait" not in bugs:
                    yield lambda s=s: R.done[s] >= e - 1
                S = ranks[s]
                if S.landing_readers:
                    raise Violation(f"rank {me} combine {e}: rows into {s}'s landing while it reads it")
                if S.landed[me] > e - 1:
                    raise Violation(f"rank {me} combine {e}: landing word on {s} of call {S.landed[me]}")
                S.landed[me] = e
                S.landing_rows[me] = R.recv_count[s]
            for p in range(W):
                if remote(me, p):
                    if R.send_count[p] > 0:
                        yield lambda p=p: R.landed[p] == e
                else:
                    yield wait_ready(p)
            for p in range(W):
                if remote(me, p) and R.send_count[p] > 0 and R.landing_rows[p] != R.send_count[p]:
                    raise Violation(f"rank {me} combine {e}: {R.landing_rows[p]} rows landed from {p}, "
                                    f"{R.send_count[p]} of ours went there")
            # A rank whose ready said "copying" (its copy beside its combine): its rows for us once
            # it tagged them. "gate_by_own_input": by whether we copy ourselves instead.
            for p in range(W):
                if p == me or remote(me, p) or "no_tag_wait" in bugs:
                    continue
                gated = beside if "gate_by_own_input" in bugs else R.copying[par][p]
                if gated:
                    def tagged(p=p):
                        if R.tag[p] > e:
                            raise Violation(f"rank {me} combine {e}: tag from {p} of call {R.tag[p]}")
                        return R.tag[p] == e
                    yield tagged
            for p in range(W):
                if not remote(me, p):
                    ranks[p].readers += 1
                    ranks[p].seg_readers[me] += 1
            R.landing_readers += 1
            yield None
            for p in range(W):
                if not remote(me, p):
                    ranks[p].readers -= 1
                    ranks[p].seg_readers[me] -= 1
            R.landing_readers -= 1

        def epilogue():
            for q in range(W):
                ranks[q].done[me] = e
            R.combine_epoch = e

        return ([copier()] if beside else []) + [block0()], epilogue

    def push_combine_parts(me, e, par):
        """The push combine across nodes (mode "inter_push", docs/ep_split_phase.md "Combine across
        nodes"): same-node ranks as the push combine; a rank on another node gets our rows for it
        by RDMA into its landing of this parity, then a tail word, sent to every rank of another
        node, also with no rows. Returns (send blocks, receive blocks, epilogue): the fused combine
        runs them as one kernel, combine_send / combine_recv as two."""
        R = ranks[me]
        R.readers += 1  # our input: read by the pushes and the WRITEs until the receive's quiet

        def signal():
            # "Done reading" to the same-node ranks from the start (a push combine reads no peer's
            # buffers), "ready" likewise; another node's rank gets "done" behind its landing tail
            # (push below: the kernel posts rows, weights, tail and done on one QP).
            for q in range(W):
                if remote(me, q):
                    continue
                ranks[q].done[me] = e
                need_free(q, ranks[q].combine_epoch, e, "ready signal", me)
                ranks[q].ready[par][me] = e
            yield None

        def push(s):
            S = ranks[s]
            if remote(me, s):
                need_free(s, S.combine_epoch, e, "landed rows", me)
                if S.push_tail[par][me] >= e:
                    raise Violation(f"rank {me} combine {e}: landing tail on {s} of call {S.push_tail[par][me]}")
                if R.recv_count[s] > 0:
                    S.push_land_slot[par][me] = e
                S.push_land_rows[par][me] = R.recv_count[s]
                yield None
                S.push_tail[par][me] = e  # same QP: lands after the rows
                yield None
                if "no_remote_done" not in bugs:
                    S.done[me] = e  # same QP: lands after the tail (their dispatch waits for it)
                    yield None
                return
            need_free(s, S.combine_epoch, e, "pushed rows", me)
            if S.push_arrived[par][me] != 0:
                raise Violation(f"rank {me} combine {e}: push counter on {s} not reset")
            S.push_slot[par][me] = e
            S.push_arrived[par][me] += R.recv_count[s] * vecs
            yield None

        def wait():
            for p in range(W):
                if p == me:
                    continue
                if remote(me, p):
                    if "skip_empty_tail" in bugs and R.send_count[p] == 0:
                        continue

                    def tailed(p=p):
                        if R.push_tail[par][p] > e:
                            raise Violation(f"rank {me} combine {e}: landing tail from {p} of call {R.push_tail[par][p]}")
                        return R.push_tail[par][p] == e
                    yield tailed
                else:
                    def ready(p=p):
                        if R.ready[par][p] > e:
                            raise Violation(f"rank {me} combine {e}: ready from {p} of call {R.ready[par][p]}")
                        return R.ready[par][p] == e
                    yield ready
                    yield lambda p=p: R.push_arrived[par][p] >= R.send_count[p] * vecs
            for p in range(W):
                if p == me or R.send_count[p] == 0:
                    continue
                if remote(me, p):
                    if R.push_land_slot[par][p] != e or R.push_land_rows[par][p] != R.send_count[p]:
                        raise Violation(f"rank {me} combine {e}: landing from {p} holds call "
                                        f"{R.push_land_slot[par][p]}, {R.push_land_rows[par][p]} rows")
                elif R.push_slot[par][p] != e:
                    raise Violation(f"rank {me} combine {e}: rows from {p} of call {R.push_slot[par][p]}")

        def epilogue():
            for p in range(W):
                if p == me or remote(me, p):
                    continue
                if R.push_arrived[par][p] != R.send_count[p] * vecs:
                    raise Violation(f"rank {me} combine {e}: push counter from {p} is {R.push_arrived[par][p]}")
                R.push_arrived[par][p] = 0
            R.readers -= 1  # the receive's quiet: our WRITEs have read our input
            R.combine_epoch = e

        targets = [s for s in range(W) if s != me and (R.recv_count[s] > 0 or
                                                        (remote(me, s) and "skip_empty_tail" not in bugs))]
        return [signal()] + [push(s) for s in targets], [wait()], epilogue

    def combine_send(me):
        R = ranks[me]
        e = R.combine_epoch + 1
        blocks_send, blocks_recv, epilogue = push_combine_parts(me, e, e % P)
        pending[me] = (blocks_recv, epilogue)
        return blocks_send, lambda: None

    def combine_recv(me):
        blocks_recv, epilogue = pending[me]
        pending[me] = None
        return blocks_recv, epilogue

    pending = [None] * W  # per rank: the receive half of its combine_send

    def program(me):
        for op in (ops[me] if isinstance(ops, list) else ops):  # a list: each rank's own
            if op == "S":  # split dispatch: two kernels, any work between them
                yield dispatch_send(me)
                yield dispatch_recv(me)
            elif op == "K":  # split combine (mode inter_push): two kernels
                yield combine_send(me)
                yield combine_recv(me)
            else:
                yield dispatch(me) if op == "D" else combine(me, op in "XY", beside=op == "Y")

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
    reports.check(ranks, sorted(sends))


SEQUENCES = ["DC", "DCC", "DXXC", "DCDCCDXCC", "DXCCDCDXCC", "DDCX"]


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_protocol_holds_in_random_interleavings():
    for mode in ("push", "pull"):
        for W in (2, 3, 4):
            for ops in SEQUENCES:
                for seed in range(60):
                    run(W, ops * 2, seed=seed * 31 + W, mode=mode)


SPLIT_SEQUENCES = ["SC", "SCC", "SSC", "SDCSC", "DSXCSC", "SXCCDCSS"]


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_split_dispatch_holds_in_random_interleavings():
    for mode in ("push", "pull"):
        for W in (2, 3, 4):
            for ops in SPLIT_SEQUENCES:
                for seed in range(60):
                    run(W, ops * 2, seed=seed * 37 + W, mode=mode)


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_internode_split_dispatch_holds_in_random_interleavings():
    for W, G in ((4, 2), (4, 1), (6, 3)):
        for ops in SPLIT_SEQUENCES:
            for seed in range(40):
                run(W, ops * 2, seed=seed * 41 + W, mode="inter", G=G)


def test_model_finds_split_dispatch_races():
    # one staging set, or the receive skipping the counts of ranks that staged nothing: caught
    assert caught("push", "one_parity", ops="SSCSCS") > 0
    assert caught("push", "split_skip_zero_count", ops="SSSCSS", W=3) > 0


def test_model_finds_stale_combine_counts_after_split_dispatch():
    # The combine decides whom it returns rows to (recvCount) and whom it waits for (sendCount, and
    # InterNode: the landing rows) from what the last dispatch recorded. If a split dispatch left
    # either stale, a peer waits for rows that never come or reads the wrong number: caught, with
    # the landing count words read at the dispatch's parity (the model holds with the kernels'
    # recording: test_internode_split_dispatch_holds_in_random_interleavings).
    for bug in ("split_no_recv_count", "split_no_send_count"):
        for mode in ("push", "inter"):
            n = 0
            for seed in range(20):
                try:
                    run(4, "DCSC", seed=seed, mode=mode, G=2, bugs=(bug,))
                except Violation:
                    n += 1
            assert n > 0, (bug, mode)


def test_split_receive_done_wait_is_implied_by_the_counts():
    # Every rank sends call k+1 after its combine of call k ended, so the receive's wait for every
    # count already orders its compaction after every peer's reads; the kernel's done wait is a
    # guard that costs W local polls per block.
    for mode in ("push", "pull"):
        assert caught(mode, "no_done_wait", ops="SCSXSCSC", W=3, seeds=100) == 0


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


COPY_BESIDE_SEQUENCES = ["DY", "DYY", "DYCDXY", "DCYDYC"]


def test_copy_beside_holds_in_random_interleavings():
    for W in (2, 3, 4):
        for ops in COPY_BESIDE_SEQUENCES:
            for seed in range(15):
                run(W, ops * 2, seed=seed * 43 + W, mode="pull")
        # ranks mixing their combine inputs in one call: zero-copy, copied first, copied beside
        for seed in range(15):
            run(W, ["DCDYDX"] + ["DYDXDY"] * (W - 1), seed=seed * 47 + W, mode="pull")


def test_model_finds_copy_beside_races():
    # reading a copying rank's rows before its tag: caught (its copy of them is still running)
    assert caught("pull", "no_tag_wait", ops="DYYDY", W=3) > 0
    # waiting for tags by whether we copy ourselves, not by the peer's ready: a rank that passed
    # its registered buffer never tags, so the waiter deadlocks
    n = 0
    for seed in range(20):
        try:
            run(3, ["DC", "DY", "DY"], seed=seed, mode="pull", bugs=("gate_by_own_input",))
        except Violation:
            n += 1
    assert n == 20


def test_model_finds_missing_done_waits():
    assert caught("pull", "no_done_wait") > 0
    assert caught("pull", "no_copy_wait") > 0


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_internode_protocol_holds_in_random_interleavings():
    for W, G in ((2, 1), (4, 2), (4, 1), (6, 3)):
        for ops in SEQUENCES:
            for seed in range(40):
                run(W, ops * 2, seed=seed * 37 + W, mode="inter", G=G)


INTER_PUSH_SEQUENCES = ["DK", "DKK", "DCKC", "DKDKK", "SKSK", "DKXKDCK", "SCKDK"]


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_internode_split_combine_plan_holds_in_random_interleavings():
    # The plan of docs/ep_split_phase.md, "Combine across nodes": fused and split push combines
    # ("C"/"X" and "K") with RDMA landings of two parities, mixed with both dispatches.
    for W, G in ((2, 1), (4, 2), (4, 1), (6, 3)):
        for ops in INTER_PUSH_SEQUENCES:
            for seed in range(40):
                run(W, ops * 2, seed=seed * 43 + W, mode="inter_push", G=G)


def test_model_finds_internode_split_combine_races():
    # One landing set, or no tail (and no wait) where a rank returns no rows: caught.
    # Without "done" to other nodes' ranks, their next dispatch waits forever: caught as a deadlock.
    for bug, ops in (("one_parity", "DKKKDKK"), ("skip_empty_tail", "DKKKDKK"), ("no_remote_done", "DKDK")):
        n = 0
        for seed in range(200):
            try:
                run(4, ops, seed=seed, mode="inter_push", G=2, bugs=(bug,))
            except Violation:
                n += 1
        assert n > 0, bug


def test_model_finds_missing_landing_done_wait():
    n = 0
    for seed in range(300):
        try:
            run(2, "DCCCDCC", seed=seed, mode="inter", G=1, bugs=("no_landing_done_wait",))
        except Violation:
            n += 1
    assert n > 0


# --- InterNodeV1 ("v1") and InterNodeV1LL ("v1ll"): the protocol is in the module docstring ---

from collections import deque


class V1Rank:
    def __init__(self, W, N):
        self.count_inbox = {}   # (parity, src) -> [epoch, count, consumed]
        self.arrived = [0] * W
        self.out = {}           # dispatch output: pos -> (src, token, call)
        self.out_written = set()  # (call, pos): every row written exactly once per call
        self.count_rec = {}     # (parity, node) -> [epoch, payload, consumed]
        self.inbox = {}         # (parity, node, i) -> [epoch, record, consumed]
        self.tail = {}          # (parity, node, channel) -> (epoch, value)
        self.credit = [0] * N
        self.ready = {}         # (parity, src) -> (epoch,)
        self.done = [0] * W
        self.landing = {}       # (parity, node, i) -> [epoch, partial, consumed]
        self.land_tail = {}     # (parity, node, channel) -> (epoch, value)
        self.land_free = [0] * N
        self.stage = {}         # local send buffers: key -> value
        self.nic_reads = {}     # key -> WRITEs posted and not yet delivered that read it
        self.route = {}         # node -> [ {j: pos} per record ] (local, from the last dispatch)
        self.relayed = {}       # node -> (epoch, payload) of the count record relayed
        self.fwd_left = {}      # node -> channels still forwarding (V1: the last posts credit)
        self.readers = 0        # combines reading our rows now
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        self.errors = []        # receive-capacity overflows this rank found (run_v1's cap)
        self.aborted = False    # bug "cap_abort": an overflow raised this rank's abort flag
        self.count_flag = {}    # (parity, src) -> the count's input-error flag (Reports)
        self.report = {}        # inputErrorInbox (parity, src) -> [epoch, value, consumed]
        self.agreed = {}        # dispatch epoch -> the report this rank recorded


class V1Call:
    """One dispatch's routing, as every rank computes it: tokens of each source, destinations."""

    def __init__(self, routes, W, G):
        N = W // G
        self.routes = routes
        self.cnt = [[0] * W for _ in range(W)]
        self.idx = {}
        for s in range(W):
            for t, ds in enumerate(routes[s]):
                for j in ds:
                    self.idx[s, j, t] = self.cnt[s][j]
                    self.cnt[s][j] += 1
        self.lists = {(s, n): [t for t, ds in enumerate(routes[s]) if any(d // G == n for d in ds)]
                      for s in range(W) for n in range(N)}
        self.expected_out = [[(s, t) for s in range(W) for t, ds in enumerate(routes[s]) if j in ds]
                             for j in range(W)]


def v1_routing(rnd, W, G, M, pattern):
    """Tokens (0..M per rank) with up to 3 distinct destination ranks each (none allowed);
    "one_rank": M tokens per rank, every one to rank 0 only (the GPU suite's receive_cap_overflow)."""
    N = W // G
    routes = []
    for s in range(W):
        toks = []
        if pattern == "one_rank":
            routes.append([(0,)] * M)
            continue
        for _ in range(rnd.randint(0, M)):
            if pattern == "local":      # every token stays on its node: zero-byte chunks
                pool = [d for d in range(W) if d // G == s // G]
            elif pattern == "incast":   # every token to one remote node (node 0; node 0's to node 1)
                target = 0 if s // G != 0 else 1 % N
                pool = [d for d in range(W) if d // G == target]
            else:
                pool = list(range(W))
            lo = 1 if pattern == "incast" else 0
            toks.append(tuple(sorted(rnd.sample(pool, rnd.randint(lo, min(3, len(pool)))))))
        routes.append(toks)
    return routes


def _share(n, i, parts):
    return n * i // parts, n * (i + 1) // parts


def run_v1(W, G, ops, seed, ll=False, bugs=(), Q=2, C=2, M=5, pattern="mixed", skew=0.0, fast=0,
           slow_nic=0.0, cap=None, bad=0.0, ll_one_chunk=None):
    """Runs `ops` ("D" dispatch, "C" zero-copy combine, "X" external-input combine) on W ranks
    in nodes of G, V1 (ll=False) or V1LL, in a random interleaving of every block's steps and every
    WRITE's delivery; with probability `skew` a step of rank `fast` (its blocks or its WRITEs) goes
    first, so that rank runs as far ahead as the protocol lets it; with probability `slow_nic` a
    WRITE's delivery that was drawn is put off while any block can move. Returns statistics;
    raises Violation when a safety property fails.

    cap (rows, max_total_recv_tokens; for a lone "D"): the error path of a receive-capacity
    overflow. A writer (the source on j's node, or its proxy there) whose rows of source s would
    pass j's capacity (base(s->j) + count(s->j) > cap) writes none of them and keeps the error; j's
    receiver finds its total > cap from the counts and waits for no row. The build records kept
    errors when the kernel ends, so every other step of the call still runs (stats["errors"]).
    Bug "cap_abort" (the first build): the first overflow a rank finds raises its abort flag at
    once: from then its blocks give up at any wait that does not hold yet, and its packing blocks
    post no chunk or tail.

    bad: probability of an input error per rank and dispatch (Reports). A rank with one sends its
    report to each rail peer on QP 0 before the count record, whose format word carries the flag;
    the relay copies it to the local ranks' slots before their count signals (bugs
    "report_after_record": the report posted after the record; "report_one_parity": one slot set).
    ll_one_chunk (V1LL): lists of more records go in chunks of C, as V1's (the kernels' one WRITE
    per channel holds for lists of up to kEpV1LLMaxTokens records); None: one chunk always."""
    rnd = random.Random(seed)
    N = W // G
    node = lambda r: r // G  # noqa: E731
    local = lambda r: range(node(r) * G, node(r) * G + G)  # noqa: E731
    rail = lambda n, r: n * G + r % G  # noqa: E731
    remote_nodes = lambda r: [n for n in range(N) if n != node(r)]  # noqa: E731
    CP = 1 if "count_one_parity" in bugs else 2
    IP = (1 if "ll_one_parity_inbox" in bugs else 2) if ll else 1
    LP = (1 if "ll_one_parity_landing" in bugs else 2) if ll else 1
    ranks = [V1Rank(W, N) for _ in range(W)]
    calls = {}
    nic = {}  # (src, dst, qp) -> deque of (staging keys, apply, inline value)
    stats = {"max_lead": 0, "data_writes": 0, "wrs": {}, "chunks": 0}

    def call(k):
        if k not in calls:
            calls[k] = V1Call(v1_routing(rnd, W, G, M, pattern), W, G)
        return calls[k]

    reports = Reports(random.Random(seed * 7 + 1), W, bad, 1 if "report_one_parity" in bugs else 2)

    def chunks(b, e, n):
        """Chunks of share [b, e) of a list of n records."""
        if ll and (ll_one_chunk is None or n <= ll_one_chunk):
            return [(b, e)]
        return [(i, min(i + C, e)) for i in range(b, e, C)] or ([(b, b)] if ll else [])  # V1LL: an empty share's tail

    # --- NIC -----------------------------------------------------------------------------------
    def post(src, dst, qp, keys, apply, inline=None, what="", phase=None):
        S = ranks[src]
        for key in keys:
            S.nic_reads[key] = S.nic_reads.get(key, 0) + 1
        nic.setdefault((src, dst, qp), deque()).append((keys, apply, inline))
        if phase is not None:
            stats["wrs"][phase] = stats["wrs"].get(phase, 0) + 1
        if keys:
            stats["data_writes"] += 1

    def deliver(q):
        keys, apply, inline = nic[q].popleft()
        if not nic[q]:
            del nic[q]
        S = ranks[q[0]]
        vals = [S.stage[key] for key in keys]
        for key in keys:
            S.nic_reads[key] -= 1
        apply(vals if keys else inline)

    def stage_write(r, key, value, what):
        R = ranks[r]
        if R.nic_reads.get(key, 0):
            raise Violation(f"rank {r}: {what}: staging {key} rewritten while a WRITE still reads it")
        R.stage[key] = value

    def quiet(r):
        return not any(q[0] == r for q in nic)

    def post_chunk(src, dst, c, keys, region, par, cb, tail_region, tail_value, phase, unread):
        """One chunk on QP c: a WRITE of the staged records `keys` into region(dst)[par, node(src),
        cb + i] (each slot must have been consumed), then the tail word region(dst)[par, node(src),
        c] (RC: after the data; on another QP with the bug "tail_other_qp"). No records: the tail
        alone."""
        nm = node(src)
        if keys:
            def apply(vals):
                D = region(ranks[dst])
                for off, v in enumerate(vals):
                    slot = D.get((par, nm, cb + off))
                    if slot is not None and not slot[2]:
                        raise Violation(unread(cb + off, slot[0]))
                    D[par, nm, cb + off] = [v[0], v[1], False]
            post(src, dst, c, keys, apply, phase=phase)
            stats["chunks"] += 1

        def apply_tail(v):
            tail_region(ranks[dst])[par, nm, c] = v
        post(src, dst, ("signal", c) if "tail_other_qp" in bugs else c, [], apply_tail, inline=tail_value, phase=phase)

    # --- shared waits and writes ------------------------------------------------------------------
    def tag_wait(word, expect, who):
        """A tagged word: True once it holds `expect`'s tag; a later tag is out of step."""
        if word is not None and word[0] > expect:
            raise Violation(f"{who}: found the signal of call {word[0]} while in call {expect}")
        return word is not None and word[0] == expect

    def set_count(j, par, s, k, value, writer, flag=False):
        J = ranks[j]
        slot = J.count_inbox.get((par, s))
        if slot is not None and not slot[2]:
            raise Violation(f"rank {writer} call {k}: count({s}->{j}) slot still holds call {slot[0]}, unread")
        J.count_inbox[par, s] = [k, value, False]
        J.count_flag[par, s] = flag

    def counts_ready(j, par, k, below, who):
        """j's counts from every source < below and its own (j started call k)."""
        J = ranks[j]
        need = list(range(below))
        if "no_dest_wait" not in bugs:
            need.append(j)
        if "no_base_wait" in bugs:
            need = [j] if "no_dest_wait" not in bugs else []
        return all(tag_wait(J.count_inbox.get((par, s)), k, f"{who} reading count({s}->{j})") for s in need)

    def base_of(j, par, s):
        J = ranks[j]
        return sum(J.count_inbox[par, q][1] if (par, q) in J.count_inbox else 0 for q in range(s))

    def write_row(j, pos, row, k, writer):
        J = ranks[j]
        if J.readers:
            raise Violation(f"rank {writer} dispatch {k}: row into rank {j}'s output while a combine reads it")
        if (k, pos) in J.out_written:
            raise Violation(f"rank {writer} dispatch {k}: row {pos} of rank {j} written twice")
        J.out_written.add((k, pos))
        J.out[pos] = row

    def cap_error(r, what):
        ranks[r].errors.append(what)
        if "cap_abort" in bugs:
            ranks[r].aborted = True

    # --- dispatch ---------------------------------------------------------------------------------
    def dispatch(me):
        R = ranks[me]
        k = R.dispatch_epoch + 1
        d = call(k)
        par, cp, ip = k % 2, k % CP, k % IP
        nm = node(me)
        ph = ("D", me, k)
        stats["wrs"][ph] = 0

        bad_me = me in reports.bad(k)

        def announce():
            if "no_done_wait" not in bugs:
                yield lambda: all(R.done[q] >= R.combine_epoch for q in local(me))
            for j in local(me):
                if bad_me:
                    reports.write(ranks[j].report, par, me, k, me)
                set_count(j, par, me, k, d.cnt[me][j], me, bad_me)
            yield None
            for n in remote_nodes(me):
                p = rail(n, me)
                payload = ({j: d.cnt[me][j] for j in range(n * G, n * G + G)}, len(d.lists[me, n]), bad_me)
                stage_write(me, ("countSend", n), (k, payload), f"dispatch {k} count record")

                def apply(v, p=p):
                    P_ = ranks[p]
                    slot = P_.count_rec.get((cp, nm))
                    if slot is not None and not slot[2]:
                        raise Violation(f"rank {me} dispatch {k}: count record on {p} still holds call {slot[0]}, not relayed")
                    P_.count_rec[cp, nm] = [v[0][0], v[0][1], False]

                def apply_report(v, p=p):
                    reports.write(ranks[p].report, par, me, k, me)
                if bad_me and "report_after_record" not in bugs:
                    post(me, p, 0, [], apply_report, inline=k, phase=ph)
                post(me, p, 0, [("countSend", n)], apply, phase=ph)
                if bad_me and "report_after_record" in bugs:
                    post(me, p, 0, [], apply_report, inline=k, phase=ph)
                yield None

        def send(n, c):
            p = rail(n, me)
            lst = d.lists[me, n]
            b, e = _share(len(lst), c, Q)
            waited = False
            for cb, ce in chunks(b, e, len(lst)) or [(b, b)]:
                for i in range(cb, ce):
                    t = lst[i]
                    rec = (me, t, {j: d.idx.get((me, j, t), -1) for j in range(n * G, n * G + G)})
                    stage_write(me, ("rec", n, i), (k, rec), f"dispatch {k} packing")
                yield None
                if not ll and not waited and "no_credit_wait" not in bugs:
                    yield lambda: R.credit[n] >= k - 1
                waited = True
                if "cap_abort" in bugs and R.aborted:
                    return  # the first build's last packer: no post once the abort flag is up
                post_chunk(me, p, c, [("rec", n, i) for i in range(cb, ce)], lambda X: X.inbox, ip, cb,
                           lambda X: X.tail, (k, ce - b), ph,
                           lambda i, x: f"rank {me} dispatch {k}: record {i} on {p} still holds call {x}, not forwarded")
                yield None

        def copy(j):
            ts = [t for t, ds in enumerate(d.routes[me]) if j in ds]
            yield lambda: counts_ready(j, par, k, me, f"rank {me} dispatch {k}")
            base = base_of(j, par, me)
            if cap is not None and base + len(ts) > cap:
                cap_error(me, f"rows of {me} for {j}: {base + len(ts)} > {cap}")
                return  # j gets none of them (its receiver finds the overflow from the counts)
            for t in ts:
                write_row(j, base + d.idx[me, j, t], (me, t, k), k, me)
            yield None
            ranks[j].arrived[me] += len(ts)

        def relay(m):
            s = rail(m, me)
            yield lambda: tag_wait(R.count_rec.get((cp, m)), k, f"proxy {me} dispatch {k}: count record of {s}")
            slot = R.count_rec[cp, m]
            counts, nrec, flag = slot[1]
            if nrec != len(d.lists[s, nm]) or any(counts[j] != d.cnt[s][j] for j in local(me)):
                raise Violation(f"proxy {me} dispatch {k}: count record of {s} is not call {k}'s")
            slot[2] = True
            if flag:  # s's report landed before its record (QP 0): copied before the counts
                reports.read(R.report, par, s, k, f"proxy {me} dispatch {k} relaying")
                for j in local(me):
                    reports.write(ranks[j].report, par, s, k, me)
            for j in local(me):
                set_count(j, par, s, k, counts[j], me, flag)
                yield None
            R.relayed[m] = (k, counts, nrec)
            R.route[m] = [{} for _ in range(nrec)]
            R.fwd_left[m] = Q

        def forward(m, c):
            s = rail(m, me)
            yield lambda: m in R.relayed and R.relayed[m][0] == k
            _, counts, nrec = R.relayed[m]
            need = [j for j in local(me) if counts[j] > 0]
            yield lambda: all(counts_ready(j, par, k, s, f"proxy {me} dispatch {k}") for j in need)
            b, e = _share(nrec, c, Q)
            over = {j for j in need if cap is not None and base_of(j, par, s) + counts[j] > cap}
            if e > b:
                for j in sorted(over):
                    cap_error(me, f"rows of {s} for {j}: {base_of(j, par, s) + counts[j]} > {cap}")
            for cb, ce in chunks(b, e, nrec) if (ll or e > b) else []:
                yield lambda ce=ce: tag_wait(R.tail.get((ip, m, c)), k, f"proxy {me} dispatch {k}: tail {c} of {s}") \
                    and R.tail[ip, m, c][1] >= ce - b
                added = {}
                for i in range(cb, ce):
                    slot = R.inbox.get((ip, m, i))
                    want = d.lists[s, nm][i]
                    if slot is None or slot[0] != k or slot[1][0] != s or slot[1][1] != want:
                        raise Violation(f"proxy {me} dispatch {k}: record {i} of {s} is {slot and slot[:2]}, not call {k}'s token {want}")
                    _, t, idx = slot[1]
                    for j in sorted(idx):
                        if idx[j] < 0 or j in over:
                            continue
                        pos = base_of(j, par, s) + idx[j]
                        write_row(j, pos, (s, t, k), k, me)
                        R.route[m][i][j] = pos
                        added[j] = added.get(j, 0) + 1
                    slot[2] = True
                    yield None
                for j, n_ in added.items():  # one fence, then the count
                    ranks[j].arrived[s] += n_
            R.fwd_left[m] -= 1
            if not ll and R.fwd_left[m] == 0:
                def apply(v):
                    S = ranks[s]
                    if v < S.credit[nm]:
                        raise Violation(f"proxy {me}: credit {v} on {s} below {S.credit[nm]}")
                    S.credit[nm] = v
                post(me, s, 0, [], apply, inline=k, phase=ph)

        def receive():
            yield lambda: all(tag_wait(R.count_inbox.get((par, s)), k, f"rank {me} dispatch {k}: count from {s}")
                              for s in range(W))
            for s in range(W):
                if R.count_inbox[par, s][1] != d.cnt[s][me]:
                    raise Violation(f"rank {me} dispatch {k}: count from {s} is {R.count_inbox[par, s][1]}, expected {d.cnt[s][me]}")
            flagged = [s for s in range(W) if R.count_flag.get((par, s))]
            for s in flagged:
                reports.read(R.report, par, s, k, f"rank {me} dispatch {k}")
            reports.record(R.agreed, k, flagged, f"rank {me} dispatch {k}")
            total = sum(R.count_inbox[par, s][1] for s in range(W))
            if cap is not None and total > cap:
                cap_error(me, f"received {total} > {cap}")
                return  # no row is waited for
            for s in range(W):
                yield lambda s=s: R.arrived[s] >= d.cnt[s][me]
            for s in range(W):
                if R.arrived[s] != d.cnt[s][me]:
                    raise Violation(f"rank {me} dispatch {k}: {R.arrived[s]} rows from {s}, expected {d.cnt[s][me]}")
                R.arrived[s] = 0
                R.count_inbox[par, s][2] = True
            exp = d.expected_out[me]
            got = [R.out.get(pos) for pos in range(len(exp))]
            if got != [(s, t, k) for s, t in exp] or len([1 for kk, _ in R.out_written if kk == k]) != len(exp):
                raise Violation(f"rank {me} dispatch {k}: output {got} is not {exp}")

        blocks = [announce(), receive()]
        for n in remote_nodes(me):
            for c in range(Q):
                b, e = _share(len(d.lists[me, n]), c, Q)
                if ll or e > b:
                    blocks.append(send(n, c))
        blocks += [copy(j) for j in local(me) if d.cnt[me][j] > 0]
        blocks += [relay(m) for m in remote_nodes(me)]
        blocks += [forward(m, c) for m in remote_nodes(me) for c in range(Q)]

        def epilogue():
            R.dispatch_epoch = k
            R.out_written = {x for x in R.out_written if x[0] == k}
        return blocks, epilogue

    # --- combine ----------------------------------------------------------------------------------
    def combine(me, external):
        R = ranks[me]
        e = R.combine_epoch + 1
        k = R.dispatch_epoch
        d = call(k)
        par, lp = e % 2, e % LP
        nm = node(me)
        ph = ("C", me, e)
        stats["wrs"][ph] = 0

        def ready_of_locals(who):
            return lambda: all(tag_wait(R.ready.get((par, j)), e, f"{who}: ready of {j}") for j in local(me))

        def read_row(j, pos, want, who):
            got = ranks[j].out.get(pos)
            if got != want:
                raise Violation(f"{who}: row {pos} of rank {j} is {got}, expected {want}")

        def start():
            if external:
                if "no_copy_wait" not in bugs:
                    yield lambda: all(R.done[q] >= e - 1 for q in local(me))
                if R.readers:
                    raise Violation(f"rank {me} combine {e}: input copy while a combine reads our rows")
                yield None
            for q in local(me):
                if ranks[q].combine_epoch < e - 2:
                    raise Violation(f"rank {me} combine {e}: ready on {q}, which is still in combine {ranks[q].combine_epoch + 1}")
                ranks[q].ready[par, me] = (e,)

        def proxy(m):
            o = rail(m, me)
            recs = R.route.get(m, [])
            lst = d.lists[o, nm]
            yield ready_of_locals(f"proxy {me} combine {e}")
            for j in local(me):
                ranks[j].readers += 1
            if not ll and recs and "no_land_free_wait" not in bugs:
                yield lambda: R.land_free[m] >= e - 1
            for c in range(Q):
                b, e_ = _share(len(recs), c, Q)
                if e_ == b and (not ll or "ll_skip_empty_tail" in bugs):
                    continue
                for cb, ce in chunks(b, e_, len(recs)):
                    for i in range(cb, ce):
                        for j in sorted(recs[i]):
                            read_row(j, recs[i][j], (o, lst[i], k), f"proxy {me} combine {e}")
                        stage_write(me, ("partial", m, i), (e, (o, lst[i], tuple(sorted(recs[i])))), f"combine {e} partial")
                    yield None
                    post_chunk(me, o, c, [("partial", m, i) for i in range(cb, ce)], lambda X: X.landing, lp, cb,
                               lambda X: X.land_tail, (e, ce - b), ph,
                               lambda i, x: f"rank {me} combine {e}: partial {i} on {o} still holds combine {x}, unread")
                    yield None
            for j in local(me):
                ranks[j].readers -= 1

        def owner():
            yield ready_of_locals(f"rank {me} combine {e}")
            for j in local(me):
                ranks[j].readers += 1
            partials = {}  # (token, node) -> local ranks summed
            for t, ds in enumerate(d.routes[me]):
                mine = tuple(j for j in ds if node(j) == nm)
                for j in mine:
                    read_row(j, sum(d.cnt[q][j] for q in range(me)) + d.idx[me, j, t], (me, t, k), f"rank {me} combine {e}")
                if mine:
                    partials[t, nm] = mine
            yield None
            for j in local(me):
                ranks[j].readers -= 1
            for n in remote_nodes(me):
                lst = d.lists[me, n]
                for c in range(Q):
                    b, e_ = _share(len(lst), c, Q)
                    if e_ == b and (not ll or "ll_skip_empty_tail" in bugs):
                        continue
                    yield lambda n=n, c=c, b=b, e_=e_: tag_wait(R.land_tail.get((lp, n, c)), e, f"rank {me} combine {e}: landing tail {c} of node {n}") \
                        and R.land_tail[lp, n, c][1] >= e_ - b
                    if R.land_tail[lp, n, c][1] != e_ - b:
                        raise Violation(f"rank {me} combine {e}: landing tail {R.land_tail[lp, n, c]}, expected {e_ - b}")
                    for i in range(b, e_):
                        slot = R.landing.get((lp, n, i))
                        if slot is None or slot[0] != e or slot[1][:2] != (me, lst[i]):
                            raise Violation(f"rank {me} combine {e}: partial {i} from node {n} is {slot and slot[:2]}")
                        if (lst[i], n) in partials:
                            raise Violation(f"rank {me} combine {e}: two partials of node {n} for token {lst[i]}")
                        partials[lst[i], n] = slot[1][2]
                        slot[2] = True
            for t, ds in enumerate(d.routes[me]):  # the sum: ascending node, each partial ascending rank
                got = tuple((n, partials[t, n]) for n in range(N) if (t, n) in partials)
                want = tuple((n, tuple(j for j in ds if node(j) == n)) for n in range(N) if any(node(j) == n for j in ds))
                if got != want:
                    raise Violation(f"rank {me} combine {e}: token {t} sums {got}, expected {want}")
            if not ll:
                for n in remote_nodes(me):
                    p = rail(n, me)

                    def apply(v, p=p):
                        ranks[p].land_free[nm] = max(ranks[p].land_free[nm], v)
                    post(me, p, 0, [], apply, inline=e, phase=ph)
            yield None

        blocks = [start(), owner()] + [proxy(m) for m in remote_nodes(me)]

        def epilogue():
            for q in local(me):
                ranks[q].done[me] = e
            R.combine_epoch = e
        return blocks, epilogue

    # --- scheduler --------------------------------------------------------------------------------
    def program(me):
        for op in (ops[me] if isinstance(ops, list) else ops):  # a list: each rank's own
            yield dispatch(me) if op == "D" else combine(me, op == "X")

    progs = [program(r) for r in range(W)]
    running = [None] * W
    done_ops = [0] * W

    def start(r):
        nxt = next(progs[r], None)
        if nxt is None:
            running[r] = None
            return
        blocks, epi = nxt
        running[r] = ([[b, None, False] for b in blocks], epi)

    for r in range(W):
        start(r)

    def candidates(only=None):
        cands = []
        for r in range(W) if only is None else (only,):
            if running[r] is None:
                continue
            blocks, _ = running[r]
            live = [b for b in blocks if not b[2]]
            cands += [(r, b) for b in live] if live else [(r, None)]
        cands += [("nic", q) for q in nic if only is None or q[0] == only]
        return cands

    def ready(cand):
        r, b = cand
        if r == "nic":
            return True
        if b is None:  # epilogue: every block ended; the kernel ends after its WRITEs completed
            return "no_quiet" in bugs or quiet(r)
        if b[1] is None or b[1]():
            return True
        if ranks[r].aborted:  # its wait bails out on the abort flag: the block ends
            b[2] = True
            gave_up[0] = True
        return False

    gave_up = [False]
    while any(x is not None for x in running) or nic:
        pick = None
        gave_up[0] = False
        for only in ((fast,) if skew and rnd.random() < skew else ()) + (None,):
            cands = candidates(only)
            put_off = None
            while cands:
                i = rnd.randrange(len(cands))
                if ready(cands[i]):
                    if cands[i][0] != "nic" or put_off or not slow_nic or rnd.random() >= slow_nic:
                        pick = cands[i]
                        break
                    put_off = cands[i]
                cands[i] = cands[-1]
                cands.pop()
            pick = pick or put_off
            if pick:
                break
        if pick is None and gave_up[0]:
            continue
        if pick is None:
            stuck = [f"rank {r} op {done_ops[r]} line {b[0].gi_frame.f_lineno if b[0].gi_frame else '-'}"
                     for r in range(W) if running[r] for b in running[r][0] if not b[2]]
            raise Violation("deadlock: no block can move and no WRITE is in flight: " + "; ".join(stuck))
        r, b = pick
        if r == "nic":
            deliver(b)
        elif b is None:
            running[r][1]()
            done_ops[r] += 1
            stats["max_lead"] = max(stats["max_lead"], done_ops[r] - min(done_ops))
            start(r)
        else:
            try:
                b[1] = next(b[0])
            except StopIteration:
                b[2] = True
    stats["errors"] = {r: ranks[r].errors for r in range(W) if ranks[r].errors}
    reports.check(ranks, sorted(calls))
    return stats


V1_TOPOLOGIES = ((4, 2), (4, 1), (6, 3), (6, 2), (2, 2))  # (W, G); 2 x 1 node: nothing remote
V1_SEQUENCES = ("DCCDCC", "DDDD", "DXCDDC")  # two combines per dispatch, dispatch-only, mixed


def _schedule(seed, W):
    """Scheduling variety by seed: uniform, one rank ahead, WRITEs late, both."""
    v = seed % 4
    return {"skew": 0.9 if v & 1 else 0.0, "fast": (seed // 4) % W, "slow_nic": 0.9 if v & 2 else 0.0}


def _v1_holds(ll, seeds):
    for W, G in V1_TOPOLOGIES:
        for pattern in ("mixed", "incast", "local"):
            for ops in V1_SEQUENCES:
                for seed in range(seeds):
                    st = run_v1(W, G, ops, seed * 41 + W, ll=ll, pattern=pattern, **_schedule(seed, W))
                    if pattern == "local":  # zero-byte chunks: no record moves, every call completes
                        assert st["chunks"] == 0
                    if ll:  # at most 3 work requests per (remote node, QP) and phase
                        N = W // G
                        assert all(n <= 3 * (N - 1) * 2 for n in st["wrs"].values()), st["wrs"]


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_v1_protocol_holds_in_random_interleavings():
    _v1_holds(False, seeds=8)


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_v1ll_protocol_holds_in_random_interleavings():
    _v1_holds(True, seeds=8)


def test_v1_through_run_modes():
    for mode in ("v1", "v1ll"):
        for seed in range(10):
            run(4, "DCCXD", seed=seed, mode=mode, G=2)


def test_v1_rank_runs_ahead_as_far_as_allowed():
    """V1: with every token on its node, a rank finishes a dispatch and its combines while the
    other node has only started the dispatch (combine waits only for nodes it has records from).
    V1LL waits for every rail peer in every call: it stays within a call or two."""
    lead_v1 = max(run_v1(4, 1, "DCCDCC", seed, pattern="local", skew=0.95, fast=seed % 4)["max_lead"]
                  for seed in range(6))
    assert lead_v1 == 3
    lead_ll = max(run_v1(4, 2, "DCCDCC", seed, ll=True, skew=0.95, fast=seed % 4)["max_lead"]
                  for seed in range(20))
    assert lead_ll <= 2


def v1_catches(bug, needle, ll=False, ops="DCC", topologies=((4, 1), (4, 2)), seeds=150, **kw):
    """The first violation `bug` leads to (searching seeds and schedules); its message must hold
    `needle` (or one of a tuple), so it is the property the guard protects that fails."""
    needles = (needle,) if isinstance(needle, str) else needle
    for seed in range(seeds):
        for W, G in topologies:
            try:
                run_v1(W, G, ops, seed, ll=ll, bugs=(bug,), **_schedule(seed, W), **kw)
            except Violation as e:
                assert any(n in str(e) for n in needles), str(e)
                return str(e)
    raise AssertionError(f"the model did not find the race without {bug}")


def test_v1_model_finds_single_buffered_count_record():
    v1_catches("count_one_parity", "not relayed", ops="DDDD")
    v1_catches("count_one_parity", "not relayed", ll=True, ops="DDDD")


def test_v1_model_finds_missing_credit_wait():
    v1_catches("no_credit_wait", "not forwarded", ops="DDD")


def test_v1_model_finds_missing_landing_free_wait():
    v1_catches("no_land_free_wait", "unread", ops="DCC")


def test_v1ll_model_finds_single_buffered_inbox_and_landing():
    v1_catches("ll_one_parity_inbox", ("not forwarded", "found the signal of call"), ll=True, ops="DDD")
    v1_catches("ll_one_parity_landing", ("unread", "found the signal of call"), ll=True, ops="DCC")


def test_v1ll_model_finds_missing_empty_landing_tail():
    v1_catches("ll_skip_empty_tail", "unread", ll=True, ops="DCCCC")


def test_v1_model_finds_tail_on_another_qp():
    for ll in (False, True):
        msg = v1_catches("tail_other_qp", "", ll=ll, ops="DC")
        assert "record" in msg or "partial" in msg, msg


def test_v1_model_finds_missing_quiet():
    v1_catches("no_quiet", "rewritten while a WRITE still reads it", ops="DDDD")
    v1_catches("no_quiet", "rewritten while a WRITE still reads it", ll=True, ops="DCCC")


def test_v1_model_finds_missing_local_waits():
    for ll in (False, True):
        v1_catches("no_done_wait", ("while a combine reads it", "expected"), ll=ll, ops="DCCDCC", topologies=((4, 2),))
        v1_catches("no_copy_wait", "input copy while a combine reads", ll=ll, ops="DXX", topologies=((4, 2),))
        v1_catches("no_dest_wait", "dispatch", ll=ll, ops="DCCDCC", topologies=((4, 2),))
        v1_catches("no_base_wait", "dispatch", ll=ll, ops="DD")


def v1_cap_reporters(d, W, G, cap):
    """Ranks that must report a receive-capacity overflow of dispatch `d` (IntraNode's rule on
    V1's writers): j when its total passes cap; the writer of source s's rows for j (s itself on
    j's node, else s's rail peer there) when base(s->j) + count(s->j) > cap."""
    rep = set()
    for j in range(W):
        base = 0
        for s in range(W):
            c = d.cnt[s][j]
            if c and base + c > cap:
                rep.add(s if s // G == j // G else (j // G) * G + s % G)
            base += c
        if base > cap:
            rep.add(j)
    return rep


def test_v1_receive_cap_error_reaches_every_rank_and_strands_none():
    """A dispatch past max_total_recv_tokens: every rank finishes the call (no wait left open: the
    model raises a deadlock otherwise), exactly the ranks that receive too much or write rows past
    a capacity report it (GPU suite's receive_cap_overflow: every token to rank 0, cap M + M/2,
    so rank 0's node), and the rows below the capacity still land where IntraNode puts them."""
    for ll in (False, True):
        for W, G in ((4, 2), (4, 1), (6, 3), (6, 2)):
            for pattern, M, cap in (("one_rank", 4, 6), ("mixed", 5, 4), ("incast", 5, 7)):
                for seed in range(12):
                    st = run_v1(W, G, "D", seed * 7 + W, ll=ll, M=M, pattern=pattern, cap=cap,
                                **_schedule(seed, W))
                    # the routing of call 1, drawn again from the same seed
                    d = V1Call(v1_routing(random.Random(seed * 7 + W), W, G, M, pattern), W, G)
                    assert set(st["errors"]) == v1_cap_reporters(d, W, G, cap), (ll, W, G, pattern, seed, st["errors"])
                    if pattern == "one_rank":
                        assert set(st["errors"]) == set(range(G)), st["errors"]


def test_v1ll_model_finds_the_first_builds_cap_abort():
    """The first build raised the abort flag where it found the overflow: its packing blocks then
    posted nothing, and V1LL's rail peer waits for every share's tail, also an empty one (the
    GPU's 'rank 3 waits a V1 tail from its rail peer 1')."""
    for seed in range(200):
        try:
            run_v1(4, 2, "D", seed, ll=True, bugs=("cap_abort",), M=4, pattern="one_rank", cap=6,
                   **_schedule(seed, 4))
        except Violation as e:
            assert "deadlock" in str(e), str(e)
            return
    raise AssertionError("the model did not find the stranded wait with cap_abort")


# --- input errors every rank learns in the same call (docs/ep.md, "Errors") ----------------------

def test_input_error_report_reaches_every_rank_in_the_same_call():
    """A rank whose dispatch input has a bad expert id flags the count it announces to every rank
    and writes its report before it; every rank's receive step (fused dispatch or dispatch_recv)
    records the lowest flagging rank's report, in the same call, on one node and across nodes."""
    for mode, W, G in (("push", 3, None), ("pull", 4, None), ("inter", 4, 2), ("inter_push", 4, 2)):
        for ops in ("DCDCDD", "SCSXSC", "DSDSCC"):
            for seed in range(30):
                run(W, ops, seed=seed * 13 + W, mode=mode, G=G, bad=0.4)


def test_v1_input_error_report_is_relayed_in_the_same_call():
    """InterNodeV1/V1LL: the report goes to each rail peer on QP 0 before the flagged count record;
    the relay copies it to its node's ranks before their count signals; every rank records the
    same report in every call (dispatch-only loops included: slots of two parities)."""
    for ll in (False, True):
        for W, G in V1_TOPOLOGIES:
            for ops in ("DCCDCC", "DDDD"):
                for seed in range(6):
                    run_v1(W, G, ops, seed * 41 + W, ll=ll, bad=0.5, **_schedule(seed, W))


def test_model_finds_report_races():
    # One report slot per source (not one per parity): a rank one call ahead writes its next
    # report before a slow receiver read the last one.
    n = 0
    for seed in range(200):
        try:
            run(3, "DDDD", seed=seed, mode="push", bugs=("report_one_parity",), bad=0.6)
        except Violation as e:
            assert "report of" in str(e), str(e)
            n += 1
    assert n > 0
    v1_catches("report_one_parity", "report of", ops="DDDD", bad=0.6)
    # The report after the count record (or on another QP): the relay finds no report of the call.
    v1_catches("report_after_record", "report of", ll=True, ops="DD", bad=0.6)


@pytest.mark.full  # a randomized search of seconds: the full tier
def test_v1ll_long_lists_in_v1_chunks_hold():
    """InterNodeV1LL with any max_num_inp_token_per_rank: lists longer than the one-WRITE bound go
    in V1's chunks (dispatch records and combine partials) with the LL protocol (parities, no
    credits, a tail on every channel); forwarders and owners take either."""
    for one_chunk in (0, 2):
        for W, G in V1_TOPOLOGIES:
            for pattern in ("mixed", "incast"):
                for ops in V1_SEQUENCES:
                    for seed in range(6):
                        run_v1(W, G, ops, seed * 41 + W, ll=True, pattern=pattern, ll_one_chunk=one_chunk,
                               **_schedule(seed, W))
