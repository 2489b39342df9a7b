"""A model of the IntraNode dispatch kernel's indexing (no GPU, no torch), built on the kernel's
own work splits (src/ops/dispatch_combine/common_device.hpp and combine_reduce.hpp, called
through mori._C._testing): block roles (EpDispatchBlockRole), the rows and tokens of each block
(EpShareBegin) and the pool of rows claimed after the shares (EpDispatchShareRows), the warps per row (EpPartsPerRow), the word that holds a list position
(EpWordOfPosition) and the staged combine's chunks (EpStagedChunk*). The warp primitives are
modelled by what they compute: the membership bitmap in warp-sized words (ballot), its exclusive
prefix counts (warp scan), the n-th set bit of a word (WarpNthSetBit). It checks that, for many
shapes, every (source, token) row lands exactly once at the documented slot on its destination
(rows ordered by source rank, then source token), that the slot table combine reads agrees, and
the splits' own contracts."""

import random


def _testing():
    """mori._C._testing, imported on first use (tools/bench/ep_trace.py imports block_role before
    it has made mori importable)."""
    from mori import _C

    return _C._testing


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
    w = _testing().ep_word_of_position(prefix, len(words), p)
    return w * warp + nth_set_bit(words[w], p - prefix[w], warp)


def block_role(b, nb, W, me, local_blocks=0):
    """EpDispatchBlockRole: (dest, g, G) of dispatch block b of nb on PE me (local_blocks:
    MORI_EP_DISPATCH_LOCAL_BLOCKS, 0 = unset)."""
    return _testing().ep_dispatch_block_role(b, nb, W, me, local_blocks)


def share(n, i, parts):
    """[begin, end) of share i of n items in `parts` shares (EpShareBegin)."""
    return _testing().ep_share_begin(n, i, parts), _testing().ep_share_begin(n, i + 1, parts)


