"""A MARL run on two Ray nodes of this machine (`ray.cluster_utils.Cluster`: a head and a worker, one GPU declared
on each, none real): the plan spreads one learner group over both nodes (a gloo process group across them), the
storage check hears from both, a lost node stops the run with an error naming it, and the run resumes with the
losses of an uninterrupted one. Select it with `pytest -k two_node_ray`."""
import json

import pytest

from tests.conftest import varied_reward
from tests.marl.test_learner_groups import LEARNER, gpu_team
from tests.marl.test_trainer import questions
from m1.marl.config import TrainConfig

NODE = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": 100 * 2**20}  # one rank per node, bundles of 1 CPU


@pytest.fixture
def two_node_ray(m1_cache):
    """A head node (the driver's) and a worker node, each with 1 GPU and a resource naming it; yields the Cluster."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "another test left Ray running"
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"m1_head": 1},
                                                            "include_dashboard": False})
    try:
        cluster.add_node(**NODE, resources={"m1_worker": 1})
        ray.init(address=cluster.address, logging_level="ERROR", runtime_env={"env_vars": {
            "OMP_NUM_THREADS": "1", "M1_CACHE": m1_cache, "HF_HUB_OFFLINE": "1"}})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _config(out) -> TrainConfig:
    return TrainConfig.model_validate({
        "team": gpu_team(), "train_agents": ["alpha"], "judge": {"method": "rubric"}, "grpo": {"beta": 0.05},
        "rollout": {"num_generations": 2, "questions_per_step": 2}, "learner": {**LEARNER, "gpus": 2},
        "placement": "ray", "steps": 2, "out_dir": str(out), "checkpoint": {"every": 1, "keep_last": 2},
        "cluster": {"gpu_mem_gb": 80, "gpus_per_node": 1, "cpus_per_gpu": 1},
        "log": {"progress": False, "backends": []}})


def _node_resources() -> dict[str, set[str]]:
    """Live node id -> the custom resources that name it (m1_head / m1_worker)."""
    import ray

    return {n["NodeID"]: {k for k in n["Resources"] if k.startswith("m1_")} for n in ray.nodes() if n["Alive"]}


@pytest.mark.slow
def test_two_node_ray_run_stops_naming_a_lost_node_and_resumes_with_the_same_losses(two_node_ray, tmp_path, video,
                                                                                    monkeypatch):
    from m1.marl.actor import groups
    from m1.marl.actor.distributed import DistributedError
    from m1.marl.parts import make_trainer
    from m1.marl.trainer import Trainer

    checked: list[list[str]] = []  # who wrote a marker in each storage check
    real_check = groups.check_shared_storage
    monkeypatch.setattr(groups, "check_shared_storage",
                        lambda out_dir, writers: (checked.append(list(writers)), real_check(out_dir, writers))[1])

    def start(out) -> Trainer:
        tr = make_trainer(_config(out), questions=questions(video), reward_fn=varied_reward)
        # the plan spreads alpha's two ranks over the two nodes, and each rank runs on the node its bundle named
        assert [str(s) for s in tr.placement.plan.learners["alpha"]] == ["node 0 gpu 0", "node 1 gpu 0"]
        rb, where = tr.placement.bundles, tr.learners.where
        on = [where[("alpha", r)]["node_id"] for r in (0, 1)]
        assert on == [rb.labels[rb.index[("learner", "alpha", r)]]["ray.io/node-id"] for r in (0, 1)]
        assert sorted(sorted(_node_resources()[n]) for n in on) == [["m1_head"], ["m1_worker"]]
        assert [where[("alpha", r)]["world"] for r in (0, 1)] == [2, 2]  # one process group across the nodes
        # out_dir was checked from both nodes, at this run's start
        assert all(any(f"rank {r} " in w and on[r] in w for w in checked[-1]) for r in (0, 1))
        return tr

    tr = start(tmp_path / "whole")
    try:
        whole = tr.train()
    finally:
        tr.close()
    assert len(whole) == 2

    # the worker node is lost mid-step 2: its rollouts are done, the update has not run
    tr = start(tmp_path / "cut")
    worker = next(iter(two_node_ray.worker_nodes))
    rank = next(r for r in (0, 1) if tr.learners.where[("alpha", r)]["node_id"] == worker.node_id)
    update = tr.learners.update

    def update_after_losing_the_worker(samples, lr, family="grpo"):
        if tr.step == 1:
            two_node_ray.remove_node(worker)
        return update(samples, lr, family)

    tr.learners.update = update_after_losing_the_worker
    try:
        with pytest.raises(DistributedError) as err:
            tr.train()
    finally:
        tr.close()
    msg = str(err.value)
    assert (f"Ray node {worker.node_id} (address {worker.node_ip_address}) died: it held agent alpha rank {rank} "
            "of 2, during step 2 of 2") in msg
    assert "resumes from the checkpoint of step 1" in msg
    cut = tr.history
    assert len(cut) == 1
    done = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step-*"))
    assert done == ["step-000001"]

    # the node comes back (a new Ray node id); the same run resumes from step 1 on both nodes again
    two_node_ray.add_node(**NODE, resources={"m1_worker": 1})
    two_node_ray.wait_for_nodes()
    checked.clear()
    tr = start(tmp_path / "cut")
    try:
        assert tr.step == 1
        rest = tr.train()
    finally:
        tr.close()
    assert len(rest) == 1
    for got, want in zip(cut + rest, whole):
        assert got["step"] == want["step"]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-7)
        assert got["alpha/grad_norm"] == pytest.approx(want["alpha/grad_norm"], rel=1e-6)
    logged = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]  # the lost step left no line behind


def test_two_node_ray_bundles_name_each_node_by_its_id():
    """Two Ray nodes of one machine share an address, so the plan's bundles select their node by Ray node id."""
    from m1.marl.plan.cluster import PlanError
    from m1.marl.plan.planner import make_plan

    cfg = _config("/tmp/unused")
    plan = make_plan(cfg, nodes=[1, 1], gpu_mem_gb=80)
    assert plan.fits and [str(s) for s in plan.learners["alpha"]] == ["node 0 gpu 0", "node 1 gpu 0"]
    rb = plan.ray_bundles(node_ips=["10.0.0.5", "10.0.0.5"], node_ids=["aa" * 28, "bb" * 28])
    assert rb.bundles == [{"GPU": 1, "CPU": 1, "node:10.0.0.5": 0.001}] * 2
    assert rb.labels == [{"ray.io/node-id": "aa" * 28}, {"ray.io/node-id": "bb" * 28}]
    assert plan.ray_bundles().labels is None  # no ids known: no selector
    with pytest.raises(PlanError, match="1 node ids for a plan of 2 nodes"):
        plan.ray_bundles(node_ids=["aa" * 28])


