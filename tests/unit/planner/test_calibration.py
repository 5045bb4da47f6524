"""The calibration file (issue 36): refused in one line when it is not this machine's, used by the planner when it is,
and without it every prediction is the device table's (tests/unit/planner/test_published.py stays as it is)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from p3d.config.errors import P3DConfigError
from p3d.layout.geometry import padded_vocab
from p3d.planner import calibration, predict
from p3d.planner.machine import Calibrated, DeviceTable, machine_of
from p3d.planner.shapes import layout_of
from p3d.planner.step_time import ring
from tests.helpers.runs import compose, compose_config

TINY = ("model=tiny", "mesh=dp2")


def fake_raw(*overrides: str, cores: int | None = None, scale: float = 1.0) -> dict[str, Any]:
    """A calibration of this host (identity as p3d-plan calibrate writes it) with blocks for tp 1 and 2 in every
    recompute mode, heads and embeddings at the shape of ``overrides``, every probed time times ``scale``."""
    cfg = compose_config(*overrides)
    m, b, s = cfg.model, cfg.schedule.micro_batch_size, cfg.model.seq_len
    blocks, heads, embeddings = [], [], []
    for tp in (1, 2):
        for rec, extra in (("none", 0.0), ("selective", 0.001), ("full", 0.004)):
            fwd, bwd = 0.004 / tp * scale, (0.008 / tp + extra) * scale
            row = {"arch": "llama", "moe": False, "tp": tp, "b": b, "s": s, "recompute": rec, "dtype": "fp32"}
            blocks.append({**row, "fwd_s": fwd, "bwd_s": bwd, "loaded_fwd_s": fwd, "loaded_bwd_s": bwd})
        fwd, bwd = 0.002 / tp * scale, 0.003 / tp * scale
        vpad = padded_vocab(m.vocab_size, tp)
        heads.append({"tp": tp, "b": b, "s": s, "vocab_padded": vpad, "fwd_s": fwd, "bwd_s": bwd})
        row = {"tp": tp, "b": b, "s": s, "vocab_padded": vpad}
        embeddings.append({**row, "fwd_s": 0.0005 / tp * scale, "bwd_s": 0.001 / tp * scale})
    host = calibration.host_fingerprint("cpu")
    if cores is not None:
        host["cores"] = cores
    return {
        "kind": calibration.KIND,
        "format": calibration.FORMAT,
        "created": "2026-12-04T08:00:00Z",
        "software": calibration.software_fingerprint(),
        "machine": host,
        "compute": {
            "loaded_ranks": host["cores"],
            "cores_effective": 0.9 * host["cores"],
            "blocks": blocks,
            "head": heads,
            "embedding": embeddings,
            "gemm_tflops": 0.05,
            "loaded_gemm_tflops": 0.04,
            "memory_gbps": 10.0,
            "loaded_memory_gbps": 8.0,
            "optimizer_s_per_param": 3e-9,
            "loaded_optimizer_s_per_param": 5e-9,
        },
        "collectives": {
            "fits": [
                {"op": op, "n": 2, "latency_s": 1e-4, "s_per_byte": 1e-9}
                for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
            ]
        },
        "overhead": {},
    }


def fake_calibration(tmp_path: Path, raw: dict[str, Any] | None = None, name: str = "cal.json") -> str:
    path = tmp_path / name
    calibration.dump(raw if raw is not None else fake_raw(*TINY), path)
    return str(path)


def calibrated(path: str, *overrides: str):
    return compose_config(*(overrides or TINY), f"calibration={path}")


def test_a_file_of_this_host_is_accepted_and_used(tmp_path):
    from p3d.launch.check import typed_config

    path = fake_calibration(tmp_path)
    cfg = typed_config(compose(*TINY, f"calibration={path}"), resolve_auto=False)
    assert cfg.calibration == path and isinstance(machine_of(cfg), Calibrated)
    report = predict(cfg)
    plain = predict(compose_config(*TINY))
    out = report.to_json()
    assert out["assumptions"]["calibration"] == path and plain.to_json()["assumptions"]["calibration"] is None
    assert report.step_time_s != plain.step_time_s
    assert f"calibrated: {path}" in report.render() and not any("not probes" in n for n in report.notes)


def test_a_relative_path_is_made_absolute(tmp_path):
    from p3d.rundir.paths import resolve_config_paths

    cfg = resolve_config_paths(compose_config(*TINY, "calibration=cal.json"), base=tmp_path)
    assert cfg.calibration == str(tmp_path / "cal.json")


def _doctored(key: str, value: Any) -> dict[str, Any]:
    raw = fake_raw(*TINY)
    section, _, field = key.rpartition(".")
    (raw[section] if section else raw)[field] = value
    return raw


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("format", 0, "not a p3d calibration file of format 1"),
        ("software.torch", "1.0.0", "torch 1.0.0"),
        ("software.p3d", "0.0.1", "p3d 0.0.1"),
        ("machine.device", "h100_sxm", "cluster.device=h100_sxm"),
        ("machine.cores", calibration.cores() + 1, "cores="),
        ("machine.cpu_model", "Z80", "cpu_model='Z80'"),
        ("compute", {}, "lacks or garbles"),
    ],
)
def test_another_machine_or_software_is_refused_in_one_line(tmp_path, key, value, says):
    from p3d.launch.check import typed_config

    path = fake_calibration(tmp_path, _doctored(key, value))
    with pytest.raises(P3DConfigError) as err:
        typed_config(compose(*TINY, f"calibration={path}"), resolve_auto=False)
    msg = str(err.value)
    assert "\n" not in msg and f"calibration={path}" in msg and says in msg and "p3d-plan calibrate" in msg, msg


def test_the_hostname_is_not_compared(tmp_path):
    from p3d.launch.check import typed_config

    path = fake_calibration(tmp_path, _doctored("machine.hostname", "another-node"))
    typed_config(compose(*TINY, f"calibration={path}"), resolve_auto=False)


@pytest.mark.parametrize("content, says", [(None, "cannot be read"), ("{not json", "is not JSON")])
def test_a_missing_or_garbled_file_is_refused_in_one_line(tmp_path, content, says):
    from p3d.launch.check import typed_config

    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(P3DConfigError, match=f"^calibration={path} {says}.*p3d-plan calibrate[^\n]*$"):
        typed_config(compose(*TINY, f"calibration={path}"), resolve_auto=False)


def test_doubling_the_probed_times_doubles_the_compute(tmp_path):
    one = predict(calibrated(fake_calibration(tmp_path, fake_raw(*TINY), "one.json")))
    two = predict(calibrated(fake_calibration(tmp_path, fake_raw(*TINY, scale=2.0), "two.json")))
    assert two.breakdown["compute"] == pytest.approx(2 * one.breakdown["compute"], rel=1e-12)
    cfg = compose_config(*TINY)
    lay = layout_of(cfg)
    blocks = cfg.model.n_layers * (0.004 + 0.008) + (0.002 + 0.003) + (0.0005 + 0.001)  # blocks, head, embedding
    assert one.breakdown["compute"] == pytest.approx(lay.micro_batches * blocks, rel=1e-12)


def test_recompute_adds_the_probed_difference(tmp_path):
    path = fake_calibration(tmp_path)
    full = predict(calibrated(path, *TINY, "schedule.recompute=full"))
    m, layers = full.layout.micro_batches, full.cfg.model.n_layers
    assert full.breakdown["recompute"] == pytest.approx(m * layers * 0.004, rel=1e-12)


def test_full_recompute_on_deepspeed_s_engine_uses_its_own_checkpoint_s_probe(tmp_path):
    """DeepSpeed's PipelineModule recomputes a block under DeepSpeed's reentrant checkpoint, the torch executors
    under torch's: each layout adds its own probe's difference; a file without the DeepSpeed probe, torch's."""
    import dataclasses

    raw = fake_raw(*TINY)
    full = [r for r in raw["compute"]["blocks"] if r["recompute"] == "full"]
    slower = [r["bwd_s"] + 0.002 for r in full]  # DeepSpeed's checkpoint: 2 ms more backward than torch's
    raw["compute"]["blocks"] += [
        {**r, "recompute": "full_deepspeed", "bwd_s": bwd, "loaded_bwd_s": bwd} for r, bwd in zip(full, slower)
    ]
    cfg = calibrated(fake_calibration(tmp_path, raw), *TINY, "schedule.recompute=full")
    deepspeed = layout_of(cfg)
    on_torch = dataclasses.replace(deepspeed, zero=2)  # FSDP2 under torch's executor
    assert not deepspeed.torch_executor and on_torch.torch_executor
    block = machine_of(cfg).block
    assert block(deepspeed, False)["rec"] == pytest.approx(0.004 / 1 + 0.002)  # tp 1: full_deepspeed - none
    assert block(on_torch, False)["rec"] == pytest.approx(0.004)
    older = calibrated(fake_calibration(tmp_path, fake_raw(*TINY), "old.json"), *TINY, "schedule.recompute=full")
    assert machine_of(older).block(layout_of(older), False)["rec"] == pytest.approx(0.004)


