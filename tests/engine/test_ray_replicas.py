"""--dp-backend ray on a real two-node Ray cluster on this machine (ray.cluster_utils.Cluster): a replica on each
node serves the job, and a lost node's lines go to the other replica."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from nvcli.config import EngineConfig  # noqa: E402
from nvcli.engine.data_parallel import DataParallelEngine  # noqa: E402
from nvcli.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c, worker
    ray.shutdown()
    c.shutdown()


def test_a_replica_on_each_node_and_a_lost_node_s_lines_are_served(cluster, tiny_model_dir):
    from nvcli.engine.llm_engine import LLMEngine

    config = dict(model=str(tiny_model_dir("qwen3")), device="cpu", num_kvcache_blocks=128, max_model_len=512,
                  max_num_seqs=2)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[10 + i, 20, 30 + i, 40] for i in range(12)]
    one = LLMEngine(EngineConfig(**config))
    for i, p in enumerate(prompts):
        one.add_request(p, sp, request_id=f"r{i}")
    want = {}
    while one.has_unfinished():
        want.update({o.request_id: o.outputs[0].token_ids for o in one.step()})
    one.shutdown()

    cluster, worker = cluster
    engine = DataParallelEngine(EngineConfig(**config, data_parallel_size=2, data_parallel_backend="ray",
                                             ray_address=cluster.address))
    try:
        nodes = [info.node for info in engine.infos]
        assert len(set(nodes)) == 2  # one replica per node
        on_worker = nodes.index(worker.node_id)
        for i, p in enumerate(prompts):
            engine.add_request(p, sp, request_id=f"r{i}")
        got: dict[str, list[int]] = {}
        killed = False
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id not in got
                got[o.request_id] = o.outputs[0].token_ids
            if got and not killed:  # the worker node goes away mid-job, with its replica
                cluster.remove_node(worker)
                killed = True
        assert on_worker in engine.lost and engine.num_requeued > 0
    finally:
        engine.shutdown()
    assert got == want