def test_two_node_ray_lost_ranks_names_the_node_or_the_dead_rank(monkeypatch):
    """The message logic of `RayLearners.lost_ranks` against Ray's table of nodes (ray.nodes stands in for a
    cluster): a dead node names its id, address and every rank it held; a rank whose process died on a live node
    names that rank; a Ray error with every node up, or an error that is not Ray's, is left as it is (None)."""
    ray = pytest.importorskip("ray")
    from m1.marl.actor.groups import RayLearners, lost_ranks

    a, b = "aa" * 28, "bb" * 28
    group = object.__new__(RayLearners)  # the state a built group holds, without starting actors
    group.worlds = {"alpha": 2, "beta": 2}
    group.where = {("alpha", 0): {"node_id": a, "ip": "10.0.0.1", "actor_id": "a0"},
                   ("alpha", 1): {"node_id": b, "ip": "10.0.0.2", "actor_id": "a1"},
                   ("beta", 0): {"node_id": b, "ip": "10.0.0.2", "actor_id": "b0"},
                   ("beta", 1): {"node_id": b, "ip": "10.0.0.2", "actor_id": "b1"}}
    alive = {a: True, b: False}
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": up} for n, up in alive.items()])
    died = ray.exceptions.RayActorError(actor_id="a1")
    assert lost_ranks(group, died) == (f"Ray node {b} (address 10.0.0.2) died: it held agent alpha rank 1 of 2, "
                                       "agent beta ranks 0, 1 of 2")
    alive[b] = True
    assert group.lost_ranks(died, wait_s=0) == (f"agent alpha rank 1 of 2 died on Ray node {b} (address 10.0.0.2), "
                                                "which is still up: its process was killed (out of host memory? see "
                                                "the node's raylet.out and dmesg)")
    assert group.lost_ranks(ray.exceptions.WorkerCrashedError(), wait_s=0) is None
    assert group.lost_ranks(ray.exceptions.RayActorError(actor_id="not ours"), wait_s=0) is None
    assert lost_ranks(group, ValueError("a learner's own error")) is None
    assert lost_ranks(object(), died) is None  # learners in this process
