"""`multihead doctor`: kernel state, CPU description and measured peaks."""

from __future__ import annotations

from multihead import _machine, cli
from multihead.backends import fused
from multihead.bench import doctor


def test_doctor_reports_the_kernel_and_the_cpu(capsys):
    built = fused.build_error() is None
    assert cli.main(["doctor", "--no-measure"]) == (0 if built else 1)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"fused kernel: built, from {fused.origin()}"
        if built
        else f"fused kernel: not built: {fused.build_error()}"
    )
    assert out[1].startswith("cpu: ") and len(out[1]) > len("cpu: ")
    assert out[2].startswith("instruction sets: ")
    assert not any(line.startswith("matmul peak") for line in out)


def test_doctor_says_why_the_kernel_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(fused._LOADER, "module", None)
    monkeypatch.setattr(fused._LOADER, "error", "the C++ kernel cannot be built: no C++ compiler")
    assert cli.main(["doctor", "--no-measure"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "fused kernel: not built: the C++ kernel cannot be built: no C++ compiler"


def test_instruction_sets_come_from_cpuinfo_flags(monkeypatch):
    monkeypatch.setattr(_machine, "cpu_info", lambda: ("Test CPU", {"avx2", "fma", "sse4_2"}))
    d = doctor.diagnose(measure=False)
    assert d.cpu == "Test CPU"
    assert d.instruction_sets == ["avx2", "fma"]


def test_peaks_are_measured():
    d = doctor.diagnose(measure=True, size=64)
    assert set(d.peak_gflops) == {"float32", "bfloat16"}
    assert all(g > 0 for g in d.peak_gflops.values())
