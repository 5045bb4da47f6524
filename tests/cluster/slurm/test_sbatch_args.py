"""The job a mesh needs: nodes, tasks per node and GPUs derived from the mesh and the cluster config,
the partition check, time limits. Pure functions on configs composed through Hydra; no Slurm needed."""

from __future__ import annotations

import pytest

from p3d.jobs.slurm.submit import (
    Partition,
    check_fits,
    job_shape,
    parse_gres_gpus,
    parse_sinfo,
    sbatch_args,
    time_minutes,
    time_seconds,
)
from p3d.layout.run_plan import P3DConfigError
from tests.helpers.runs import compose, typed

CLUSTERS = ["local", "slurm", "a100_80gb", "h100_sxm", "h200", "b200"]


def args_of(*overrides: str, run_dir: str = "/shared/runs/r1") -> list[str]:
    cfg, plan = typed(*overrides)
    return sbatch_args(cfg, job_shape(cfg, plan), run_dir)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_cluster_preset_composes_and_validates(cluster):
    from p3d.config.devices import DEVICES

    node = compose(f"cluster={cluster}", "mesh=tp2_pp2")
    cfg, plan = typed(f"cluster={cluster}", "mesh=tp2_pp2", "mesh.dp=auto", "schedule.global_batch_size=512")
    assert cfg.cluster.name == cluster and cfg.cluster.device in DEVICES
    assert node.cluster.launcher.value == ("local" if cluster == "local" else "slurm")
    # device numbers live in p3d/config/devices.py; a preset only names the device
    assert cfg.cluster.peak_tflops == DEVICES[cfg.cluster.device].peak_tflops
    assert cfg.cluster.memory_gb == DEVICES[cfg.cluster.device].memory_gb
    assert plan.world_size == cfg.cluster.nodes * (cfg.cluster.gpus_per_node or 4)


def test_gpu_cluster_multi_node_llama70b():
    cfg, plan = typed("cluster=h100_sxm", "cluster.nodes=8", "mesh=tp8_pp8", "model=llama70b", "schedule=large")
    lay = job_shape(cfg, plan)
    assert (lay.nodes, lay.ntasks_per_node, lay.gpus_per_node, lay.world_size) == (8, 8, 8, 64)
    args = sbatch_args(cfg, lay, "/shared/runs/r1")
    for expected in (
        "--nodes=8",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=8",
        "--requeue",
        "--signal=B:USR1@300",
        "--open-mode=append",
        "--output=/shared/runs/r1/slurm-%j.out",
    ):
        assert expected in args, (expected, args)


def test_gpu_cluster_dp_fills_the_nodes():
    cfg, plan = typed(
        "cluster=h100_sxm",
        "cluster.nodes=4",
        "mesh=tp8_pp1",
        "model=llama3_8b",
        "mesh.dp=auto",
        "schedule.global_batch_size=64",
    )
    lay = job_shape(cfg, plan)
    assert plan.dp == 4 and (lay.nodes, lay.ntasks_per_node, lay.gpus_per_node) == (4, 8, 8)


def test_cpu_cluster_asks_for_no_gpus_and_one_task_per_rank():
    args = args_of("cluster=slurm", "mesh=dp2_pp2_tp2")
    assert "--nodes=1" in args and "--ntasks-per-node=8" in args
    assert not any(a.startswith(("--gpus", "--gres")) for a in args)


def test_cpu_cluster_spreads_the_mesh_over_nodes():
    cfg, plan = typed("cluster=slurm", "mesh=dp2_pp2_tp2", "cluster.nodes=2")
    lay = job_shape(cfg, plan)
    assert (lay.nodes, lay.ntasks_per_node, lay.gpus_per_node) == (2, 4, None)
    cfg, plan = typed("cluster=slurm", "mesh=tp2_pp2", "mesh.dp=auto", "cluster.nodes=2", "cluster.gpus_per_node=4")
    assert plan.dp == 2 and job_shape(cfg, plan).ntasks_per_node == 4


def test_uneven_or_split_tp_layouts_are_refused():
    cfg, plan = typed("cluster=slurm", "mesh=pp2", "mesh.dp=3", "cluster.nodes=4", "schedule.global_batch_size=24")
    with pytest.raises(P3DConfigError, match=r"cluster.nodes=4 does not divide the mesh's 6 ranks"):
        job_shape(cfg, plan)
    cfg, plan = typed("cluster=slurm", "mesh=tp4", "cluster.nodes=2")
    with pytest.raises(P3DConfigError, match=r"mesh.tp=4 must divide the 2 ranks per node"):
        job_shape(cfg, plan)