def test_block_roles_cover_every_destination():
    for W in range(1, 33):
        for nb in range(W, 140):
            for me in range(W) if W <= 8 else {0, W // 2, W - 1}:
                roles = _testing().ep_dispatch_block_roles(nb, W, me)
                assert len(roles) == nb
                assert roles[0][0] == me and roles[0][1] == 0  # block 0 leads the local destination
                for d in range(W):
                    gs = sorted(g for dest, g, _ in roles if dest == d)
                    assert gs == list(range(len(gs))) and len(gs) >= 1, (W, nb, me, d)
                    assert all(G == len(gs) for dest, _, G in roles if dest == d)


def _group_sizes(nb, W, me):
    """{dest: number of dispatch blocks serving it} on PE me."""
    sizes = {}
    for d, _, _ in _testing().ep_dispatch_block_roles(nb, W, me):
        sizes[d] = sizes.get(d, 0) + 1
    return sizes


def test_peer_groups_are_about_twice_the_local_group():
    # From 3 blocks per destination on, a peer's group is about twice the local one: a block copies
    # local rows about twice as fast as it streams rows to a peer.
    for W in range(2, 17):
        for nb in range(3 * W, 200):
            for me in {0, W - 1}:
                sizes = _group_sizes(nb, W, me)
                local = sizes[me]
                for d, n in sizes.items():
                    if d != me:
                        assert 2 * local <= n <= 2 * local + 2, (W, nb, me, d, local, n)


def test_local_blocks_requested_are_kept_within_every_peer_keeping_three():
    # MORI_EP_DISPATCH_LOCAL_BLOCKS: the local group's size, at most the blocks less 3 per peer;
    # every destination keeps one leader and peers share the rest evenly; 0 is the default split.
    for W in range(2, 9):
        for nb in range(3 * W, 80):
            default = _group_sizes(nb, W, 0)
            assert _testing().ep_dispatch_block_roles(nb, W, 0, 0) == _testing().ep_dispatch_block_roles(nb, W, 0)
            for want in range(1, nb + 2):
                roles = _testing().ep_dispatch_block_roles(nb, W, 0, want)
                sizes = {}
                for d, g, G in roles:
                    sizes[d] = sizes.get(d, 0) + 1
                assert sizes[0] == min(want, nb - 3 * (W - 1)), (W, nb, want, sizes)
                peers = sorted(n for d, n in sizes.items() if d != 0)
                assert len(peers) == W - 1 and peers[0] >= 3 and peers[-1] - peers[0] <= 1, (W, nb, want)
                assert roles[0][:2] == (0, 0)
            assert default[0] == max(1, nb // (2 * W - 1))
    # Below 3 blocks per destination the request is ignored (round-robin).
    assert _testing().ep_dispatch_block_roles(5, 2, 0, 4) == _testing().ep_dispatch_block_roles(5, 2, 0)


def test_block_roles_round_robin_below_three_blocks_per_destination():
    for W in range(1, 17):
        for nb in range(W, 3 * W):
            sizes = sorted(_group_sizes(nb, W, 0).values())
            assert sizes[-1] - sizes[0] <= 1, (W, nb, sizes)


def test_block_role_arguments_out_of_range_raise():
    import pytest

    for args in ((0, 0, 1, 0), (4, 4, 2, 0), (0, 4, 2, 2), (0, 4, 0, 0)):
        with pytest.raises(ValueError):
            _testing().ep_dispatch_block_role(*args)


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
            t0, t1 = share(T, g, G)
            for t in range(t0, t1):
                w, bit = t // warp, t % warp
                word = words[w]
                slot = -1
                if (word >> bit) & 1:
                    slot = send_base + prefix[w] + popcount(word & ((1 << bit) - 1))
                key = (t, dest)
                assert key not in slot_table[s], ("slot written twice", s, key)
                slot_table[s][key] = slot
            # rows [i0, i1) of the first share_rows, and (the group's first block here: any warp
            # of the group claims them) the pool [share_rows, count_d)
            share_rows = _testing().ep_dispatch_share_rows(count_d, G * n_warps)
            i0, i1 = share(share_rows, g, G)
            n_rows = i1 - i0
            if share_rows < count_d:
                assert n_rows >= n_warps, ("a warp without a share item beside a pool", n_rows, n_warps)
            vecs = 448
            parts = _testing().ep_parts_per_row(n_rows, n_warps, vecs) if n_rows > 0 else 1
            if share_rows < count_d:
                assert parts == 1, ("pool rows are whole rows; so are the share's", parts)
            pool = range(share_rows, count_d) if g == 0 else range(0)
            for item in list(range(n_rows * parts)) + [n_rows * parts + q for q in range(len(pool))]:
                if item < n_rows * parts:
                    r, part = divmod(item, parts)
                    p = i0 + r
                else:
                    part, p = 0, share_rows + (item - n_rows * parts)
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
    # pools: one warp per destination, and blocks of 4 warps with a few rows each
    check(2, 8, 8, [300, 300], 2, 32, 1, "random", 4)
    check(3, 4, 4, [300, 130, 300], 10, 32, 4, "one_rank", 5)


def test_dispatch_pool_leaves_every_warp_a_share_row():
    # the kernel's first share item of warp w is item w: with a pool every share has >= n_warps rows
    for rows in range(0, 400):
        for G in range(1, 9):
            for n_warps in (1, 2, 4, 16):
                gw = G * n_warps
                share_rows = _testing().ep_dispatch_share_rows(rows, gw)
                if rows >= 2 * gw:
                    assert share_rows == rows - gw, (rows, gw, share_rows)
                    assert min(e - b for b, e in (share(share_rows, g, G) for g in range(G))) >= n_warps
                else:
                    assert share_rows == rows, (rows, gw, share_rows)


def test_shares_cover_in_order_and_differ_by_at_most_one():
    for n in (0, 1, 2, 63, 448, 896, 1000, 4096, 1 << 20):
        for parts in range(1, 20):
            bounds = [share(n, i, parts) for i in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))
            sizes = [e - b for b, e in bounds]
            assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, (n, parts, sizes)


def test_parts_per_row_one_item_per_warp_and_two_vectors_per_lane():
    W = _testing().WARP_SIZE
    for warps in (1, 4, 8, 16, 32, 64, 256, 1024):
        for rows in range(0, 40):
            for vecs in (1, 2 * W - 1, 2 * W, 4 * W + 1, 448, 896, 4096):
                parts = _testing().ep_parts_per_row(rows, warps, vecs)
                if rows == 0 or rows >= warps:
                    assert parts == 1, (rows, warps, vecs, parts)
                    continue
                assert parts >= 1 and rows * parts <= warps, (rows, warps, vecs, parts)
                assert parts == 1 or vecs >= 2 * W * parts, (rows, warps, vecs, parts)
                # and no larger count keeps both
                bigger = parts + 1
                assert rows * bigger > warps or vecs < 2 * W * bigger, (rows, warps, vecs, parts)


def test_word_of_position_holds_the_position():
    rnd = random.Random(7)
    for _ in range(400):
        warp = rnd.choice([32, 64])
        words = [rnd.choice([0, 0, rnd.getrandbits(warp), (1 << warp) - 1]) for _ in range(rnd.randint(1, 40))]
        prefix = exclusive_prefix(words)
        for p in range(prefix[-1]):
            w = _testing().ep_word_of_position(prefix, len(words), p)
            assert prefix[w] <= p < prefix[w] + popcount(words[w]), (words, p, w)


# --- staged combine (combine_body.hpp: WarpReduceRowsStaged) -----------------------------
def staged_chunks(n, vb, ve):
    """(chunk bytes per row, [(offset, bytes)]) of one item, as the kernel streams it."""
    chunk = _testing().ep_staged_chunk_bytes(n)
    begin, end = vb * 16, ve * 16
    out = []
    for c in range(_testing().ep_staged_chunk_count(begin, end, chunk)):
        off = begin + c * chunk
        out.append((off, _testing().ep_staged_chunk_length(off, end, chunk)))
    return chunk, out


def test_staged_chunks_cover_the_row_once_and_fit_the_stage():
    rnd = random.Random(5)
    for _ in range(3000):
        n = rnd.randint(1, _testing().EP_COMBINE_STAGE_ROWS)
        vecs = rnd.randint(1, 2000)
        parts = rnd.randint(1, 8)
        vb, ve = share(vecs, rnd.randrange(parts), parts)
        if vb == ve:
            continue
        chunk, chunks = staged_chunks(n, vb, ve)
        assert chunk % 16 == 0 and chunk * n <= _testing().EP_COMBINE_STAGE_BYTES and chunk >= 16
        covered = []
        for off, nbytes in chunks:
            assert off % 16 == 0 and nbytes % 16 == 0 and 0 < nbytes <= chunk
            covered.extend(range(off // 16, (off + nbytes) // 16))
        assert covered == list(range(vb, ve))  # every vector once, in order


def test_staged_arguments_out_of_range_raise():
    import pytest

    for n in (0, _testing().EP_COMBINE_STAGE_ROWS + 1):
        with pytest.raises(ValueError):
            _testing().ep_staged_chunk_bytes(n)


def test_staged_stage_reuse_waits_for_the_previous_use():
    """A warp's chunk k uses stage k % S and barrier phase (k // S) & 1; chunk k + S refills the
    stage only after chunk k was summed (issued at step k + 1, after step k's warp barrier)."""
    STAGES = _testing().EP_COMBINE_STAGES
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


def test_copy_chunks_cover_the_copy_in_aligned_pieces():
    """The combine's external-input copy is cut into claimed chunks (EpCopyChunkSize): aligned,
    at least 4096 units, about two per block, and their count covers n exactly once."""
    size = _testing().ep_copy_chunk_size
    for n in (0, 1, 15, 16, 4096, 4097, 128 * 7168 * 2, 4096 * 14336, 123457 * 16):
        for align in (1, 16):
            for blocks in (1, 3, 24, 80, 132):
                c = size(n, align, blocks)
                assert c >= 4096 and c % align == 0, (n, align, blocks, c)
                chunks = -(-n // c)
                assert (chunks - 1) * c < n <= chunks * c or n == 0
                if n >= 2 * blocks * 4096 * align:  # large copies: about two chunks per block
                    assert 2 * blocks - 1 <= chunks <= 2 * blocks, (n, blocks, chunks)


# --- input errors (docs/ep.md, "Errors"): the count's flag, the report and the receiver's choice ---

def _bad_id(e, num_experts):
    """EpBadExpertId: outside [-1, num_experts) (-1 is "no expert", any other id outside counts too)."""
    return e < -1 or e >= num_experts


def test_input_error_flag_is_not_part_of_any_call_format():
    """The flag a rank with bad ids sets in the format of every count it announces is a bit no
    format uses (row size, dtype, index type, quantisation, split), it fits the 32-bit format word
    of the InterNode and V1 count signals, and EpCallFormat (what readers compare) drops only it."""
    t = _testing()
    flag, split = t.EP_DISPATCH_FORMAT_INPUT_ERROR, t.EP_DISPATCH_FORMAT_SPLIT
    assert flag < 2**32 and flag & split == 0
    for row in (16, 4096, 14336, 16 << 20):
        for dtype in range(5):
            for index in (0, 1):
                for quant in range(4):
                    f = t.ep_dispatch_format(row, dtype, index, quant)
                    for fmt in (f, f | split):
                        assert fmt & flag == 0 and fmt < 2**32, (row, dtype, index, quant)
                        assert t.ep_call_format(fmt | flag) == fmt and t.ep_call_format(fmt) == fmt


def test_input_error_report_round_trips():
    """EpPackInputError holds any rank, token and top-k slot of a config and the id (saturated to
    int32), with bit 63 set so that a report is never 0 (0: none)."""
    t = _testing()
    rnd = random.Random(5)
    cases = [(0, 0, 0, -2), (31, 65535, 63, 2**31 - 1), (5, 17, 3, -(2**31))]
    cases += [(rnd.randrange(32), rnd.randrange(65536), rnd.randrange(64), rnd.randrange(-2**31, 2**31))
              for _ in range(2000)]
    for pe, token, k, v in cases:
        w = t.ep_pack_input_error(pe, token, k, v)
        assert w >> 63 == 1 and t.ep_unpack_input_error(w) == (pe, token, k, v)
    for v, clipped in ((2**40, 2**31 - 1), (-(2**40), -(2**31))):
        assert t.ep_unpack_input_error(t.ep_pack_input_error(1, 2, 3, v)) == (1, 2, 3, clipped)


def test_ready_value_copying_bit_is_not_part_of_the_format():
    """The combine's ready value (layout.hpp): a PE that copies its input beside the combine sets
    the "copying" bit, its peers gate their reads on it; PEs mixing inputs in one call (zero-copy,
    copied first, copied beside) must still agree on the format, and an InterNode landing word
    must not depend on it."""
    t = _testing()
    for tokens, weights, dtype, row, wire in [(1, 1, 0, 14336, 0), (2, 0, 3, 4096, 0), (3, 1, 0, 7168, 1),
                                              (1, 2, 7, 16 << 20, 2)]:
        plain = t.ep_pack_ready(tokens, weights, dtype, row, wire, False)
        copying = t.ep_pack_ready(tokens, weights, dtype, row, wire, True)
        assert plain != copying
        assert t.ep_ready_copying(copying) and not t.ep_ready_copying(plain)
        assert t.ep_ready_format(copying) == t.ep_ready_format(plain)
        assert t.ep_ready_sources(copying) == t.ep_ready_sources(plain) == (tokens, weights)
        for w in (False, True):
            assert t.ep_landing_value(copying, w) == t.ep_landing_value(plain, w)
        # what the format does compare: dtype, wire, row bytes
        assert t.ep_ready_format(t.ep_pack_ready(tokens, weights, (dtype + 1) % 16, row, wire, True)) != \
            t.ep_ready_format(plain)
        assert t.ep_ready_format(t.ep_pack_ready(tokens, weights, dtype, row + 16, wire, True)) != \
            t.ep_ready_format(plain)
        assert t.ep_ready_format(t.ep_pack_ready(tokens, weights, dtype, row, (wire + 1) % 3, False)) != \
            t.ep_ready_format(plain)


def test_combine_copy_chunk_tags_cover_the_receive_buffer():
    """combineRowsReady holds one tag per kEpCombineCopyRows rows of a source's receive buffer."""
    t = _testing()
    R = t.EP_COMBINE_COPY_ROWS
    for rmax in (1, R - 1, R, R + 1, 4096, 32768, 32769):
        n = t.ep_combine_copy_chunks(rmax)
        assert (n - 1) * R < rmax <= n * R


def test_every_rank_records_the_same_report():
    """What the kernels compute, modelled: each announcing block (every leader, each with its own
    scan of all T x K ids) keeps the smallest key token * K + slot of a bad id, so every count a
    rank announces carries the same report; every receiver takes the lowest flagging source of
    its W counts (warp 0's ballot, lowest lane = popcount((m & -m) - 1)); so every rank records
    the same report, that of the lowest rank with a bad id, its first bad id in (token, slot)
    order."""
    rnd = random.Random(11)
    for _ in range(300):
        W, K, Epr = rnd.randint(1, 32), rnd.randint(1, 9), rnd.randint(1, 4)
        E = W * Epr
        ids = {}
        for s in range(W):
            T = rnd.randint(0, 40)
            rows = [[rnd.randint(-1, E - 1) for _ in range(K)] for _ in range(T)]
            if T and rnd.random() < 0.3:
                for _ in range(rnd.randint(1, 3)):
                    rows[rnd.randrange(T)][rnd.randrange(K)] = rnd.choice([-2, -7, E, E + 5, 2**31 - 1])
            ids[s] = rows
        reports = {}
        for s, rows in ids.items():
            keys = {t * K + k for t, row in enumerate(rows) for k, e in enumerate(row) if _bad_id(e, E)}
            leaders = {min(keys) if keys else None for _dest in range(W)}  # one scan per leader
            assert len(leaders) == 1
            key = leaders.pop()
            if key is not None:
                t, k = divmod(key, K)
                reports[s] = (s, t, k, rows[t][k])
        recorded = set()
        for _dest in range(W):
            mask = sum(1 << s for s in reports)  # the ballot of the flagged counts
            if mask == 0:
                recorded.add(None)
                continue
            first = popcount((mask & -mask) - 1)
            recorded.add(reports[first])
        assert len(recorded) == 1
        want = None
        for s in range(W):
            bad = [(t, k, e) for t, row in enumerate(ids[s]) for k, e in enumerate(row) if _bad_id(e, E)]
            if bad:
                t, k, e = min(bad)
                want = (s, t, k, e)
                break
        assert recorded.pop() == want
