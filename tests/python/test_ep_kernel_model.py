"""A pure-Python model of the IntraNode dispatch kernel's index arithmetic (no GPU, no torch):
block -> destination groups, the per-destination membership bitmap in warp-sized words, its
prefix counts, the binary search + n-th-set-bit lookup of a list position, the row range of each
block, the slot table, and the split of a row into parts. It checks that, for many shapes, every
(source, token) row lands exactly once at the documented slot on its destination (rows ordered by
source rank, then source token) and that the slot table combine reads agrees.

The arithmetic mirrors src/ops/dispatch_combine/intranode_dispatch.cpp line by line; when one
changes, change the other."""

import random


def popcount(x):
    return bin(x).count("1")


def membership_words(idx_rows, dest, epr, num_experts, warp):
    """Bitmap of tokens going to `dest`, one int per warp-sized word (ballot order)."""
    T = len(idx_rows)
    n_words = (T + warp - 1) // warp
    words = []
    for w in range(n_words):
        word = 0
        for lane in range(warp):
            t = w * warp + lane
            if t >= T:
                continue
            member = any(0 <= e < num_experts and e // epr == dest for e in idx_rows[t])
            if member:
                word |= 1 << lane
        words.append(word)
    return words


def exclusive_prefix(words):
    prefix, carry = [], 0
    for w in words:
        prefix.append(carry)
        carry += popcount(w)
    prefix.append(carry)
    return prefix


def nth_set_bit(word, n, warp):
    # WarpNthSetBit: the lane whose bit is set and has exactly n set bits below it
    hits = [lane for lane in range(warp) if (word >> lane) & 1 and popcount(word & ((1 << lane) - 1)) == n]
    assert len(hits) == 1, (word, n)
    return hits[0]


def position_to_token(words, prefix, p, warp):
    lo, hi = 0, len(words) - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if prefix[mid] <= p:
            lo = mid
        else:
            hi = mid - 1
    return lo * warp + nth_set_bit(words[lo], p - prefix[lo], warp)


def block_role(b, nb, W, me):
    """EpDispatchBlockRole (intranode_device.hpp): (dest, g, G) of block b of nb on PE me."""
    if W <= 1 or nb < 3 * W:
        return (b + me) % W, b // W, (nb - 1 - (b % W)) // W + 1
    n_local = max(1, nb // (2 * W - 1))
    if b < n_local:
        return me, b, n_local
    r, n_remote = b - n_local, nb - n_local
    q = r % (W - 1)
    return (me + 1 + q) % W, r // (W - 1), (n_remote - 1 - q) // (W - 1) + 1


def test_block_roles_cover_every_destination():
    for W in range(1, 9):
        for nb in range(W, 140):
            for me in range(W):
                roles = [block_role(b, nb, W, me) for b in range(nb)]
                assert roles[0][0] == me and roles[0][1] == 0  # block 0 leads the local destination
                for d in range(W):
                    gs = sorted(g for dest, g, _ in roles if dest == d)
                    assert gs == list(range(len(gs))) and len(gs) >= 1, (W, nb, me, d)
                    assert all(G == len(gs) for dest, _, G in roles if dest == d)


def simulate(W, epr, routing, grid, warp, n_warps):
    """routing[s] = list of top-k rows of PE s. Returns (placements, slot tables, counts)."""
    num_experts = W * epr
    count = [[popcount_sum(membership_words(routing[s], d, epr, num_experts, warp)) for d in range(W)] for s in range(W)]
    placed = [dict() for _ in range(W)]  # placed[d][slot] = (s, t)
    slot_table = [dict() for _ in range(W)]  # slot_table[s][(t, d)] = slot or -1
    for s in range(W):
        T = len(routing[s])
        for b in range(grid):
            dest, g, G = block_role(b, grid, W, s)
            words = membership_words(routing[s], dest, epr, num_experts, warp)
            prefix = exclusive_prefix(words)
            count_d = prefix[len(words)]
            assert count_d == count[s][dest]
            send_base = sum(count[x][dest] for x in range(s))
            # slot table of tokens [t0, t1)
            t0, t1 = T * g // G, T * (g + 1) // G
            for t in range(t0, t1):
                w, bit = t // warp, t % warp
                word = words[w]
                slot = -1
                if (word >> bit) & 1:
                    slot = send_base + prefix[w] + popcount(word & ((1 << bit) - 1))
                key = (t, dest)
                assert key not in slot_table[s], ("slot written twice", s, key)
                slot_table[s][key] = slot
            # rows [i0, i1)
            i0, i1 = count_d * g // G, count_d * (g + 1) // G
            n_rows = i1 - i0
            if n_rows <= 0:
                continue
            parts = 1
            vecs = 448
            if n_rows < n_warps:
                parts = n_warps // n_rows
                parts = min(parts, max(1, vecs // (2 * warp)))
            for item in range(n_rows * parts):
                r, part = divmod(item, parts)
                p = i0 + r
                t = position_to_token(words, prefix, p, warp)
                slot = send_base + p
                if part == 0:
                    assert slot not in placed[dest], ("row written twice", dest, slot)
                    placed[dest][slot] = (s, t)
    return placed, slot_table, count


def popcount_sum(words):
    return sum(popcount(w) for w in words)


def reference(W, epr, routing):
    num_experts = W * epr
    out = []
    for d in range(W):
        rows = []
        for s in range(W):
            for t, row in enumerate(routing[s]):
                if any(0 <= e < num_experts and e // epr == d for e in row):
                    rows.append((s, t))
        out.append(rows)
    return out


def random_routing(rnd, W, epr, K, T, mode):
    E = W * epr
    rows = []
    for _ in range(T):
        if mode == "one_rank":
            row = rnd.sample(range(epr), min(K, epr))
        else:
            row = rnd.sample(range(E), min(K, E))
        if mode == "neg":
            row = [-1 if rnd.random() < 0.4 else e for e in row]
        if mode == "bad":
            row = [rnd.choice([-5, E, E + 3, e]) for e in row]
        rows.append(row)
    return rows


def check(W, epr, K, Ts, grid, warp, n_warps, mode, seed):
    rnd = random.Random(seed)
    routing = [random_routing(rnd, W, epr, K, T, mode) for T in Ts]
    placed, slot_table, count = simulate(W, epr, routing, grid, warp, n_warps)
    ref = reference(W, epr, routing)
    for d in range(W):
        got = [placed[d].get(i) for i in range(len(ref[d]))]
        assert got == ref[d], f"dest {d}: rows out of place"
        assert len(placed[d]) == len(ref[d]), "rows past the total"
        assert sum(count[s][d] for s in range(W)) == len(ref[d])
    for s in range(W):
        for t in range(len(routing[s])):
            for d in range(W):
                slot = slot_table[s][(t, d)]
                if slot >= 0:
                    assert placed[d][slot] == (s, t)
                else:
                    assert (s, t) not in ref[d]


def test_dispatch_model_many_shapes():
    rnd = random.Random(1234)
    cases = 0
    for W in (1, 2, 3, 4, 8):
        for warp in (32, 64):
            for _ in range(6):
                epr = rnd.choice([1, 2, 4, 8])
                K = rnd.randint(1, min(9, W * epr))
                M = rnd.choice([1, 7, 64, 130, 300])
                Ts = [rnd.choice([0, 1, M, rnd.randint(0, M)]) for _ in range(W)]
                grid = rnd.choice([W, W + 1, 2 * W + 1, 3 * W, 5 * W + 3])
                n_warps = rnd.choice([1, 4, 16])
                mode = rnd.choice(["random", "neg", "one_rank", "bad"])
                check(W, epr, K, Ts, grid, warp, n_warps, mode, rnd.random())
                cases += 1
    assert cases > 50


def test_dispatch_model_edge_grids():
    # one block per destination, and the most uneven groups
    check(4, 2, 3, [130, 0, 64, 1], 4, 32, 16, "neg", 1)
    check(4, 2, 3, [130, 0, 64, 1], 7, 64, 1, "random", 2)
    check(2, 8, 8, [300, 300], 132, 32, 16, "random", 3)


def test_row_parts_cover_row():
    for vecs in (1, 2, 63, 448, 896, 1000):
        for parts in range(1, 20):
            covered = []
            for part in range(parts):
                vb, ve = vecs * part // parts, vecs * (part + 1) // parts
                covered.extend(range(vb, ve))
            assert covered == list(range(vecs))


# --- staged combine (intranode_combine.cpp: WarpReduceRowsStaged) -----------------------------
STAGES, STAGE_BYTES, STAGE_ROWS = 3, 4096, 4  # kEpCombineStages / StageBytes / StageRows


def staged_chunks(n, vb, ve):
    """(chunk bytes per row, [(offset, bytes)]) of one item, as the kernel streams it."""
    chunk = (STAGE_BYTES // n) & ~15
    begin, end = vb * 16, ve * 16
    n_chunks = (end - begin + chunk - 1) // chunk
    out = []
    for c in range(n_chunks):
        off = begin + c * chunk
        out.append((off, min(chunk, end - off)))
    return chunk, out


def test_staged_chunks_cover_the_row_once_and_fit_the_stage():
    rnd = random.Random(5)
    for _ in range(3000):
        n = rnd.randint(1, STAGE_ROWS)
        vecs = rnd.randint(1, 2000)
        parts = rnd.randint(1, 8)
        part = rnd.randrange(parts)
        vb, ve = vecs * part // parts, vecs * (part + 1) // parts
        chunk, chunks = staged_chunks(n, vb, ve)
        assert chunk % 16 == 0 and chunk * n <= STAGE_BYTES and chunk >= 16
        covered = []
        for off, nbytes in chunks:
            assert off % 16 == 0 and nbytes % 16 == 0 and 0 < nbytes <= chunk
            covered.extend(range(off // 16, (off + nbytes) // 16))
        assert covered == list(range(vb, ve))  # every vector once, in order


def test_staged_stage_reuse_waits_for_the_previous_use():
    """A warp's chunk k uses stage k % S and barrier phase (k // S) & 1; chunk k + S refills the
    stage only after chunk k was summed (issued at step k + 1, after step k's warp barrier)."""
    rnd = random.Random(6)
    for _ in range(300):
        uses = 0
        for _item in range(rnd.randint(1, 6)):
            n_chunks = rnd.randint(1, 20)
            issued, summed = {}, set()
            k0 = uses
            order = []  # (event, chunk)
            for c in range(min(STAGES - 1, n_chunks)):
                order.append(("issue", c))
            for c in range(n_chunks):
                if c + STAGES - 1 < n_chunks:
                    order.append(("issue", c + STAGES - 1))
                order.append(("sum", c))
            for ev, c in order:
                k = k0 + c
                stage = k % STAGES
                if ev == "issue":
                    prev = k - STAGES  # the last chunk that used this stage
                    assert prev < k0 or (prev - k0) in summed, (k, prev)
                    issued[c] = (stage, (k // STAGES) & 1)
                else:
                    assert c in issued and issued[c][0] == stage
                    summed.add(c)
            assert summed == set(range(n_chunks))
            uses = k0 + n_chunks
