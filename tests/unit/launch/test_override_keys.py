"""Issue 64, items 18 to 23: what Hydra reports in six or seven lines, or a traceback, is one line before it runs, with
a fix the same command accepts: a misspelt key (the nearest fields named), a group option that does not exist, a
comma list given to one run, an item of a list of mappings with a key its type lacks; and refusals whose value is a
list keep the list whole."""

from __future__ import annotations

import sys

import pytest

from p3d import exit_codes
from p3d.config.fields import closest_options, known_key, schema_options
from p3d.launch.compose import CONFIG_PATH, config_groups, insert_source, message_field, run_hydra
from p3d.launch.override_keys import refused_key
from p3d.launch.override_types import wrong_type
from tests.helpers.runs import compose


def _refused(*argv: str) -> str | None:
    from pathlib import Path

    return refused_key(list(argv), Path(CONFIG_PATH), config_groups())


REFUSED = {
    "trian.steps=1": "trian.steps=1 (command line) is not a p3d option; did you mean train.steps? try train.steps=1",
    "+train.step=5": "train.step=5 (command line) is not a p3d option; did you mean train.steps? try train.steps=5",
    "train.seq_len=32": "train.seq_len=32 (command line) is not a p3d option; did you mean model.seq_len? try "
    "model.seq_len=32",
    "train.bogus=1": "train.bogus=1 (command line) is not a p3d option; remove it (p3d-train --cfg job lists the "
    "options)",
    "~train.bogus": "~train.bogus (command line) is not a p3d option; remove it (p3d-train --cfg job lists the "
    "options)",
    "mesh=tp2_pp3": "mesh=tp2_pp3 (command line) is not an option of the mesh group; did you mean tp2_pp4? try "
    "mesh=tp2_pp4",
    "mesh=dp2,tp2": "mesh=dp2,tp2 (command line) sweeps over several options; add -m to run one run per option",
    "data.path=a.jsonl,b.jsonl": "data.path=a.jsonl,b.jsonl (command line) has a comma outside quotes, which Hydra "
    "reads as a sweep; to give one value that holds commas, quote it for Hydra: 'data.path=\"a.jsonl,b.jsonl\"' "
    "(or add -m to sweep)",
}


@pytest.mark.parametrize("override", REFUSED)
def test_a_key_or_option_p3d_does_not_know_is_one_line_with_a_fix_hydra_composes(override):
    refused = _refused("data=files", override)
    assert refused == REFUSED[override]
    if "try " in refused:
        fix = refused.rsplit("try ", 1)[1]
        assert _refused(fix) is None and wrong_type([fix]) is None
        compose(fix)
    elif "quote it for Hydra: " in refused:
        fix = refused.split("quote it for Hydra: ", 1)[1].split(" (or", 1)[0].strip("'")
        assert compose("data=files", fix).data.path == "a.jsonl,b.jsonl"  # one value, commas kept


def test_what_p3d_and_hydra_take_is_not_refused():
    fine = [
        "train.steps=3", "model.moe=null", "model=moe_tiny", "model.moe.top_k=1", "cluster.groups=[]",
        "cluster.groups.0.nodes=2", "hydra.run.dir=x", "hydra/launcher=basic", "~train.resume", "dry_run=true",
        "format=json", "data.path='a,b'", "-m", "mesh=dp2,tp2", "train.lr=1e-3,3e-4", "data.mix=[]",
    ]  # fmt: skip
    assert _refused(*fine) is None


def test_every_schema_field_is_known_and_the_nearest_is_found():
    options = schema_options()
    assert {"train.steps", "model.moe.top_k", "cluster.groups", "dry_run", "data.mix"} <= set(options)
    assert all(known_key(o) for o in options) and not known_key("train.steps.x") and not known_key("trian")
    assert closest_options("schedule.micro_batch") == ["schedule.micro_batch_size"]


def test_a_misspelt_key_is_refused_before_hydra_runs(monkeypatch, capsys):
    """Hydra's 'Could not override ... To append to your config use +train.bogus=1 ... HYDRA_FULL_ERROR' block
    suggested a + form the schema refuses too."""
    ran = []
    monkeypatch.setattr(sys, "argv", ["p3d-train", "trian.steps=1"])
    assert run_hydra(ran.append) == exit_codes.CONFIG_ERROR and not ran
    assert capsys.readouterr().err == (
        "p3d: config error: trian.steps=1 (command line) is not a p3d option; did you mean train.steps? try "
        "train.steps=1\n"
    )


def test_a_list_item_with_a_key_its_type_lacks_is_one_line():
    """cluster.groups='[{device: cpu, nodes: 1, bogus: 3}, ...]' gave OmegaConf's ConfigKeyError and a traceback."""
    refused = wrong_type(["cluster.groups=[{device: cpu, nodes: 1, bogus: 3}, {device: cpu, nodes: 1}]"])
    assert refused is not None and refused.startswith(
        "cluster.groups=[{device: cpu, nodes: 1, bogus: 3}, {device: cpu, nodes: 1}] (command line): bogus is not a "
        "field of its items (a list of {device: a string, nodes: an integer,"
    )
    assert refused.endswith("; drop bogus") and "\n" not in refused


def test_a_refusal_whose_value_is_a_list_names_its_source_after_the_whole_list():
    """schedule.stage_blocks=[3, (command line) 2] holds 5 blocks: the source went after the list's first item."""
    message = "schedule.stage_blocks=[3, 2] holds 5 blocks, model.n_layers=4; try schedule.stage_blocks=[2,2]"
    assert message_field(message) == "schedule.stage_blocks"
    assert insert_source(message, "command line").startswith("schedule.stage_blocks=[3, 2] (command line) holds 5")
    given = "cluster.groups=[{device: cpu, nodes: 1}] must ..."
    assert insert_source(given, "x") == "cluster.groups=[{device: cpu, nodes: 1}] (x) must ..."
