"""The threads a process runs with (exactspec/cores.py): the cores its affinity mask and its cgroup's CPU quota allow,
``--threads`` refused below 1 and capped above them in one line, never handed to C as given."""

from __future__ import annotations

import os

import pytest
import torch

from exactspec import cores
from exactspec.errors import UsageError


def test_a_cgroups_quota_is_read_from_either_version(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # cgroup v2: 1.5 CPUs
    assert cores.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no limit
    assert cores.cgroup_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.cgroup_quota(v1) == 2.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's no limit
    assert cores.cgroup_quota(v1) is None
    assert cores.cgroup_quota(tmp_path / "none") is None


def test_the_usable_cores_are_the_affinity_masks_at_most_the_quota_rounded_up(monkeypatch):
    mask = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cores, "cgroup_quota", lambda: None)
    assert cores.usable_cores() == mask
    monkeypatch.setattr(cores, "cgroup_quota", lambda: 0.5)
    assert cores.usable_cores() == 1
    monkeypatch.setattr(cores, "cgroup_quota", lambda: mask + 10.0)
    assert cores.usable_cores() == mask


def test_the_usable_memory_is_the_machines_at_most_the_cgroups_limit_from_either_version(tmp_path):
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cores.usable_memory(tmp_path / "none") == machine and cores.cgroup_memory_limit(tmp_path / "none") is None
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2: no limit
    assert cores.cgroup_memory_limit(tmp_path) is None and cores.usable_memory(tmp_path) == machine
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    assert cores.usable_memory(tmp_path) == min(machine, 1 << 30)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{machine * 4}\n")  # v1's "no limit": a huge number
    assert cores.cgroup_memory_limit(v1) == machine * 4 and cores.usable_memory(v1) == machine


def test_threads_above_the_usable_cores_are_capped_in_one_line_and_below_one_refused(monkeypatch, caplog):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    with caplog.at_level("WARNING", logger="exactspec.notice"):
        assert cores.thread_count(100000) == 2
    assert [r.getMessage() for r in caplog.records] == ["--threads 100000: this process may run 2 at once; using 2"]
    assert cores.thread_count(1) == 1 and cores.thread_count(None) == 2
    for wrong in (0, -3):
        with pytest.raises(UsageError, match=f"threads must be >= 1, got {wrong}"):
            cores.thread_count(wrong)


def test_generate_with_a_hundred_thousand_threads_runs_on_the_cores_there_are(capsys, tmp_path):
    """It crashed in C (exit -11, nothing printed): PyTorch's OpenMP runtime was asked for 100,000 threads."""
    from test_cli import run_cli
    from tiny import save_with_tokenizer, tiny_llama

    model = save_with_tokenizer(tiny_llama(seed=0), tmp_path / "tiny")
    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, "generate", "w3 w4", "--model", str(model), "--max-new-tokens", "4",
                                 "--threads", "100000", "--backend", "lean", "--dtype", "float32")
        assert code == 0, err
        assert f"--threads 100000: this process may run {cores.usable_cores()} at once" in err
        assert torch.get_num_threads() == cores.usable_cores()
        code, out, err = run_cli(capsys, "generate", "w3 w4", "--model", str(model), "--threads", "0")
        assert code == 2 and err.strip() == "exactspec: error: threads must be >= 1, got 0"
    finally:
        torch.set_num_threads(before)


# --- the fused team's size, by its passes' times ---------------------------------------------------------------


def run_team(team, seconds_on, passes: int) -> list[int]:
    """``passes`` one-position passes, each taking ``seconds_on(pass, threads)``; the size each ran on."""
    sizes = []
    for step in range(passes):
        size = team.choose()
        team.observe(size, seconds_on(step, size))
        sizes.append(size)
    return sizes


def test_on_a_quiet_machine_the_team_runs_on_every_thread_but_for_rare_tries():
    from exactspec.backends.native import TeamSize

    team = TeamSize(2)
    sizes = run_team(team, lambda step, size: {1: 1.4, 2: 1.0}[size], 2048)
    assert sizes[0] == 2 and sizes.count(1) <= 1 + 2048 // (4 * team.probe_every)  # one try in 256 after the first


def test_a_busy_core_moves_the_team_to_fewer_threads_and_a_quiet_one_back():
    """Two threads slowed 3x by another process from pass 100 to 400 (one thread: 1.4x the quiet pair): within
    SLOWED_PROBE passes and one try the team runs on one thread; within probe_every passes of the machine quieting
    it is back on two. A process started on the busy machine finds one thread after its first try."""
    from exactspec.backends.native import TeamSize

    def busy_between(first, last):
        return lambda step, size: 1.4 if size == 1 else (3.0 if first <= step < last else 1.0)

    team = TeamSize(2)
    sizes = run_team(team, busy_between(100, 400), 600)
    switched = 100 + sizes[100:].index(1)
    assert switched <= 100 + TeamSize.SLOWED_PROBE + 1 and set(sizes[switched + 1 : 400]) == {1, 2}
    assert sizes[switched + 1 : 400].count(2) <= (400 - switched) // team.probe_every + 1  # tries of two only
    back = 400 + sizes[400:].index(2)
    assert back <= 400 + team.probe_every and sizes[back + 1 :].count(1) <= 1
    started_busy = run_team(TeamSize(2), busy_between(0, 100), 100)
    assert started_busy[TeamSize.SLOWED_PROBE + 1 :].count(2) <= 100 // team.probe_every + 1


def test_a_step_that_slows_as_the_context_grows_brings_few_tries():
    """On a quiet machine a decoding step slows as the context grows (attention over more keys): here 3x over 1,000
    steps. A try of one thread fewer comes each time the step is 1.5x slower than at the last try and one step in
    256, not every few steps (the mark of a slowing is set anew at each try)."""
    import math

    from exactspec.backends.native import TeamSize

    team = TeamSize(2)
    sizes = run_team(team, lambda step, size: (1.0 + 2.0 * step / 1000) * (1.4 if size == 1 else 1.0), 1000)
    assert sizes.count(1) <= 1 + 1000 // (4 * team.probe_every) + math.ceil(math.log(3) / math.log(TeamSize.SLOWED))
