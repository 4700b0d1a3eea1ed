"""Tensor-parallel ranks: two prefill ranks, one KV head each, write one decode rank holding
both heads over TCP; and a rank's place is checked when its node is made."""

import time

import numpy as np
import pytest

import kvpipe

LAYERS, HEADS, DIM, ELEM, TPB = 2, 2, 8, 2, 4
# One head's K or V of one layer of one block: tokens per block × head dim × element bytes.
PLANE = TPB * DIM * ELEM
PROMPT = 22  # 6 blocks, the last one partly filled
BLOCKS = -(-PROMPT // TPB)
REQUEST = 41


def group(region, kv_heads, first_head):
    slot = 2 * kv_heads * PLANE * LAYERS
    return kvpipe.LayerGroup(
        layers=LAYERS, kv_heads=kv_heads, head_dim=DIM, elem_bytes=ELEM, tokens_per_block=TPB,
        pools=[kvpipe.Pool(region=region, layers=LAYERS, slot_bytes=slot)],
        model_kv_heads=HEADS, first_head=first_head,
    )


def events_until(nodes, done, timeout=20.0):
    """Polls every node until ``done(seen)``; ``seen`` maps each node's index to its events."""
    seen = {i: [] for i in range(len(nodes))}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, node in enumerate(nodes):
            e = node.next_event(0.01)
            if e is not None:
                seen[i].append(e)
        if done(seen):
            return seen
    raise AssertionError(f"timed out; saw {seen}")


def kinds(events):
    return [e.kind for e in events]


def test_two_tensor_parallel_ranks_write_one_receiver_holding_both_heads():
    # The decode rank holds both heads: slot bytes [layer][K|V][head][token][dim].
    slots = BLOCKS + 3
    dst = np.zeros((slots, 2 * HEADS * PLANE * LAYERS), dtype=np.uint8)
    rx = kvpipe.Receiver.tcp([group(9, HEADS, 0)], {9: dst})
    port = rx.listen("127.0.0.1:0")

    # Each prefill rank holds one head, in its own slots, with its own content.
    rng = np.random.default_rng(7)
    srcs, txs, peers = [], [], []
    for rank in range(2):
        src = rng.integers(0, 256, (BLOCKS + 2, 2 * PLANE * LAYERS), dtype=np.uint8)
        tx = kvpipe.Sender.tcp([group(1, 1, rank)], {1: src}, tp_size=2, tp_rank=rank,
                               connections=1)
        peers.append(tx.connect(f"127.0.0.1:{port}"))
        srcs.append(src)
        txs.append(tx)
    nodes = [rx, *txs]
    seen = events_until(
        nodes, lambda s: all("peer_ready" in kinds(s[i]) for i in range(3))
        and sum(k == "peer_ready" for k in kinds(s[0])) == 2
    )
    for i in range(3):
        rejected = [e for e in seen[i] if e.kind == "peer_rejected"]
        assert not rejected, rejected[0].message
    writers = [e.peer for e in seen[0] if e.kind == "peer_ready"]
    assert len(set(writers)) == 2

    # The receiver's blocks land in slots 3.. (ordinal o in slot 3 + o); the senders' blocks
    # sit in their slots 1 + o (rank 0) and 2 + o (rank 1).
    dst_ids = [3 + o for o in range(BLOCKS)]
    assert dst_ids[-1] < slots
    rx.register(REQUEST, PROMPT, [(0, dst_ids)], writers)
    src_ids = [[1 + rank + o for o in range(BLOCKS)] for rank in range(2)]
    for rank, tx in enumerate(txs):
        tx.open_request(REQUEST, [peers[rank]])
    for start in range(0, PROMPT, 8):
        end = min(start + 8, PROMPT)
        for rank, tx in enumerate(txs):
            tx.submit_chunk(REQUEST, start, end, PROMPT, [src_ids[rank]])
    for tx in txs:
        tx.submit_aux(REQUEST, [5], prompt_tokens=PROMPT)

    def finished(s):
        return all(kinds(s[i]).count("quiesced") >= 1 for i in range(3))

    seen = events_until(nodes, finished)
    for i in range(3):
        assert "completed" in kinds(seen[i]), (i, [e.message for e in seen[i]])
        assert not {"failed", "timed_out", "cancelled"} & set(kinds(seen[i])), seen[i]
    done = next(e for e in seen[0] if e.kind == "completed")
    assert done.first_tokens == [5]
    assert done.bytes_written == BLOCKS * dst.shape[1]
    for rank in (1, 2):
        sent = next(e for e in seen[rank] if e.kind == "completed")
        assert sent.bytes_written == BLOCKS * srcs[rank - 1].shape[1]

    # Every byte: head h of (layer, K|V) of block o is rank h's plane from its slot.
    expected = np.zeros_like(dst)
    for o in range(BLOCKS):
        for rank in range(2):
            planes = srcs[rank][src_ids[rank][o]].reshape(LAYERS * 2, PLANE)
            out = expected[dst_ids[o]].reshape(LAYERS * 2, HEADS, PLANE)
            out[:, rank, :] = planes
    assert np.array_equal(dst, expected)
    assert rx.counters()["writes_refused"] == 0
    assert rx.counters()["bytes_landed"] == BLOCKS * dst.shape[1]

    rx.retire(REQUEST)
    for tx in txs:
        tx.retire(REQUEST)
        tx.close()
    rx.close()


def test_a_rank_whose_heads_do_not_match_its_topology_is_refused_when_made():
    src = np.zeros((4, 2 * PLANE * LAYERS), dtype=np.uint8)
    # The user's mistake: one head of two, but no topology (rank 0 of 1 holds both heads).
    with pytest.raises(ValueError, match=r"layer group 0: tensor-parallel rank 0 of 1 holds KV "
                       r"heads 0\.\.\+2, but its layout says 1\.\.\+1"):
        kvpipe.Sender.tcp([group(1, 1, 1)], {1: src})
    # Rank 0 of 2 holds head 0, not head 1.
    with pytest.raises(ValueError, match="rank 0 of 2 holds KV heads 0..\\+1"):
        kvpipe.Sender.tcp([group(1, 1, 1)], {1: src}, tp_size=2, tp_rank=0)
    kvpipe.Sender.tcp([group(1, 1, 1)], {1: src}, tp_size=2, tp_rank=1).close()


@pytest.mark.parametrize(
    "place, message",
    [
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank must be between 0 and tp_size - 1 = 1, got 2"),
        ({"tp_size": 0}, "tp_size must be between 1 and 65535 .*got 0"),
        ({"tp_size": -1}, "tp_size must be between 1 and 65535 .*got -1"),
        ({"tp_size": 70000}, "tp_size must be between 1 and 65535 .*got 70000"),
        ({"tp_rank": -1}, "tp_rank must be between 0 and tp_size - 1 = 0, got -1"),
        ({"pp_size": 0}, "pp_size must be between 1 and 65535 .*got 0"),
        ({"pp_size": 4, "pp_rank": 4}, "pp_rank must be between 0 and pp_size - 1 = 3, got 4"),
    ],
)
def test_a_bad_topology_is_refused(place, message):
    src = np.zeros((4, 2 * HEADS * PLANE * LAYERS), dtype=np.uint8)
    whole = [group(1, HEADS, 0)]
    with pytest.raises(ValueError, match=message):
        kvpipe.Sender.tcp(whole, {1: src}, **place)
    with pytest.raises(ValueError, match=message):
        kvpipe.Receiver.tcp(whole, {1: src}, **place)


def test_a_pipeline_rank_holding_the_second_layer_shakes_hands_with_a_whole_sender():
    # Decode pipeline rank 1 of 2 holds layer 1 of the group's two layers.
    half = kvpipe.LayerGroup(
        layers=1, kv_heads=HEADS, head_dim=DIM, elem_bytes=ELEM, tokens_per_block=TPB,
        pools=[kvpipe.Pool(region=9, layers=1, slot_bytes=2 * HEADS * PLANE)],
        model_layers=LAYERS, first_layer=1,
    )
    dst = np.zeros((4, 2 * HEADS * PLANE), dtype=np.uint8)
    src = np.zeros((4, 2 * HEADS * PLANE * LAYERS), dtype=np.uint8)
    with kvpipe.Receiver.tcp([half], {9: dst}, pp_size=2, pp_rank=1) as rx:
        port = rx.listen("127.0.0.1:0")
        with kvpipe.Sender.tcp([group(1, HEADS, 0)], {1: src}, connections=1) as tx:
            tx.connect(f"127.0.0.1:{port}")
            seen = events_until(
                [rx, tx], lambda s: all({"peer_ready", "peer_rejected"} & set(kinds(s[i]))
                                        for i in (0, 1))
            )
            assert [kinds(seen[i]) for i in (0, 1)] == [["peer_ready"], ["peer_ready"]], [
                e.message for e in seen[0] + seen[1]
            ]


def test_rank_heads_and_tensor_writers_follow_the_core_rule():
    assert kvpipe.rank_heads(8, 2, 1) == (4, 4)
    assert kvpipe.rank_heads(2, 8, 5) == (1, 1)  # four replicas of each head
    with pytest.raises(ValueError, match="cannot be split"):
        kvpipe.rank_heads(6, 4, 0)
    # A group of no ranks is refused, on either side of a writer question too.
    for call in (lambda: kvpipe.rank_heads(2, 0, 0), lambda: kvpipe.tensor_writes_to(2, 0, 0, 1, 0),
                 lambda: kvpipe.tensor_writes_to(2, 1, 0, 0, 0)):
        with pytest.raises(ValueError, match="tp_size must be at least 1"):
            call()
    # 8 heads, prefill TP 8 -> decode TP 2: ranks 0..3 write decode rank 0, 4..7 rank 1.
    writers = [[s for s in range(8) if kvpipe.tensor_writes_to(8, 8, s, 2, d)] for d in range(2)]
    assert writers == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 2 heads on 4 prefill ranks (each head twice) -> 4 decode ranks: one replica each.
    writers = [[s for s in range(4) if kvpipe.tensor_writes_to(2, 4, s, 4, d)] for d in range(4)]
    assert writers == [[0], [1], [2], [3]]
