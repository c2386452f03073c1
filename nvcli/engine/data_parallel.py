"""Data parallelism: N engine replicas behind one front end that implements the Engine protocol, so the job machinery,
the offline API and the dashboard drive N replicas as they drive one engine.

The front end owns what must stay single: admission (a bad request gets its error at once, as from one engine), the
tokenizer and token texts, and the order of requests (arrival, or with `--scheduling-policy priority` each request's
priority, then arrival; each replica's scheduler orders what it holds the same way). A request goes to a replica when
one has room (router.py: the fewest outstanding tokens, prefix affinity), never by a static split, so a fast replica
takes more. Replicas run their own loops; the front end's `step` waits for what any of them finished.

Faults. A replica that dies (killed, CUDA error, out of memory) has its outstanding requests given back to the front of
the queue and served by the others: every request still gets exactly one output, and none fails because a replica
died. Only when every replica is gone does `step` raise. A replica that fails to start fails the whole engine at once
with its error; the others are stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from nvcli.config import ConfigError, EngineConfig
from nvcli.engine.admission import Admission, resolve_config
from nvcli.engine.protocol import EngineStats
from nvcli.engine.replica import ProcessReplica, ReplicaInfo
from nvcli.engine.router import DEFAULT_OUTPUT_GUESS, Router, prefix_keys
from nvcli.engine.text import TextSide, eos_token_ids, reasoning_markers
from nvcli.engine.waiting_queue import PriorityQueue, waiting_queue
from nvcli.outputs import CompletionOutput, RequestOutput
from nvcli.sampling_params import SamplingParams

log = logging.getLogger("nvcli")

STOP_TIMEOUT_S = 30.0  # a replica's engine shutdown, before it is killed
STEP_WAIT_S = 0.05  # step() waits this long for a replica's message


class ReplicaHandle(Protocol):
    index: int

    @property
    def pid(self) -> int | None: ...

    def send(self, msgs: list[tuple]) -> bool: ...

    def stop(self, timeout: float) -> None: ...

    def kill(self) -> None: ...


@dataclass
class _Pending:
    order: int  # arrival: re-queued requests go back in this order
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cost: int
    keys: list[int]
    replica: int | None = None
    priority: int = 0  # --scheduling-policy priority: lower leaves the queue first


class DataParallelEngine(TextSide):
    def __init__(self, config: EngineConfig) -> None:
        from nvcli.models.model_config import load_model_config
        from nvcli.models.resolve import resolve_model
        from nvcli.models.tokenizer import load_tokenizer

        n = config.data_parallel_size
        self.model_dir = resolve_model(config.model, config.load_format)
        self.model_config = load_model_config(self.model_dir)
        resolve_config(config, self.model_config)  # its errors now, before any replica starts
        replica_config = dataclasses.replace(config, data_parallel_size=1, data_parallel_backend="mp",
                                             ray_address=None)
        if config.data_parallel_backend == "mp" and config.resolved_device() == "cpu" and config.cpu_threads is None:
            replica_config.cpu_threads = max(1, len(os.sched_getaffinity(0)) // n)  # the cores, shared out
        self._events: queue.Queue[tuple[int, tuple]] = queue.Queue()
        self.replicas: list[ReplicaHandle] = []
        self._lock = threading.Lock()
        self._stopped = False
        try:
            self.replicas = _start_replicas(config, replica_config, self._events)
            self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)  # while the replicas load
            infos = self._wait_ready()
        except BaseException:
            self._stopped = True
            for r in self.replicas:  # a replica still loading reads no message: no graceful stop
                r.kill()
            raise
        self.infos = infos
        self.max_model_len = min(info.max_model_len for info in infos)
        self.config = dataclasses.replace(infos[0].config, max_model_len=self.max_model_len, data_parallel_size=n,
                                          data_parallel_backend=config.data_parallel_backend,
                                          ray_address=config.ray_address)
        markers = reasoning_markers(self.tokenizer, config.reasoning_parser)
        self.admission = Admission(self.config, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                   eos_token_ids(self.model_dir, self.model_config, self.tokenizer), markers)
        assert self.config.kvcache_block_size is not None  # EngineConfig fills it in
        self.router = Router(n, window=max(2, self.config.max_num_seqs * 3 // 2),
                             block_size=self.config.kvcache_block_size)
        # fcfs: a deque in arrival order; priority: a heap by (priority, arrival) (waiting_queue.py)
        self._queue: deque[_Pending] | PriorityQueue[_Pending] = waiting_queue(
            self.config.scheduling_policy, attrgetter("priority", "order"))
        self._outstanding: dict[str, _Pending] = {}
        self._ready: list[RequestOutput] = []  # outputs made here (aborts of queued requests)
        self._aborted: set[str] = set()
        self._stats: list[EngineStats | None] = [None] * n
        self._arrivals = 0
        self.num_requeued = 0  # requests given back by a replica that died
        self.lost: dict[int, str] = {}  # replica index -> why it is gone

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> list[ReplicaInfo]:
        infos: dict[int, ReplicaInfo] = {}
        while len(infos) < len(self.replicas):
            i, msg = self._events.get()
            if msg[0] == "ready":
                infos[i] = msg[1]
            elif msg[0] == "failed":
                error, tb = msg[1], msg[2]
                log.debug("replica %d failed to start:\n%s", i, tb)
                raise _with_replica(error, i, len(self.replicas))
            elif msg[0] in ("lost", "dead"):
                raise RuntimeError(f"data-parallel replica {i} of {len(self.replicas)} failed to start: "
                                   f"{msg[1].splitlines()[0]}")
        return [infos[i] for i in range(len(self.replicas))]

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str | None = None,
                    prompt_text: str | None = None, priority: int = 0) -> str:
        # checked here, so a bad request is refused at once; each replica builds its sequences
        token_ids, text, _ = self.admission.check(prompt, sampling_params, prompt_text, priority)
        guess = sampling_params.max_tokens or min(DEFAULT_OUTPUT_GUESS, self.max_model_len - len(token_ids))
        with self._lock:
            if request_id is None:
                request_id = f"req-{self._arrivals}"
            if request_id in self._outstanding:
                raise ValueError(f"request id {request_id!r} is already in flight")
            p = _Pending(self._arrivals, request_id, token_ids, sampling_params, text,
                         len(token_ids) + guess * sampling_params.n, prefix_keys(token_ids, self.router.block_size),
                         priority=priority)
            self._arrivals += 1
            self._outstanding[request_id] = p
            self._queue.append(p)
        self._dispatch()
        return request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            p = self._outstanding.get(request_id)
            if p is None:
                return
            self._aborted.add(request_id)
            if p.replica is None:
                self._queue.remove(p)
                del self._outstanding[request_id]
                self._ready.append(_aborted_output(p))
                return
            replica = self.replicas[p.replica]
        replica.send([("abort", request_id)])

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._outstanding or self._ready)

    def _dispatch(self) -> None:
        """Hand queued requests to replicas with room, in the queue's order (arrival, or priority then arrival)."""
        batches: dict[int, list[tuple]] = {}
        with self._lock:
            while self._queue:
                p = self._queue[0]
                r = self.router.pick(p.keys)
                if r is None:
                    break
                self._queue.popleft()
                self.router.assign(r, p.cost, p.keys)
                p.replica = r
                batches.setdefault(r, []).append(("add", p.request_id, p.token_ids, p.params, p.prompt, p.priority))
        for r, msgs in batches.items():
            self.replicas[r].send(msgs)  # a replica gone meanwhile: its "lost" event re-queues these

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """The outputs any replica finished since the last call (waiting a little for one)."""
        self._dispatch()
        with self._lock:
            outs, self._ready = self._ready, []
        timeout: float | None = 0.0 if outs else STEP_WAIT_S
        while True:
            try:
                i, msg = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
            except queue.Empty:
                break
            timeout = None
            outs.extend(self._handle(i, msg))
        self._dispatch()
        return outs

    def _handle(self, i: int, msg: tuple) -> list[RequestOutput]:
        kind = msg[0]
        if i in self.lost:
            return []
        if kind == "outputs":
            self._stats[i] = msg[2]
            done = []
            with self._lock:
                for out in msg[1]:
                    p = self._outstanding.get(out.request_id)
                    if p is None or p.replica != i:
                        continue
                    del self._outstanding[out.request_id]
                    self.router.release(i, p.cost)
                    self._aborted.discard(out.request_id)
                    done.append(out)
            for out in done:
                self._attach_vocabulary(out)
            return done
        if kind == "rejected":
            _, rid, why = msg
            log.warning("replica %d refused request %s: %s", i, rid, why)
            with self._lock:
                p = self._outstanding.pop(rid, None)
                if p is not None:
                    self.router.release(i, p.cost)
            return []  # the job answers a request the engine dropped with an error line
        if kind in ("dead", "lost"):
            self._lose(i, msg[1])
        return []

    def _lose(self, i: int, why: str) -> None:
        if self._stopped:
            return
        self.lost[i] = why
        with self._lock:
            self.router.lose(i)
            back = sorted((p for p in self._outstanding.values() if p.replica == i), key=lambda p: p.order)
            for p in reversed(back):
                p.replica = None
                if p.request_id in self._aborted:
                    del self._outstanding[p.request_id]
                    self._ready.append(_aborted_output(p))
                else:
                    self._queue.appendleft(p)  # fcfs: at the front; priority: at its (priority, arrival) place
            self._stats[i] = None
        self.num_requeued += len(back)
        first = why.splitlines()[0] if why else "it ended"
        log.warning("data-parallel replica %d is gone (%s); %d requests go to the other replicas", i, first, len(back))
        if len(self.lost) == len(self.replicas):
            raise RuntimeError(f"every data-parallel replica is gone; the last: replica {i}: {first}")

    def _attach_vocabulary(self, out: RequestOutput) -> None:
        """Logprobs come without their texts (outputs.FlatLogprobs pickles token ids only): the front end's."""
        for lp in [out.prompt_logprobs, *(c.logprobs for c in out.outputs)]:
            if lp is not None and getattr(lp, "wants_vocabulary", False):
                lp.use_vocabulary(self.token_texts())  # type: ignore[union-attr]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        parts = [s for s in self._stats if s is not None]
        total = _sum_stats(parts)
        with self._lock:
            total.num_waiting += len(self._queue)
        total.replicas = list(self._stats)
        return total

    def reset_prefix_cache(self) -> int:
        """Every replica drops its cached prefixes (before any request sent after this call); returns 0, the count
        staying with the replicas."""
        for i, r in enumerate(self.replicas):
            if i not in self.lost:
                r.send([("reset",)])
        return 0

    def replica_pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        threads = [threading.Thread(target=r.stop, args=(STOP_TIMEOUT_S,), daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def _start_replicas(config: EngineConfig, replica_config: EngineConfig, events: queue.Queue) -> list[ReplicaHandle]:
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    if config.data_parallel_backend == "ray":
        from nvcli.engine.ray_replica import start_ray_replicas

        return start_ray_replicas(n, replica_config, config.ray_address, events)
    gpus: list[list[str] | None] = [None] * n
    if config.resolved_device() == "cuda":
        visible = _visible_gpus()
        if n * tp > len(visible):
            raise ConfigError(f"--data-parallel-size={n} x --tensor-parallel-size={tp} needs {n * tp} GPUs; "
                              f"{len(visible)} are visible (lower --dp)")
        gpus = [visible[i * tp : (i + 1) * tp] for i in range(n)]  # a TP group on neighbouring GPUs
    return [ProcessReplica(i, replica_config, gpus[i], events) for i in range(n)]


def _visible_gpus() -> list[str]:
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _with_replica(error: BaseException, i: int, n: int) -> BaseException:
    """The replica's own error, its message saying which replica (the same type: a user error stays one)."""
    try:
        return type(error)(f"data-parallel replica {i} of {n}: {error}")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return error


def _aborted_output(p: _Pending) -> RequestOutput:
    completions = [CompletionOutput(index=k, text="", token_ids=[], finish_reason="abort") for k in range(p.params.n)]
    return RequestOutput(request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.token_ids, outputs=completions,
                         finished=True)


def _sum_stats(parts: list[EngineStats]) -> EngineStats:
    fields = [f.name for f in dataclasses.fields(EngineStats) if f.name != "replicas"]
    total: dict[str, Any] = {name: 0 for name in fields}
    for s in parts:
        for name in fields:
            total[name] += getattr(s, name)
    total["last_step_time_s"] = max((s.last_step_time_s for s in parts), default=0.0)
    return EngineStats(**total)

