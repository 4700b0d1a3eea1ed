"""Fixtures: a prefill instance in a child process (forked from a fork server that imported
vLLM once, before any thread of this process existed) and a decode instance in this process, both with vLLM's real scheduler of the class the
test is parametrised with."""

import multiprocessing
import os
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import instance  # noqa: E402

from kvpipe.vllm import request_id  # noqa: E402

SCHEDULERS = ["Scheduler", "AsyncScheduler"]


class PrefillProcess:
    """The prefill instance's process, one command at a time over a pipe."""

    def __init__(self, async_scheduling: bool, config: dict):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["instance"])
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=instance.serve, args=(child, async_scheduling, config), daemon=True)
        self.proc.start()
        assert self._recv(60)[0] == "ready"

    def _recv(self, timeout=30.0):
        if not self.conn.poll(timeout):
            raise AssertionError("the prefill process did not answer in time")
        return self.conn.recv()

    def call(self, cmd, arg=None, timeout=30.0):
        self.conn.send((cmd, arg))
        status, value = self._recv(timeout)
        assert status == "ok", value
        return value

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("close", timeout=15)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


class Pair:
    """A prefill process and a decode instance, and the requests sent to both."""

    def __init__(self, async_scheduling: bool, prefill_config: dict, decode_config: dict):
        self.prefill = PrefillProcess(async_scheduling, prefill_config)
        self.decode = instance.Instance("decode", async_scheduling, **decode_config)
        self.decode.on_schedule = self._check_scheduled
        self.remote = {}  # decode req id -> prompt length, for requests whose KV comes by kvpipe
        self.recomputed = set()  # requests the decode side scheduled from token 0 (recompute)
        self.loaded = set()  # requests the decode side scheduled after their KV arrived

    @staticmethod
    def new_id() -> str:
        return f"cmpl-{uuid.uuid4().hex}-0"

    def add_decode(self, rid: str, prompt: int, max_tokens: int = 3, kv_id: int | None = None):
        self.decode.add(rid, request_id(rid) if kv_id is None else kv_id, prompt, max_tokens,
                        {"do_remote_prefill": True, "kvpipe_prefill_engine": instance.PREFILL_ENGINE})
        self.remote[rid] = prompt

    def prefill_args(self, rid: str, prompt: int, kv_id: int | None = None):
        return (rid, request_id(rid) if kv_id is None else kv_id, prompt, 1,
                {"do_remote_decode": True, "kvpipe_decode": self.decode.address, "kvpipe_decode_tp": 1})

    def add_prefill(self, *reqs):
        self.prefill.call("add", [self.prefill_args(*req) for req in reqs])

    def _check_scheduled(self, so):
        """Called between the decode scheduler's schedule() and the forward pass: a request whose
        KV comes by kvpipe is scheduled only with all of it in place (or from token 0)."""
        for new in so.scheduled_new_reqs:
            if new.req_id not in self.remote:
                continue
            if new.num_computed_tokens == 0:
                self.recomputed.add(new.req_id)
                continue
            prompt = self.remote[new.req_id]
            assert new.num_computed_tokens == prompt - 1, (new.req_id, new.num_computed_tokens)
            assert self.decode.kv_matches(new.req_id, prompt), f"{new.req_id} scheduled before its KV arrived"
            self.loaded.add(new.req_id)

    def status(self, rid: str):
        req = self.decode.scheduler.requests.get(rid)
        return None if req is None else req.status.name

    def pump(self, done, timeout=30.0, prefill=True):
        """Steps both instances until ``done()``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if prefill:
                self.prefill.call("step")
            self.decode.step()
            if done():
                return
            time.sleep(0.002)
        raise AssertionError(f"the instances did not get there in time: decode {self.describe()}")

    def describe(self):
        return {"status": {rid: self.status(rid) for rid in self.remote}, "loaded": sorted(self.loaded),
                "recomputed": sorted(self.recomputed), "held": self.decode.held(),
                "prefill": self.prefill.call("state") if self.prefill.proc.is_alive() else "gone"}

    def settle(self, timeout=30.0):
        """Runs both instances until neither holds a request or a block."""
        assert self.prefill.call("run_until_idle", timeout, timeout=timeout + 10), self.prefill.call("state")
        deadline = time.monotonic() + timeout
        while not self.decode.idle() and time.monotonic() < deadline:
            self.decode.step()
            time.sleep(0.002)
        self.decode.flush()
        assert self.decode.idle(), (sorted(self.decode.scheduler.requests), self.decode.free_blocks())

    def close(self):
        self.prefill.close()
        self.decode.worker.shutdown()


@pytest.fixture(params=SCHEDULERS)
def make_pair(request):
    pairs = []

    def make(prefill_config=None, decode_config=None):
        pair = Pair(request.param == "AsyncScheduler", prefill_config or {}, decode_config or {})
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()
