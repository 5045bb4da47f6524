"""``p3d-plan``: memory per GPU and step time of a config, composed exactly as p3d-train composes it.

    p3d-plan mesh=tp8_pp8 model=llama70b cluster.device=h100_sxm cluster.nodes=8
    p3d-plan model=llama3_1_405b mesh=auto cluster.device=h100_sxm cluster.nodes=1024 format=json
    p3d-plan -m mesh=tp2_pp2,tp4_pp2 model=small          # one plan per point

Exit status: 0 a plan was made (whether or not it fits: read ``fits``); 2 a config error, one line,
before anything else. Never starts a worker; imports neither torch nor deepspeed.
"""

from __future__ import annotations

import json
import os
import sys

from omegaconf import DictConfig

from p3d import exit_codes
from p3d.launch.check import typed_config
from p3d.launch.compose import config_error, is_multirun
from p3d.layout.run_plan import P3DConfigError
from p3d.layout.schedule_rules import check_split


def plan_task(cfg_node: DictConfig) -> int:
    from p3d.planner.search import predict

    try:
        cfg = typed_config(cfg_node, resolve_auto=False)  # predict() ranks the layouts itself
        if cfg.mesh.name != "auto":  # a split it cannot model is refused as p3d-train refuses it (others: warnings)
            check_split(cfg)
        report = predict(cfg)
    except P3DConfigError as exc:  # 'mesh.tp=4 (mesh/tp4.yaml) ...', as p3d-train says it
        return config_error(str(exc), is_multirun())
    text = json.dumps(report.to_json(), indent=2) if cfg.format == "json" else report.render()
    try:
        print(text, flush=True)
    except BrokenPipeError:  # p3d-plan ... | head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return exit_codes.OK