def test_collectives_use_the_fits(tmp_path):
    cfg = calibrated(fake_calibration(tmp_path))
    assert ring(cfg, 1e6, 2, 2) == pytest.approx(1e-4 + 1e-9 * 1e6)
    # n = 4 unprobed: the n = 2 fit, its bandwidth term scaled by the ring factor (3/4) / (1/2)
    assert ring(cfg, 1e6, 4, 4, "all_gather") == pytest.approx(1e-4 + 1e-9 * 1e6 * 1.5)


def test_contention_bounds_the_step_with_more_ranks_than_cores(tmp_path):
    overrides = ("model=tiny", "mesh=dp2_pp2_tp2")  # 8 ranks
    path = fake_calibration(tmp_path, fake_raw(*overrides, cores=2))
    report = predict(calibrated(path, *overrides))
    b = report.breakdown
    assert b["contention"] > 0
    assert report.step_time_s == pytest.approx(b["step"])
    lay = report.layout
    work = sum(lay.micro_batches * t.total for t in report.stage_times) * lay.tp * lay.dp_cp
    assert report.step_time_s >= work / 2
    # as many ranks as cores: no contention term
    path4 = fake_calibration(tmp_path, fake_raw(*overrides, cores=8), "eight.json")
    assert "contention" not in predict(calibrated(path4, *overrides)).breakdown


