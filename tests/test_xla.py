"""trainer=tpu: the config, its refusals and the device rule. The XLA run itself needs torch 2.9 + torch-xla in an
environment of its own: ``bash launch/xla_cpu_check.sh`` (its recorded output is in BENCHMARKS.md)."""

import pytest

from distill.config.validate import ConfigError, validate
from distill.utils import xla


def test_tpu_trainer_composes_to_the_pjrt_accelerator(compose):
    cfg = compose("+exp=consistency", "trainer=tpu")
    assert cfg.trainer.accelerator._target_ == "distill.utils.xla.PJRTAccelerator"
    assert cfg.trainer.devices == "auto"
    validate(cfg)


def test_tpu_refuses_a_mixture_of_experts_before_any_compute(compose):
    cfg = compose("+exp=consistency", "trainer=tpu", "student=moe_timestep")
    with pytest.raises(ConfigError, match="trainer=tpu with student .*moe.*data-dependent shapes"):
        validate(cfg)


def test_device_rule_is_one_all_or_one_index(monkeypatch):
    monkeypatch.setattr(xla.PJRTAccelerator, "auto_device_count", staticmethod(lambda: 4))
    assert xla._parse("auto") == 4 and xla._parse(1) == 1 and xla._parse("4") == 4 and xla._parse([2]) == [2]
    for bad in (2, [4], [0, 1]):
        with pytest.raises(ValueError, match=r"trainer.devices=.*XLA runs on 1 device or all 4"):
            xla._parse(bad)


def test_without_torch_xla_no_xla_device_is_available():
    pytest.importorskip("lightning")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        assert xla.PJRTAccelerator.auto_device_count() == 0 and not xla.PJRTAccelerator.is_available()
    else:
        pytest.skip("torch_xla is installed here")
