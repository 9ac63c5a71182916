"""Registries (distill.utils.registry): every kind of part lists its built-in parts, the config's choices come from
them, an unknown name is refused naming the registered ones, a part registered from one file of one's own
(``DISTILL_PLUGINS``) is selectable from the command line, and a method is checked by its class, not by the names
of its keys."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

METHODS_BUILT_IN = ["classifier", "clip", "consistency", "consistency_training", "diffusion", "feature_distillation",
                    "noisy_classifier", "progressive", "vae"]
STUDENTS_BUILT_IN = ["class_unet", "clip", "copy", "digit_classifier", "fresh", "lora", "lowrank", "moe_timestep",
                     "moe_token", "noisy_classifier", "pretrained", "pruned", "text_unet", "vae"]
ACCELERATORS_BUILT_IN = ["classifier", "deepcache", "forecast", "none"]
METRICS_BUILT_IN = ["fid", "kid", "clip_score", "prompt_accuracy", "fid_pixels", "kid_pixels", "fid_clip", "kid_clip"]


def run(args: list[str], plugins: str = "", **kwargs) -> subprocess.CompletedProcess:
    """``python <args>`` from the repository root with ``DISTILL_PLUGINS=plugins``, as a user runs it."""
    env = {**os.environ, "DISTILL_PLUGINS": plugins, **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          **kwargs)


# ---------------------------------------------------------------- the registries and the choices made of them


def test_every_registry_lists_its_built_in_parts():
    from distill.accelerate import ClassifierGuidance, DeepCache
    from distill.accelerate.registry import ACCELERATORS
    from distill.methods import METHODS
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.metrics.registry import METRICS, FIDMetric
    from distill.students import STUDENTS
    from distill.students.copies import lora_student
    from distill.students.moe import _check_moe

    assert set(METHODS_BUILT_IN) <= set(METHODS.names()) and METHODS["consistency"] is LatentConsistencyDistillation
    assert set(STUDENTS_BUILT_IN) <= set(STUDENTS.names()) and STUDENTS["lora"] is lora_student
    assert set(ACCELERATORS_BUILT_IN) <= set(ACCELERATORS.names())
    assert (ACCELERATORS["deepcache"], ACCELERATORS["classifier"]) == (DeepCache, ClassifierGuidance)
    assert METRICS.names()[:8] == METRICS_BUILT_IN and METRICS["fid"] is FIDMetric  # registration = column order
    assert STUDENTS.meta("moe_timestep") == {"choices": {"split": ("equal_step", "equal_snr")}, "routed": True,
                                             "check_config": _check_moe}


def test_every_student_builder_lives_in_distill_students():
    """The built-in student builders are registered by distill.students' modules or, for a world's own networks, by
    the modules that world lists (``distill.worlds``), and no module elsewhere in the package registers one."""
    import ast

    import distill
    from distill.students import STUDENTS

    assert STUDENTS.modules and all(m.startswith("distill.students.") for m in STUDENTS.modules), STUDENTS.modules
    built_in = {name: part for name, part in STUDENTS.items() if name in STUDENTS_BUILT_IN}
    assert sorted(built_in) == STUDENTS_BUILT_IN
    from distill.worlds import parts

    homes = (*STUDENTS.modules, *parts("student"))
    assert {name: part.__module__ for name, part in built_in.items() if part.__module__ not in homes} == {}
    package = Path(distill.__file__).parent
    registering = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "register" and isinstance(node.value, ast.Name)
                    and node.value.id == "STUDENTS"):
                registering.add(path.relative_to(package).parts[0])
    assert registering == {"students", "worlds"}


def test_every_registry_lists_the_model_families():
    base = pytest.importorskip("distill.families.base")
    assert {"sd", "class_unet"} <= set(base.FAMILIES.names())


def test_the_config_choices_are_the_registries():
    from distill.accelerate.registry import ACCELERATORS
    from distill.config.schema import SCHEMAS, AcceleratorKind, EvalConfig
    from distill.methods import METHODS
    from distill.students import STUDENTS

    # (a test module may register a part of its own after the schema was made: a subset, in the same order)
    for choices, registry, built_in in [(list(SCHEMAS["method"]), METHODS, METHODS_BUILT_IN),
                                        (list(SCHEMAS["student"]), STUDENTS, STUDENTS_BUILT_IN),
                                        ([kind.value for kind in AcceleratorKind], ACCELERATORS, ACCELERATORS_BUILT_IN)]:
        assert set(built_in) <= set(choices) <= set(registry.names()) and choices == sorted(choices)
    assert EvalConfig.metrics is None  # every registered metric; no list of names in the config
    for group in ("method", "student"):  # every option file starts from its registered part's schema
        for path in sorted((ROOT / "distill" / "conf" / group).glob("*.yaml")):
            bases = [line.strip(" -") for line in path.read_text().splitlines() if line.strip().startswith("- base_")]
            assert len(bases) == 1 and bases[0].removeprefix("base_") in SCHEMAS[group], (path.name, bases)


def test_the_schema_of_a_registered_part_is_its_signature_with_its_registered_choices():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from distill.config.schema import SCHEMAS

    lcm = OmegaConf.structured(SCHEMAS["method"]["consistency"])
    assert lcm._target_ == "distill.methods.consistency.LatentConsistencyDistillation"
    assert (lcm.num_ddim_timesteps, lcm.ema_decay, lcm.loss_type) == (50, 0.95, "pseudo_huber")
    assert not {"teacher", "student", "sampling"} & set(lcm)  # passed by the entry point
    with pytest.raises(ValidationError, match=r"expected one of \[l2, huber, pseudo_huber, pseudo_huber_elementwise\]"):
        lcm.loss_type = "l1"
    moe = OmegaConf.structured(SCHEMAS["student"]["moe_timestep"])
    assert moe._partial_ and not {"teacher_unet", "noise_scheduler"} & set(moe)  # made from the teacher
    assert not OmegaConf.structured(SCHEMAS["student"]["text_unet"]).get("_partial_", False)


# ---------------------------------------------------------------- unknown names


def test_an_unknown_name_is_refused_naming_the_registered_ones():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from distill.accelerate import make_accelerator
    from distill.accelerate.registry import ACCELERATORS
    from distill.config.schema import CONF, register_configs
    from distill.methods import METHODS
    from distill.metrics.eval_set import EvalSet

    with pytest.raises(KeyError, match=r"unknown method 'lcm2'; registered: \['classifier', 'clip', 'consistency'"):
        METHODS.get("lcm2")
    with pytest.raises(ValueError, match=r"accelerate.kind='cache' is unknown; use one of \['classifier', 'deepcache'"):
        make_accelerator("cache")
    with pytest.raises(ValueError, match=r"eval.metrics=\['fid', 'fdd'\] holds unknown \['fdd'\]; use some of "
                                         r"\['clip_score', 'coverage', 'fid', 'fid_clip'"):
        EvalSet("toy", prompts=["a"], metrics=["fid", "fdd"])
    # the command line: Hydra refuses a kind outside the registered ones at composition, naming them
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), \
            pytest.raises(ConfigCompositionException) as err:
        compose(config_name="evaluate", overrides=["accelerate.kind=cache"])
    kinds = ACCELERATORS.names()  # the built-in ones, and any a test module of this session registered
    assert set(ACCELERATORS_BUILT_IN) <= set(kinds)
    assert f"'cache', expected one of [{', '.join(kinds)}]" in str(err.value.__cause__)


def test_a_registered_accelerator_without_a_preset_file_is_a_preset_too():
    """``accelerators=[none,reuse]`` (a sweep) and the quality-cost callback name presets: a registered kind
    without a file of conf/accelerate is one with its defaults (it was refused, naming the files only)."""
    from distill.accelerate import accelerator_options, preset
    from tests.examples.toy_accelerator import ReuseOutput

    assert accelerator_options("reuse") == {"kind": "reuse", "options": {}}
    assert isinstance(preset("reuse"), ReuseOutput) and preset("reuse").interval == 2
    assert accelerator_options("deepcache")["options"]["interval"] == 3  # a preset file first
    with pytest.raises(ValueError, match=r"accelerator 'cache' is unknown; use one of the presets \['classifier', .*"
                                         r"or the registered kinds \['classifier', 'deepcache', 'fbcache', 'forecast', 'none'"):
        preset("cache")


def test_a_registered_accelerator_is_an_option_of_the_accelerate_group():
    """``accelerate=reuse`` (as ``method=key_twin``): a registered kind without a file of conf/accelerate is an
    option with its defaults; without the plugin it is no option (Hydra names the ones there are)."""
    code = ("import sys\nfrom hydra import compose, initialize_config_dir\n"
            "from distill.config.schema import CONF, register_configs\nregister_configs()\n"
            "with initialize_config_dir(config_dir=str(CONF), version_base='1.3'):\n"
            "    cfg = compose(config_name='evaluate', overrides=sys.argv[1:])\n"
            "print('composed:', cfg.accelerate.kind, dict(cfg.accelerate.options))\n")
    proc = run(["-c", code, "pipeline=x", "accelerate=reuse", "+accelerate.options.interval=3"],
               plugins="tests.examples.toy_accelerator")
    assert proc.returncode == 0 and "composed: reuse {'interval': 3}" in proc.stdout, proc.stderr[-3000:]
    without = run(["-c", code, "pipeline=x", "accelerate=reuse"])
    assert without.returncode == 1 and "Could not find 'accelerate/reuse'" in without.stderr


def test_a_part_registered_after_the_schemas_were_made_is_an_option_too():
    """A module that registers a student and a method after ``distill.config.schema`` was imported (a test module
    collected after one that imports the commands; a notebook that imports its own file late): ``register_configs``
    makes their schemas then, so ``student=<name>`` and ``method=<name>`` compose (they were missing: Hydra answered
    "Could not find 'student/tiny_generator'")."""
    code = ("import sys\nfrom hydra import compose, initialize_config_dir\n"
            "from distill.config.schema import CONF, STUDENT_SCHEMAS, register_configs\n"
            "assert 'tiny_generator' not in STUDENT_SCHEMAS\n"
            "import tests.examples.two_optimizer_method\nregister_configs()\n"
            "with initialize_config_dir(config_dir=str(CONF), version_base='1.3'):\n"
            "    cfg = compose(config_name='train', overrides=sys.argv[1:])\n"
            "print('composed:', cfg.student._target_, cfg.method._target_)\n")
    proc = run(["-c", code, "method=two_optimizer", "student=tiny_generator", "teacher=none"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("composed: tests.examples.two_optimizer_method.tiny_generator "
            "tests.examples.two_optimizer_method.TwoOptimizerMethod") in proc.stdout


def test_a_plugin_that_cannot_be_imported_is_named(monkeypatch, tmp_path):
    from distill.utils import registry

    monkeypatch.setenv("DISTILL_PLUGINS", " ,tests.examples.no_such_part")
    assert registry.plugin_modules() == ["tests.examples.no_such_part"]
    with pytest.raises(ImportError, match=r"DISTILL_PLUGINS=.* names 'tests.examples.no_such_part', which cannot be "
                                          r"imported \(No module named 'tests.examples.no_such_part'\)"):
        registry.load_plugins()
    # a plugin that is there but imports something that is not: the message says which of the two is missing
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "a_broken_plugin.py").write_text("import no_such_dependency_of_the_plugin\n")
    monkeypatch.setenv("DISTILL_PLUGINS", "a_broken_plugin")
    with pytest.raises(ImportError, match=r"the plugin 'a_broken_plugin' was found but an import in it failed "
                                          r"\(No module named 'no_such_dependency_of_the_plugin'\)"):
        registry.load_plugins()


def test_a_name_is_registered_once():
    from distill.utils.registry import Registry

    parts = Registry("widget")
    parts.register("a", colour="red")(int)
    parts.register("a")(int)  # the same part again (a module imported twice) is no conflict
    with pytest.raises(ValueError, match=r"widget 'a' is already registered by builtins.int; pick another name for "
                                         r"builtins.float, or replace it with @WIDGETS.register\('a', replace=True\)"):
        parts.register("a")(float)
    assert parts.names() == ["a"] and parts.name_of(int) == "a" and parts.name_of(float) is None
    assert parts.unregister("a") is int and len(parts) == 0
    # a replacement wins whichever comes first: a plugin is imported before the built-in module it replaces
    parts.register("b", replace=True)(float)
    assert parts.register("b")(int) is int and parts["b"] is float  # the built-in module, imported after
    parts.register("c")(int)
    parts.register("c", replace=True)(float)
    assert parts["c"] is float


def test_a_built_in_module_that_fails_to_import_fails_every_lookup():
    """A registry is loaded only once all its modules imported: a failed import is not remembered as a registry
    with the parts registered so far (an empty or partial list of choices, with no error the second time)."""
    from distill.utils.registry import Registry

    parts = Registry("family", modules=("tests.examples.no_such_part",))
    parts.register("sd")(int)
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="tests.examples.no_such_part"):
            parts.names()
    families = Registry("family")
    with pytest.raises(KeyError, match=r"unknown family 'flux'; registered: \[\]\. Register one with "
                                       r"@FAMILIES.register\('flux'\)"):
        families.get("flux")


# ---------------------------------------------------------------- a metric from one file, on the command line


@pytest.fixture
def toy_metric():
    """The plugin's metric class, imported in this process and unregistered after the test (other tests' tables
    hold the built-in metrics only)."""
    from distill.metrics.registry import METRICS
    from tests.examples.toy_metric import ToyMetric

    METRICS.register("toy")(ToyMetric)  # again, should an earlier test have removed it
    yield ToyMetric
    METRICS.unregister("toy")


def test_the_toy_metric_is_the_mean_brightness(toy_metric):
    from distill.metrics.registry import METRICS, Samples

    class EvalSet:
        fid_bootstrap = 20

    images = torch.linspace(-1, 1, 20).view(20, 1, 1, 1).expand(20, 1, 8, 8)  # brightness 0, 1/19, ..., 1
    assert METRICS["toy"] is toy_metric and METRICS.names()[-1] == "toy"  # a column after the built-in ones
    estimate = toy_metric(EvalSet(), seed=0)(Samples(images, ["a"] * 20, None, torch.zeros(20, dtype=torch.long)))
    assert estimate.value == pytest.approx(0.5, abs=1e-6)
    assert estimate.std == pytest.approx(torch.linspace(0, 1, 20).double().std().item() / 20 ** 0.5)
    assert len(estimate.replicates) == 20


def test_a_registered_metric_reaches_the_metric_sanity_suite(toy_metric):
    """The sanity suite measures with the registered metrics (it recomputed FID and KID by hand, and a metric of
    one's own was never measured there): the toy's rows are its mean brightness of the probes, by hand."""
    from distill.metrics.sanity import DEGRADATIONS, SanitySuite
    from tests.test_eval_set import instantiate_eval

    suite = SanitySuite(instantiate_eval("eval=digits", "eval.clip=null", cache_dir=None), max_images=60, seed=0)
    rows = suite.run({name: [0.2, 0.4] if name == "brightness" else [] for name in DEGRADATIONS})
    toy = {r["strength"]: r["value"] for r in rows if (r["space"], r["distance"]) == ("images", "toy")}
    by_hand = {s: ((suite.probes.double() + s).clamp(-1, 1).mean().item() + 1) / 2 for s in (0.0, 0.2, 0.4)}
    assert toy == pytest.approx(by_hand, abs=1e-6) and toy[0.0] < toy[0.2] < toy[0.4]  # float32 per image
    keys = {(r["space"], r["distance"]) for r in rows}  # the built-in metrics beside it, as before
    assert keys == {("feature", "fid"), ("feature", "kid"), ("classifier", "prompt_accuracy_drop"),
                    ("pixels", "fid"), ("pixels", "kid"), ("images", "toy"), ("feature", "precision_drop"),
                    ("feature", "coverage_drop")}


def test_a_registered_metric_reaches_the_hparams_dashboard(toy_metric):
    """The final quality-cost row's metrics in TensorBoard's HParams come from the registry (train.py kept its own
    list of names, without the toy); empty cells (metrics not measured) stay out."""
    from distill.train import final_hparams

    row = {"fid": "3.5", "fid_std": "0.25", "kid": "", "toy": "0.375", "toy_std": "0.125", "latency_s": "0.5",
           "nfe": "4", "model": "student"}
    assert final_hparams(row) == {"hparams/fid": 3.5, "hparams/fid_std": 0.25, "hparams/toy": 0.375,
                                  "hparams/toy_std": 0.125, "hparams/latency_s": 0.5, "hparams/nfe": 4.0}
    assert final_hparams(None) == {}


def test_a_metric_from_one_file_is_selectable_and_reaches_the_table(tmp_path):
    """``DISTILL_PLUGINS=tests.examples.toy_metric python -m distill.evaluate ... eval.metrics=[fid,toy]``: the
    plugin's column stands in the CSV, the table, the console line and the real-data floor."""
    from distill.metrics.report import decode_replicates
    from tests.sd_tiny import write_tiny_sd

    pipe, out = write_tiny_sd(tmp_path / "pipe"), tmp_path / "eval"
    proc = run(["-m", "distill.evaluate", f"pipeline={pipe}", "scheduler=ddim", "steps=[1]", "num_per_class=2",
                "cost_repeats=1", "guidance_scale=1", "grids=false", "eval.metrics=[fid,toy]", f"hydra.run.dir={out}"],
               plugins="tests.examples.toy_metric", env={"HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(csv.DictReader(open(out / "quality_cost.csv")))
    assert 0 < float(row["toy"]) < 1 and 0 < float(row["toy_std"]) < 0.05 and row["kid"] == ""  # not selected
    replicates = decode_replicates(row["toy_replicates"])
    assert len(replicates) == 50 and abs(sum(replicates) / 50 - float(row["toy"])) < 3 * float(row["toy_std"])
    table = (out / "table.md").read_text()
    assert "| fid | toy |" in table and "bright(train, held-out) = " in table
    assert "bright=" in proc.stdout + proc.stderr
    assert json.loads((out / "protocol.json").read_text())["metrics"] == ["fid", "toy"]
    # the cross-run report: with the plugin the column is there; without it, it is named as left out (not silent)
    for plugins, kept in (("tests.examples.toy_metric", True), ("", False)):
        report = run(["-m", "distill.report", str(out), "--out", str(tmp_path / f"report{kept}")], plugins=plugins)
        assert report.returncode == 0, report.stderr[-3000:]
        header = next(csv.reader(open(tmp_path / f"report{kept}" / "report.csv")))
        assert ("toy" in header and "toy_replicates" in header) == kept
        assert ("holds metric(s) ['toy'] that no registered metric names" in report.stderr) != kept
    without = run(["-m", "distill.evaluate", f"pipeline={pipe}", "eval.metrics=[fid,toy]", f"hydra.run.dir={out}2"],
                  env={"HOME": str(tmp_path)})
    assert without.returncode == 2 and "holds unknown ['toy']" in without.stderr


# ---------------------------------------------------------------- a method is checked by its class


def test_lcms_checks_stay_with_lcm(compose):
    from distill.config.validate import ConfigError, validate

    for override, needle in [("method.num_ddim_timesteps=0", "method.num_ddim_timesteps=0 must be >= 1"),
                             ("method.ema_decay=1.5", r"method.ema_decay=1.5 must be in \[0, 1\)"),
                             ("method.guidance_scale_min=1.5", None)]:
        cfg = compose("+exp=consistency", override)
        if needle is None:
            validate(cfg)
        else:
            with pytest.raises(ConfigError, match=needle):
                validate(cfg)


COMPOSE_AND_VALIDATE = """
import sys
from hydra import compose, initialize_config_dir
from distill.config.resolvers import register_resolvers
from distill.config.schema import CONF, register_configs
from distill.config.validate import ConfigError, validate
register_configs()
register_resolvers()
with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[1:])
try:
    validate(cfg)
except ConfigError as err:
    print("refused:", err)
else:
    print("valid:", cfg.method._target_, dict(cfg.method))
"""


def test_keys_named_like_lcms_on_another_method_get_its_own_checks_only():
    """``key_twin`` (tests/examples/key_twin_method.py) has LCM's key names with values LCM refuses: it is valid; its
    own check refuses what it refuses; the command line selects it by its registered name."""
    twin = ["method=key_twin", "method.num_ddim_timesteps=0", "method.sigma_data=0.7", "method.vae=0.25"]
    proc = run(["-c", COMPOSE_AND_VALIDATE, *twin], plugins="tests.examples.key_twin_method")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "valid: tests.examples.key_twin_method.KeyTwin" in proc.stdout and "'ema_decay': 1.5" in proc.stdout
    assert "'vae': 0.25" in proc.stdout  # a number under the name of latent diffusion's VAE (was an AttributeError)
    proc = run(["-m", "distill.train", *twin, "method.ema_decay=0.5"], plugins="tests.examples.key_twin_method")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "method.ema_decay=0.5 is key_twin's growth factor: it must be >= 1" in proc.stderr
    unknown = run(["-m", "distill.train", *twin])  # not loaded: no such option
    assert unknown.returncode == 1 and "key_twin" in unknown.stderr
