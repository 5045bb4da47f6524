"""Which rank the local launcher names when several workers die of one failure (p3d.jobs.local)."""

from __future__ import annotations

from p3d.jobs import local

PEER_LOST = (
    "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1944. "
    "This is typically caused by a remote worker crashing."
)
OWN_ERROR = "[rank 1] worker failed: CheckpointError: checkpoint file x cannot be read (...); resume an earlier one"


def _logs(tmp_path, **lines):
    for rank, text in lines.items():
        (tmp_path / f"{rank}.log").write_text(f"[{rank}] placement: host vm\n{text}\n")
    return tmp_path


def test_peers_that_lost_the_failed_rank_are_not_its_cause_and_make_the_launcher_wait(tmp_path):
    logs = _logs(tmp_path, rank0=PEER_LOST, rank1=OWN_ERROR, rank2=PEER_LOST)
    # rank 1 raised, closed its connections and is still exiting: only its peers are dead so far
    assert local._only_peers_died([(0, 1), (2, 1)], logs)
    # once it has exited too, it is the one named, though rank 0 is lower
    assert not local._only_peers_died([(0, 1), (1, 1), (2, 1)], logs)
    assert local._first_cause([(0, 1), (1, 1), (2, 1)], logs) == (1, 1)


def test_a_signal_death_is_the_cause_and_no_one_waits_for_another(tmp_path):
    logs = _logs(tmp_path, rank0=PEER_LOST, rank3="")
    assert not local._only_peers_died([(0, 1), (3, -9)], logs)
    assert local._first_cause([(0, 1), (3, -9)], logs) == (3, -9)
