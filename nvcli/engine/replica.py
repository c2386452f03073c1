"""A data-parallel replica: one whole engine (with its own tensor-parallel ranks) in a process of its own, fed and
drained by the front end (engine/data_parallel.py) through messages.

    front end ── [("add", id, token_ids, params, text, priority) | ("abort", id) | ("reset",) | ("stop",)] ──▶ replica
    front end ◀── ("ready", ReplicaInfo) | ("failed", error, traceback) | ("outputs", [RequestOutput], stats)
                  | ("rejected", id, why) | ("dead", why) ──────────────────────────────────────── replica

`serve` is the replica's loop whatever carries the messages (a pipe here, Ray in engine/ray_replica.py). A replica
never takes a stop signal itself: Ctrl-C and SIGTERM reach the front end, which drains every replica and then stops
it; a replica whose front end is gone exits (child_processes.py).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvcli.child_processes import exit_with_parent
from nvcli.config import EngineConfig

STATS_EVERY_S = 0.25  # a busy replica reports its stats at least this often (the dashboard's frame rate)
_env_lock = threading.Lock()  # CUDA_VISIBLE_DEVICES is set around each replica's start


@dataclass
class ReplicaInfo:
    """What a replica reports once its engine is up."""

    config: EngineConfig  # its settings, resolved against the model
    max_model_len: int
    num_kvcache_blocks: int
    pid: int
    node: str = ""  # the Ray node it runs on (--dp-backend ray)


def serve(engine: Any, inbox: Callable[[float | None], list[tuple]], send: Callable[[tuple], None]) -> None:
    """Run `engine` on the front end's messages until ("stop",). `inbox(timeout)` returns the messages that came
    (waiting up to `timeout` s, None: until one comes); `send` sends one message back. A step that raises ends the
    replica: ("dead", why) goes back, and the front end gives its requests to the other replicas."""
    send(("outputs", [], engine.stats()))
    last_stats = 0.0
    while True:
        for msg in inbox(0 if engine.has_unfinished() else None):
            kind = msg[0]
            if kind == "add":
                _, rid, token_ids, params, text, priority = msg
                try:
                    engine.add_request(token_ids, params, request_id=rid, prompt_text=text, priority=priority)
                except ValueError as e:  # the front end admitted it already: only a replica's own limit says no
                    send(("rejected", rid, str(e)))
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "reset":
                engine.reset_prefix_cache()
            elif kind == "stop":
                return
        if not engine.has_unfinished():
            send(("outputs", [], engine.stats()))
            continue
        try:
            outs = engine.step()
        except Exception as e:  # noqa: BLE001 - a CUDA error or OOM: this replica is done, its requests are not
            send(("dead", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            raise
        now = time.monotonic()
        if outs or now - last_stats >= STATS_EVERY_S:
            send(("outputs", outs, engine.stats()))
            last_stats = now


def _main(conn: multiprocessing.connection.Connection, config: EngineConfig) -> None:
    """A replica process: build the engine, say so, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains on Ctrl-C and stops the replicas itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    from nvcli.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - told to the front end, which fails the job with it
        conn.send(("failed", _picklable(e), traceback.format_exc()))
        return
    try:
        conn.send(("ready", ReplicaInfo(engine.config, engine.max_model_len, engine.block_manager.num_blocks,
                                        os.getpid())))

        def inbox(timeout: float | None) -> list[tuple]:
            msgs: list[tuple] = []
            while conn.poll(timeout):
                msgs.extend(conn.recv())
                timeout = 0
            return msgs

        serve(engine, inbox, conn.send)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone
    except Exception:  # noqa: BLE001 - serve sent ("dead", why) with the traceback
        raise SystemExit(1) from None
    finally:
        engine.shutdown()


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


class ProcessReplica:
    """The front end's handle on a replica process of this host. Whatever the replica sends goes to `events` as
    (index, message); its end (exit, kill, crash) as (index, ("lost", why))."""

    def __init__(self, index: int, config: EngineConfig, gpus: list[str] | None,
                 events: queue.Queue[tuple[int, tuple]]) -> None:
        self.index = index
        self.events = events
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, config), name=f"nv-replica-{index}", daemon=True)
        with _env_lock:  # a spawned child starts with this process's environment
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            if gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            try:
                self.process.start()
            finally:
                if before is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
        child.close()
        self._send_lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive, name=f"nv-replica-{index}-rx", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _receive(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a message cut short by the replica's death
                self.events.put((self.index, ("lost", f"a message from it could not be read ({e})")))
                return
            self.events.put((self.index, msg))
        self.process.join(timeout=5)
        code = self.process.exitcode
        why = "its process ended" if code is None else f"its process exited with code {code}"
        if code is not None and code < 0:
            why = f"its process was killed ({signal.Signals(-code).name})"
        self.events.put((self.index, ("lost", why)))

    def send(self, msgs: list[tuple]) -> bool:
        """Send messages in one batch; False if the replica is gone."""
        try:
            with self._send_lock:
                self.conn.send(msgs)
            return True
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float) -> None:
        """Ask the replica to shut its engine down; kill it past `timeout` s."""
        self.send([("stop",)])
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