def test_an_unprobed_shape_uses_the_rates_and_says_so(tmp_path):
    path = fake_calibration(tmp_path)
    report = predict(calibrated(path, "model=tiny", "mesh=tp4"))
    assert any("calibrated rates, not probes" in n and "tp=4" in n for n in report.notes), report.notes
    assert report.breakdown["compute"] > 0


def test_without_a_file_the_device_table_is_used():
    cfg = compose_config(*TINY)
    assert cfg.calibration is None and type(machine_of(cfg)) is DeviceTable
    report = predict(cfg)
    assert "contention" not in report.breakdown and "overhead" not in report.breakdown


def test_the_file_is_read_once(tmp_path):
    path = fake_calibration(tmp_path)
    assert calibration.load(path) is calibration.load(path)
    raw = json.loads(Path(path).read_text())
    assert copy.deepcopy(raw) == calibration.load(path).raw


def test_deepspeed_copies_its_gradients_around_the_dp_all_reduce(tmp_path):
    from p3d.planner.step_time import dp_seconds

    cfg = calibrated(fake_calibration(tmp_path))  # dp2, fp32, ZeRO 0, DeepSpeed's engine
    plain = compose_config(*TINY)
    lay = layout_of(cfg)
    st = predict(cfg).stages[0].params
    copies = dp_seconds(cfg, lay, st) - ring(cfg, st.total * 4.0, 2, 2)
    assert copies == pytest.approx(24.0 * st.total / 8e9)  # three passes, read + written, at the loaded 8 GB/s
    assert dp_seconds(plain, lay, st) == ring(plain, st.total * 4.0, 2, 2)


