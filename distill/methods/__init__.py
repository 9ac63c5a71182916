"""One LightningModule per objective; the math they call lives in distill.diffusion.

``METHODS`` holds each method class under the name of its config option (``method=consistency``), registered
where the class is defined: ``@METHODS.register("consistency", choices={"loss_type": CONSISTENCY_LOSSES})``, with
``choices`` the fixed values of a string argument (the config refuses any other, naming them). The config's
schema of each method is generated from its signature (``distill.config.builds.registered``), and a method checks
what a schema cannot express in its classmethod ``check_config(cfg)`` (``distill.config.validate`` calls it for
the class that ``method._target_`` names; it raises ``ValueError`` naming the key and the fix).
"""

from distill.utils.registry import Registry

# the worlds' asset trainers are methods too: the registry adds the modules each world lists (distill.worlds)
METHODS = Registry("method", modules=(
    "distill.methods.diffusion", "distill.methods.consistency", "distill.methods.consistency_training",
    "distill.methods.progressive", "distill.methods.feature_distillation", "distill.methods.flow_matching",
    "distill.methods.dmd2", "distill.methods.scm", "distill.methods.meanflow",
    "distill.methods.rcm"))
