"""p3d-plan's per-rank memory against a cp run's measured ``peak_mem_gb`` (issue 52: within 15 %).

The runs use ``train.host_memory=release`` (p3d.train.host_memory): freed blocks go back to the kernel, so the
CPU peak RSS is the live bytes' peak, the counterpart of CUDA's ``max_memory_allocated`` that the planner predicts.
Under the default ``keep`` the heap's freed holes stay resident and the same runs read 20-27 % above the plan
(docs/benchmarks.md, Context parallelism: memory), which is what this test would catch if the workers' policy or
the planner's count drifted apart. The default tier runs the one case that ``keep`` fails (cp2 at 8,192 tokens:
plan / peak 0.80 under keep, 1.00 under release, 2026-12-05); the slow tier adds the held-out length.
"""

from __future__ import annotations

import pytest

from p3d.planner import predict
from p3d.train.metrics import read_metrics
from tests.helpers.runs import output_tail, p3d_train, typed
from tests.helpers.tiers import with_slow

BOUND = 0.15  # the issue's: p3d-plan within 15 % of the measured peak
COMMAND = ("mesh=single", "schedule.global_batch_size=2", "schedule.micro_batch_size=1", "train.steps=2")
CASES = {"s8192-cp2": (8192, 2), "s16384-cp1": (16384, 1), "s16384-cp4": (16384, 4)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", with_slow(CASES, slow=["s16384-cp1", "s16384-cp4"]))
def test_p3d_plan_predicts_a_cp_runs_peak_memory(tmp_path, case):
    seq_len, cp = CASES[case]
    overrides = (*COMMAND, f"model.seq_len={seq_len}", f"mesh.cp={cp}", "train.host_memory=release")
    proc = p3d_train(f"run.dir={tmp_path}", *overrides, timeout=280)
    assert proc.returncode == 0, output_tail(proc)
    measured = max(r["peak_mem_gb"] for r in read_metrics(tmp_path))
    planned = predict(typed(*overrides)[0]).worst.total / 1e9
    assert abs(planned / measured - 1) <= BOUND, f"p3d-plan {planned:.3f} GB, measured peak {measured:.3f} GB"
