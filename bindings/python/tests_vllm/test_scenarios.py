"""The kvpipe vLLM connector against vLLM 0.25's real Scheduler and AsyncScheduler: a prefill
instance (child process) and a decode instance (this process), KV in CPU tensors moved over
kvpipe's TCP transport and checked byte for byte. Every test runs with both scheduler classes.
"""

import time

import pytest
from conftest import Pair

import instance
from instance import BLOCK


def assert_nothing_held(pair: Pair, prefill=True):
    """No kvpipe transfer left open on either side, nothing refused or left unquiesced."""
    assert pair.decode.held() == {"sending": 0, "receiving": 0}
    assert pair.decode.counters()["receiver"]["writes_refused"] == 0
    if prefill:
        state = pair.prefill.call("state")
        assert state["held"] == {"sending": 0, "receiving": 0}


def test_chunked_prefill_streams_each_chunk_before_prefill_ends(make_pair):
    pair = make_pair()
    rid, prompt = Pair.new_id(), 100  # 7 blocks; 32-token chunks: 32, 32, 32, 4
    pair.add_decode(rid, prompt)
    pair.pump(lambda: pair.status(rid) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((rid, prompt))
    landed_early = []
    while True:
        chunks = pair.prefill.call("step")["chunks"]
        if rid not in chunks:
            continue
        start, end = chunks[rid]
        if end == prompt:
            break
        # This chunk's completed blocks arrive while prefill still runs (no further prefill step).
        full = end // BLOCK * BLOCK
        pair.pump(lambda: pair.decode.kv_matches(rid, full), timeout=10, prefill=False)
        assert pair.status(rid) == "WAITING_FOR_REMOTE_KVS"
        landed_early.append(full)
    assert landed_early == [32, 64, 96]
    pair.pump(lambda: rid in pair.loaded)
    pair.settle()
    assert rid not in pair.recomputed
    assert_nothing_held(pair)


def test_decode_never_schedules_a_request_whose_kv_has_not_arrived(make_pair):
    pair = make_pair()
    reqs = [(Pair.new_id(), n) for n in (70, 33, 16)]
    for rid, prompt in reqs:
        pair.add_decode(rid, prompt)
    # Prefill has not started: many decode steps, nothing scheduled.
    for _ in range(30):
        so = pair.decode.step()
        assert so.total_num_scheduled_tokens == 0
    pair.add_prefill(*reqs)
    pair.prefill.call("step")  # one 32-token chunk: part of the first request only
    for _ in range(30):
        so = pair.decode.step()
        assert so.total_num_scheduled_tokens == 0
        time.sleep(0.005)
    assert all(pair.status(rid) == "WAITING_FOR_REMOTE_KVS" for rid, _ in reqs)
    # The rest of prefill: each request is scheduled only with all of its KV in place (checked
    # between schedule() and the forward pass of every decode step).
    pair.pump(lambda: pair.loaded == {rid for rid, _ in reqs})
    pair.settle()
    assert not pair.recomputed
    assert_nothing_held(pair)


def test_blocks_are_freed_on_both_sides_only_after_quiesce(make_pair):
    pair = make_pair()
    rid, prompt = Pair.new_id(), 80
    pair.add_prefill((rid, prompt))  # the decode side has not registered yet
    for _ in range(40):  # prefill ends (max_tokens=1) but the transfer waits for the registration
        state = pair.prefill.call("step")
    state = pair.prefill.call("state")
    assert state["requests"] == [rid]  # finished, its blocks held by the connector
    assert state["free"] == state["total"] - -(-prompt // BLOCK)
    assert state["held"]["sending"] == 1
    pair.add_decode(rid, prompt)
    pair.pump(lambda: rid in pair.loaded)
    # The decode side holds the blocks it generates from; the prefill side frees once quiesced.
    pair.settle()
    assert_nothing_held(pair)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_mid_transfer_frees_everything(make_pair, side):
    pair = make_pair()
    rid, prompt = Pair.new_id(), 120
    other = Pair.new_id()  # a healthy request alongside
    pair.add_decode(rid, prompt)
    pair.add_decode(other, 40)
    pair.pump(lambda: pair.status(rid) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((rid, prompt), (other, 40))
    pair.prefill.call("step")
    pair.pump(lambda: pair.decode.kv_matches(rid, 32), timeout=10, prefill=False)
    if side == "prefill":
        pair.prefill.call("abort", rid)
        # The decode side learns at once and recomputes the request.
        pair.pump(lambda: rid in pair.recomputed, timeout=20)
    else:
        free_before = pair.decode.free_blocks()
        pair.decode.abort(rid)
        assert pair.decode.free_blocks() == free_before  # held until kvpipe quiesced
        pair.pump(lambda: rid not in pair.decode.scheduler.requests, timeout=20, prefill=False)
    pair.pump(lambda: other in pair.loaded)
    pair.settle()
    assert rid not in pair.loaded
    assert_nothing_held(pair)
    # A chunk refused because its request ended (the race an abort starts) is routine: the
    # prefill instance logs it below WARNING.
    assert pair.prefill.call("warnings") == []


def test_a_prefill_abort_before_the_first_chunk_reaches_decode_at_once(make_pair):
    pair = make_pair()
    # A first request connects the prefill rank to the decode rank.
    warm = Pair.new_id()
    pair.add_decode(warm, 40)
    pair.pump(lambda: pair.status(warm) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((warm, 40))
    pair.pump(lambda: warm in pair.loaded)
    rid, prompt = Pair.new_id(), 120
    pair.add_decode(rid, prompt)
    pair.pump(lambda: pair.status(rid) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((rid, prompt))
    pair.prefill.call("abort", rid)  # before its first step: no chunk of it was computed
    start = time.monotonic()
    # The decode side hears the cancel and recomputes (not after the 60 s registration deadline).
    pair.pump(lambda: rid in pair.recomputed, timeout=20)
    assert time.monotonic() - start < 10
    pair.settle()
    assert rid not in pair.loaded
    assert_nothing_held(pair)


def test_malformed_transfer_params_cost_only_their_own_request(make_pair):
    # kv_transfer_params come from the client's request body: a bad value must not stop the
    # engine (vLLM has no per-request exception handling around the connector's hooks).
    pair = make_pair()
    malformed = []
    for key, value in [("kvpipe_request", "abc"), ("kvpipe_request", -1), ("kvpipe_request", 2**64),
                       ("kvpipe_decode", "localhost"), ("kvpipe_decode", "127.0.0.1:http"),
                       ("kvpipe_decode_tp", 0), ("kvpipe_decode_tp", 3)]:
        rid, kv_id, prompt, max_tokens, params = pair.prefill_args(Pair.new_id(), 40)
        pair.prefill.call("add", [(rid, kv_id, prompt, max_tokens, dict(params, **{key: value}))])
        malformed.append(rid)
    bad = Pair.new_id()
    pair.decode.add(bad, 7, 40, 3, {"do_remote_prefill": True, "kvpipe_prefill_engine": instance.PREFILL_ENGINE,
                                    "kvpipe_request": "abc"})
    pair.remote[bad] = 40
    # The decode side computes that prompt itself.
    pair.pump(lambda: bad in pair.recomputed, timeout=20)
    pair.settle()
    # Both instances still serve: a well-formed request moves its KV.
    ok = Pair.new_id()
    pair.add_decode(ok, 40)
    pair.pump(lambda: pair.status(ok) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((ok, 40))
    pair.pump(lambda: ok in pair.loaded)
    pair.settle()
    assert_nothing_held(pair)
    # Each malformed request is named in a warning of the prefill instance.
    warned = pair.prefill.call("warnings")
    assert all(any(rid in w for w in warned) for rid in malformed), warned


def test_a_lost_prefill_instance_takes_the_recompute_path(make_pair):
    pair = make_pair()
    rid, prompt = Pair.new_id(), 120
    pair.add_decode(rid, prompt)
    pair.pump(lambda: pair.status(rid) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((rid, prompt))
    pair.prefill.call("step")
    pair.pump(lambda: pair.decode.kv_matches(rid, 32), timeout=10, prefill=False)
    pair.prefill.kill()
    # The transfer fails, its blocks are reported as load errors, the scheduler recomputes.
    pair.pump(lambda: rid in pair.recomputed, timeout=20, prefill=False)
    pair.pump(lambda: rid not in pair.decode.scheduler.requests, timeout=20, prefill=False)
    pair.decode.flush()
    assert pair.decode.idle()
    assert rid not in pair.loaded
    assert_nothing_held(pair, prefill=False)


def test_a_thousand_requests_with_vllm_string_ids(make_pair):
    n = 1000
    pair = make_pair(prefill_config={"num_blocks": 1024, "max_batched": 512, "max_seqs": 64},
                     decode_config={"num_blocks": 4400, "max_batched": 512, "max_seqs": 256})
    reqs = [(Pair.new_id(), 17 + (i * 7) % 48) for i in range(n)]
    for rid, prompt in reqs:
        pair.add_decode(rid, prompt, max_tokens=2)
    pair.add_prefill(*reqs)
    pair.pump(lambda: len(pair.loaded) == n, timeout=240)
    pair.settle(timeout=60)
    assert not pair.recomputed
    assert_nothing_held(pair)


def test_two_prefill_tensor_ranks_write_one_decode_rank_holding_both_heads(make_pair):
    # Heterogeneous tensor parallelism: the prefill instance has two tensor ranks (one KV head
    # each, two kvpipe senders, their outputs merged by vLLM's KVOutputAggregator); the decode
    # rank holds both heads and registers with both prefill ranks as writers.
    pair = make_pair(prefill_config={"tp": 2})
    reqs = [(Pair.new_id(), n) for n in (90, 17)]
    for rid, prompt in reqs:
        pair.add_decode(rid, prompt)
    pair.add_prefill(*reqs)
    pair.pump(lambda: pair.loaded == {rid for rid, _ in reqs})
    pair.settle()
    assert not pair.recomputed
    assert_nothing_held(pair)


def test_two_live_requests_with_one_kvpipe_id_never_mix(make_pair):
    # Two vLLM requests whose ids hash to one kvpipe id (forced here): the first moves, the
    # second is refused on both sides and the decode side recomputes it; nothing leaks.
    pair = make_pair()
    first, second, shared = Pair.new_id(), Pair.new_id(), 0xDEADBEEF_00000001
    pair.add_decode(first, 50, kv_id=shared)
    pair.pump(lambda: pair.status(first) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_decode(second, 40, kv_id=shared)
    pair.add_prefill((first, 50, shared), (second, 40, shared))
    pair.pump(lambda: first in pair.loaded and second in pair.recomputed)
    pair.settle()
    assert second not in pair.loaded
    assert_nothing_held(pair)


def test_a_prefill_request_preempted_mid_transfer_is_recomputed_by_decode(make_pair):
    # Ten usable prefill blocks, two 100-token prompts (7 blocks each) prefilled 32 tokens a
    # step side by side (vLLM's reservation of a whole prompt's blocks at admission, which
    # avoids this, turned off): one is preempted when the other needs its blocks. Its transfer
    # is cancelled and quiesced before the next forward pass (handle_preemptions); the decode
    # side recomputes it, the other request moves whole.
    pair = make_pair(prefill_config={"num_blocks": 11, "max_batched": 64, "long_prefill": 32,
                                                     "reserve_full_prompt": False})
    first, second = Pair.new_id(), Pair.new_id()
    pair.add_decode(first, 100)
    pair.add_decode(second, 100)
    pair.pump(lambda: pair.status(second) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((first, 100), (second, 100))
    preempted = set()
    deadline = time.monotonic() + 30
    while not preempted and time.monotonic() < deadline:
        preempted |= set(pair.prefill.call("step")["preempted"])
        pair.decode.step()
    assert preempted <= {first, second}  # (AsyncScheduler may preempt both)
    others = {first, second} - preempted
    pair.pump(lambda: others <= pair.loaded and preempted <= pair.recomputed)
    pair.settle()
    assert not preempted & pair.loaded
    assert_nothing_held(pair)


def test_layer_wise_prefill_pushes_each_layer_before_the_next_is_computed(make_pair):
    # kvpipe_layers_per_slice 1: each layer of a chunk goes out from save_kv_layer, as a slice
    # of its own, before the "model" computes the next layer.
    pair = make_pair(prefill_config={"layer_wise": True, "extra": {"kvpipe_layers_per_slice": 1}})
    rid, prompt = Pair.new_id(), 100  # 32-token chunks: 32, 32, 32, 4
    pair.add_decode(rid, prompt)
    pair.pump(lambda: pair.status(rid) == "WAITING_FOR_REMOTE_KVS", prefill=False)
    pair.add_prefill((rid, prompt))
    steps = []
    while True:
        r = pair.prefill.call("step")
        if rid not in r["chunks"]:
            continue
        steps.append(r["layer_slices"])
        start, end = r["chunks"][rid]
        if end == prompt:
            break
        full = end // BLOCK * BLOCK
        pair.pump(lambda: pair.decode.kv_matches(rid, full), timeout=10, prefill=False)
        assert pair.status(rid) == "WAITING_FOR_REMOTE_KVS"
    assert len(steps) == 4
    for before, after_layer_0, after_layer_1 in steps:
        assert after_layer_0 == before + 1, steps  # layer 0's range left before layer 1 was computed
        assert after_layer_1 == after_layer_0 + 1, steps
    pair.pump(lambda: rid in pair.loaded)
    pair.settle()
    assert rid not in pair.recomputed
    assert_nothing_held(pair)


def test_layer_wise_pushing_refuses_a_negative_slice_size():
    with pytest.raises(ValueError, match="kvpipe_layers_per_slice is -1"):
        instance.Instance("decode", False, extra={"kvpipe_layers_per_slice": -1})