def test_cluster_options_and_extra_lines_pass_through():
    args = args_of(
        "cluster=slurm",
        "mesh=pp2",
        "cluster.partition=gpu",
        "cluster.account=proj1",
        "cluster.qos=high",
        "cluster.constraint='h100&ib'",
        "cluster.time=2-00:00:00",
        "cluster.cpus_per_task=16",
        "cluster.job_name=llama",
        "cluster.requeue=false",
        "cluster.signal_s=600",
        "cluster.extra_sbatch=[--exclusive,'--mem=0']",
    )
    for expected in (
        "--partition=gpu",
        "--account=proj1",
        "--qos=high",
        "--constraint=h100&ib",
        "--time=2-00:00:00",
        "--cpus-per-task=16",
        "--job-name=llama",
        "--no-requeue",
        "--signal=B:USR1@600",
    ):
        assert expected in args, (expected, args)
    assert args[-2:] == ["--exclusive", "--mem=0"]  # last: the user's lines win over the derived ones


def test_unset_options_are_left_to_slurm():
    args = args_of("cluster=slurm", "mesh=pp2", "cluster.time=null", "cluster.signal_s=0")
    assert not any(
        a.split("=")[0]
        in ("--partition", "--account", "--qos", "--constraint", "--time", "--signal", "--cpus-per-task")
        for a in args
    ), args


@pytest.mark.parametrize(
    "value,minutes", [("30", 30), ("90:30", 91), ("01:00:00", 60), ("2-0", 2880), ("1-12:30", 2190), ("0-00:00:30", 1)]
)
def test_slurm_time_formats(value, minutes):
    assert time_minutes(value) == minutes


def test_bad_time_and_signal_after_the_limit_are_refused():
    with pytest.raises(P3DConfigError, match="cluster.time=soon is not a Slurm time limit"):
        time_seconds("soon")
    with pytest.raises(P3DConfigError, match=r"cluster.signal_s=300 must be shorter than cluster.time=5 \(300 s\)"):
        args_of("cluster=slurm", "mesh=pp2", "cluster.time=5")


SINFO = """vm1|8|(null)|debug*
vm2|8|(null)|debug*
g1|64|gpu:h100:8(S:0-1)|gpu
g2|64|gpu:h100:4,nvme:1|gpu
"""


def test_partition_from_sinfo():
    assert parse_sinfo(SINFO, None) == Partition("debug", nodes=2, cpus_per_node=8, gpus_per_node=0)
    assert parse_sinfo(SINFO, "gpu") == Partition("gpu", nodes=2, cpus_per_node=64, gpus_per_node=4)
    assert parse_gres_gpus("gpu:a100:4,gpu:a100:4") == 8 and parse_gres_gpus("(null)") == 0
    with pytest.raises(P3DConfigError, match="cluster.partition=big: Slurm lists no nodes there"):
        parse_sinfo(SINFO, "big")


def test_mesh_that_does_not_fit_the_partition_is_refused():
    debug = parse_sinfo(SINFO, None)
    cfg, plan = typed("cluster=slurm", "mesh=dp2_pp2_tp2")  # 8 ranks, 8 CPUs: fits
    check_fits(job_shape(cfg, plan), debug, plan)
    cfg, plan = typed("cluster=slurm", "mesh=tp2_pp2", "mesh.dp=4", "schedule.global_batch_size=32")  # 16 ranks
    with pytest.raises(
        P3DConfigError,
        match=r"needs 16 tasks x 1 CPUs = 16 CPUs per node.*have 8; try "
        r"cluster.nodes=2 cluster.gpus_per_node=8",
    ):
        check_fits(job_shape(cfg, plan), debug, plan)
    cfg, plan = typed("cluster=slurm", "mesh=dp2_pp2_tp2", "cluster.nodes=4")
    with pytest.raises(P3DConfigError, match=r"cluster.nodes=4 exceeds the 2 node\(s\) of partition debug"):
        check_fits(job_shape(cfg, plan), debug, plan)
    cfg, plan = typed(
        "cluster=h100_sxm",
        "cluster.partition=gpu",
        "mesh=tp8_pp1",
        "model=llama3_8b",
        "mesh.dp=auto",
        "schedule.global_batch_size=64",
    )
    with pytest.raises(P3DConfigError, match=r"cluster.gpus_per_node=8 exceeds the 4 GPUs per node of partition gpu"):
        check_fits(job_shape(cfg, plan), parse_sinfo(SINFO, "gpu"), plan)


def test_an_elastic_job_is_submitted_with_no_kill():
    elastic = args_of(
        "cluster=slurm", "mesh=dp2_pp2", "cluster.nodes=2", "cluster.elastic.min_nodes=1", "train.save_every=4"
    )
    assert "--no-kill" in elastic and "--nodes=2" in elastic  # a requeue still waits for the full size
    assert "--no-kill" not in args_of("cluster=slurm", "mesh=dp2_pp2", "cluster.nodes=2")
