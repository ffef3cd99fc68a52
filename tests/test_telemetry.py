"""Provenance on every row: the commit a copied tree says it is wins over a stale .git."""
from forge_bench import telemetry


def test_explicit_commit_wins_over_git(monkeypatch):
    telemetry.git_info.cache_clear()
    monkeypatch.setenv(telemetry.GIT_COMMIT_ENV, "abc1234")
    try:
        assert telemetry.git_info() == {"git_commit": "abc1234", "source_dirty": None}
    finally:
        telemetry.git_info.cache_clear()


def test_without_the_variable_git_head_is_used(monkeypatch):
    telemetry.git_info.cache_clear()
    monkeypatch.delenv(telemetry.GIT_COMMIT_ENV, raising=False)
    try:
        info = telemetry.git_info()
        head = telemetry._git("rev-parse", "HEAD")
        assert info["git_commit"] == (head.strip() if head else None)
    finally:
        telemetry.git_info.cache_clear()


def test_source_hash_is_stable_hex():
    value = telemetry.source_hash()
    assert len(value) == 16 and int(value, 16) >= 0 and value == telemetry.source_hash()


def test_boot_id_reads_the_kernel_file_and_tolerates_its_absence(tmp_path):
    boot_file = tmp_path / "boot_id"
    boot_file.write_text("6f1c0d1e-aaaa-bbbb-cccc-0123456789ab\n")
    assert telemetry.boot_id(boot_file) == "6f1c0d1e-aaaa-bbbb-cccc-0123456789ab"
    assert telemetry.boot_id(tmp_path / "missing") is None


def test_window_energy_is_per_step_and_per_second():
    from forge_bench.telemetry import window_energy
    assert window_energy({"energy_j": 1000.0}, {"energy_j": 1690.0}, seconds=1.0, steps=10) == {
        "energy_j_per_step": 69.0, "power_w_mean": 690.0}


def test_window_energy_is_empty_without_a_usable_counter():
    from forge_bench.telemetry import window_energy
    assert window_energy({"energy_j": None}, {"energy_j": 5.0}, 1.0, 10) == {}       # counter not read
    assert window_energy({}, {}, 1.0, 10) == {}                                        # CPU / no NVML
    assert window_energy({"energy_j": 9.0}, {"energy_j": 5.0}, 1.0, 10) == {}        # counter reset (driver reload)
    assert window_energy({"energy_j": 1.0}, {"energy_j": 5.0}, 0.0, 10) == {}
