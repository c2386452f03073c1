"""Data-parallel replicas as Ray actors (--dp-backend ray): the same replica loop (replica.serve) on the nodes of a
Ray cluster, fed by the same front end (data_parallel.py).

Each replica gets a placement group of one bundle (its GPUs and a CPU), so its tensor-parallel ranks, which the
replica starts as processes of its own, share a node. A pump thread per replica carries the front end's messages to the
actor and its replies back in one call (`exchange`), waiting a little for a reply; an actor that dies (its node lost,
killed) makes that call fail, and the front end re-queues the replica's requests. The model path must exist on every
node that gets a replica.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Any

from nvcli.config import EngineConfig
from nvcli.engine.replica import ReplicaInfo, serve

log = logging.getLogger("nvcli")

EXCHANGE_WAIT_S = 0.05  # an exchange returns once a reply comes or after this long
PLACEMENT_TIMEOUT_S = 300.0  # a replica's resources must be free within this long


class ReplicaActor:
    """The actor: an engine serving the front end's messages on a thread of its own."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.inbox: queue.Queue[list[tuple]] = queue.Queue()
        self.outbox: queue.Queue[tuple] = queue.Queue()

    def start(self) -> ReplicaInfo:
        import os

        import ray

        from nvcli.engine.llm_engine import LLMEngine

        engine = LLMEngine(self.config)
        info = ReplicaInfo(engine.config, engine.max_model_len, engine.block_manager.num_blocks, os.getpid(),
                           ray.get_runtime_context().get_node_id())
        threading.Thread(target=self._serve, args=(engine,), name="nv-replica", daemon=True).start()
        return info

    def _serve(self, engine: Any) -> None:
        def inbox(timeout: float | None) -> list[tuple]:
            msgs: list[tuple] = []
            try:
                msgs.extend(self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait())
                while True:
                    msgs.extend(self.inbox.get_nowait())
            except queue.Empty:
                pass
            return msgs

        try:
            serve(engine, inbox, self.outbox.put)
        except Exception:  # noqa: BLE001, S110 - serve sent ("dead", why); the front end stops this actor
            pass
        finally:
            engine.shutdown()
            self.outbox.put(("stopped",))

    def exchange(self, msgs: list[tuple], wait_s: float) -> list[tuple]:
        if msgs:
            self.inbox.put(msgs)
        replies: list[tuple] = []
        try:
            replies.append(self.outbox.get(timeout=wait_s))
            while True:
                replies.append(self.outbox.get_nowait())
        except queue.Empty:
            pass
        return replies


class RayReplica:
    """The front end's handle on a replica actor; what it sends back goes to `events` as (index, message)."""

    def __init__(self, index: int, actor: Any, placement_group: Any, events: queue.Queue) -> None:
        self.index = index
        self.actor = actor
        self.placement_group = placement_group
        self.events = events
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._gone = False
        self._stopped = threading.Event()
        self._pump = threading.Thread(target=self._run, name=f"nv-ray-replica-{index}", daemon=True)
        self._pump.start()

    pid = None  # the actor's process is on another node

    def _run(self) -> None:
        import ray

        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError: the cluster lacks the resources
            self._fail(RuntimeError(f"the Ray cluster gave no node with this replica's resources within "
                                    f"{PLACEMENT_TIMEOUT_S:.0f} s ({type(e).__name__})"), "")
            return
        try:
            info = ray.get(self.actor.start.remote())
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))
            self._fail(cause, str(e))
            return
        except Exception as e:  # noqa: BLE001 - the actor died while starting
            self._fail(RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc())
            return
        self.events.put((self.index, ("ready", info)))
        while True:
            with self._lock:
                msgs, self._pending = self._pending, []
            try:
                replies = ray.get(self.actor.exchange.remote(msgs, EXCHANGE_WAIT_S))
            except Exception as e:  # noqa: BLE001 - RayActorError: its node or process is gone
                self._lose(f"its Ray actor is gone ({type(e).__name__}: {str(e).splitlines()[0]})")
                return
            for reply in replies:
                if reply[0] == "stopped":
                    self._stopped.set()
                    if not any(m[0] == "stop" for m in msgs):
                        self._lose("its engine stopped")
                    return
                self.events.put((self.index, reply))

    def _fail(self, error: BaseException, tb: str) -> None:
        self._gone = True
        self.events.put((self.index, ("failed", error, tb)))

    def _lose(self, why: str) -> None:
        self._gone = True
        self.events.put((self.index, ("lost", why)))

    def send(self, msgs: list[tuple]) -> bool:
        with self._lock:
            if self._gone:
                return False
            self._pending.extend(msgs)
        return True

    def stop(self, timeout: float) -> None:
        if self.send([("stop",)]):
            self._stopped.wait(timeout)
        self.kill()

    def kill(self) -> None:
        import ray

        self._gone = True
        try:
            ray.kill(self.actor)
            ray.util.remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001, S110 - already gone with its node
            pass


def start_ray_replicas(n: int, config: EngineConfig, address: str | None, events: queue.Queue) -> list[RayReplica]:
    """N replica actors on the cluster at `address` (None: RAY_ADDRESS, else a local cluster that Ray starts)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    gpus = config.tensor_parallel_size if config.device != "cpu" and _cluster_has_gpus() else 0
    actor_class = ray.remote(ReplicaActor)
    replicas = []
    for i in range(n):
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        pg = ray.util.placement_group([bundle], strategy="STRICT_PACK", name=f"nv-replica-{i}")
        actor = actor_class.options(
            num_cpus=1, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
        ).remote(config)
        replicas.append(RayReplica(i, actor, pg, events))
    return replicas


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