def test_the_probes_follow_the_run_and_mesh_auto_s_candidates():
    from p3d.launch.calibrate import fit, optimizer_room, probe_plan
    from p3d.planner.shapes import stage_params

    cfg = compose_config("model=small", "mesh=tp2_pp2", "schedule.recompute=full")
    one = probe_plan(cfg)
    assert one.blocks == [(2, "full_deepspeed"), (2, "none")] and one.heads == [2]  # 1f1b: DeepSpeed's checkpoint
    stage = max(st.total for st in stage_params(cfg, layout_of(cfg)))
    assert one.optimizer_params == min(stage, optimizer_room(calibration.cores()))  # AdamW at its stage's size
    auto = probe_plan(compose_config("model=small", "mesh=auto", "cluster.gpus_per_node=8"))
    modes = ["full", "full_deepspeed", "none", "selective"]  # full: torch's checkpoint and DeepSpeed's
    assert auto.heads == [1, 2, 4] and auto.blocks == [(tp, mode) for tp in (1, 2, 4) for mode in modes]
    assert auto.group_sizes == [2, 4, 8][: len(auto.group_sizes)]
    assert fit([(1.0, 2.0), (3.0, 4.0)]) == (1.0, 1.0) and fit([(1.0, 1.0)]) == (1.0, 0.0)


def test_a_collective_is_read_off_its_measured_points():
    from p3d.planner.calibration import Fit

    fit = Fit(0.0, 0.0, ((1e3, 1e-3), (1e6, 2e-3), (1e7, 3e-2)))
    assert fit.seconds(1e6) == pytest.approx(2e-3) and fit.seconds(5.5e6) == pytest.approx(1.6e-2)
    assert fit.seconds(2e7) == pytest.approx(3e-2 + 1e7 * 2.8e-2 / 9e6)  # beyond: the last segment's slope
    assert fit.seconds(10.0) == pytest.approx(1e-3 - 990 * 1e-3 / 999e3)  # below: the first one's


def test_a_block_probed_on_tp_ranks_holds_its_collectives(tmp_path):
    """tp_blocks (probed on tp real ranks) replace the group-less block and its modelled tp all-reduces; the head's
    and the embedding's collectives stay modelled (they were not probed on ranks)."""
    from p3d.planner.step_time import stage_times

    overrides = ("model=tiny", "mesh=tp2")
    raw = fake_raw(*overrides)
    ranks = [{**r, "fwd_s": 3 * r["fwd_s"], "bwd_s": 3 * r["bwd_s"]} for r in raw["compute"]["blocks"] if r["tp"] == 2]
    plain = calibrated(fake_calibration(tmp_path, raw, "plain.json"), *overrides)
    grouped = {**raw, "compute": {**raw["compute"], "tp_blocks": ranks}}
    with_ranks = calibrated(fake_calibration(tmp_path, grouped, "ranks.json"), *overrides)
    lay = layout_of(plain)
    before, after = machine_of(plain).block(lay, False), machine_of(with_ranks).block(lay, False)
    assert before is not None and "tp" not in before
    assert after == {"fwd": 3 * before["fwd"], "bwd": 3 * before["bwd"], "rec": 0.0, "tp": 0.0}

    def times(cfg):
        return stage_times(cfg, lay, [s.params for s in predict(cfg).stages])[0]

    assert times(plain).tp_comm > times(with_ranks).tp_comm > 0  # the head's and the embedding's stay
    assert times(with_ranks).compute > times(plain).compute


def test_deepspeed_copies_at_the_probed_rate(tmp_path):
    """Where the calibration probed DeepSpeed's flatten / scale / copy back, its seconds per element are used (the
    loaded figure: dp2 takes both cores), not three passes at the copy rate."""
    from p3d.planner.step_time import dp_seconds

    raw = fake_raw(*TINY)
    raw["compute"].update(engine_copy_s_per_param=2e-9, loaded_engine_copy_s_per_param=5e-9)
    cfg = calibrated(fake_calibration(tmp_path, raw))
    lay = layout_of(cfg)
    st = predict(cfg).stages[0].params
    assert dp_seconds(cfg, lay, st) - ring(cfg, st.total * 4.0, 2, 2) == pytest.approx(5e-9 * st.total)


def test_deepspeed_reduce_probed_whole_on_real_ranks_replaces_its_parts(tmp_path):
    """Where the calibration timed DeepSpeed's ZeRO 0 reduce whole on n real ranks (``engine_reduce``), a dp2 plan's
    reduction is that fit at the stage's gradient bytes, in place of the all-reduce plus the copies; ZeRO 1 (its
    own reduce-scatter and gather) keeps the collectives."""
    from p3d.planner.step_time import dp_seconds

    raw = fake_raw(*TINY)
    raw["compute"].update(engine_copy_s_per_param=2e-9, loaded_engine_copy_s_per_param=5e-9)
    raw["collectives"]["fits"].append({"op": "engine_reduce", "n": 2, "latency_s": 0.01, "s_per_byte": 3e-9})
    path = fake_calibration(tmp_path, raw)
    cfg = calibrated(path)
    st = predict(cfg).stages[0].params
    assert dp_seconds(cfg, layout_of(cfg), st) == pytest.approx(0.01 + 3e-9 * st.total * 4.0)
    zero1 = calibrated(path, *TINY, "zero.stage=1")
    assert dp_seconds(zero1, layout_of(zero1), st) < 0.01 + 3e-9 * st.total * 4.0


def test_adamw_runs_at_the_loaded_rate_when_the_ranks_take_every_core(tmp_path):
    """AdamW streams its state through memory: where the layout's ranks take every core they step together, at the
    rate probed in ``cores`` copies at once (dp2 here on a host of 2 cores); fewer ranks than cores, alone."""
    from p3d.planner.step_time import optimizer_seconds

    path = fake_calibration(tmp_path, fake_raw(*TINY, cores=2))
    busy, idle = calibrated(path), calibrated(path, "model=tiny", "mesh=single")
    st = predict(busy).stages[0].params
    assert optimizer_seconds(busy, layout_of(busy), st) == pytest.approx(5e-9 * st.total)
    assert optimizer_seconds(idle, layout_of(idle), st) == pytest.approx(3e-9 * st.total)


def test_the_optimizer_probe_steps_tensors_of_the_model_s_shapes():
    """The vocab matrix where the stage's count holds it, then the block's weights; at least the count asked."""
    from p3d.train.probes import stage_tensors

    cfg = compose_config("model=tiny")
    m = cfg.model
    vocab = padded_vocab(m.vocab_size, 1) * m.hidden_size
    with_vocab = stage_tensors(cfg, vocab + 10, "cpu")
    assert with_vocab[0].shape == (padded_vocab(m.vocab_size, 1), m.hidden_size)
    assert with_vocab[1].shape == (m.hidden_size, m.hidden_size) and sum(t.numel() for t in with_vocab) >= vocab + 10
    block = [(m.hidden_size, m.hidden_size)] * 4 + [(m.ffn_hidden_size, m.hidden_size)] * 3
    whole = stage_tensors(cfg, vocab + sum(r * c for r, c in block), "cpu")  # the vocab, then a block in order
    assert [tuple(t.shape) for t in whole[1:8]] == block
    blocks = stage_tensors(cfg, vocab - 1, "cpu")
    assert {tuple(t.shape) for t in blocks} <= {(m.hidden_size, m.hidden_size), (m.ffn_hidden_size, m.hidden_size)}


def test_loaded_copies_start_each_probe_together(tmp_path):
    """A loaded copy waits at each probe until every copy has reached it, and stops waiting once one has failed."""
    from p3d.train.probes import FAILED, rendezvous

    rendezvous(None, "block0")  # alone: no barrier
    barrier = {"dir": str(tmp_path), "parties": 2}
    (tmp_path / "block0.1").touch()  # the other copy is there already
    rendezvous(barrier, "block0")
    assert len(list(tmp_path.glob("block0.*"))) == 2
    (tmp_path / FAILED).touch()
    with pytest.raises(RuntimeError, match="another loaded copy failed"):
        rendezvous(barrier, "head0")
