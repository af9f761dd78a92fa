"""The configuration front end (docs/config.md): the model and its rules (:mod:`.model`), file
loading (:mod:`.files`), argparse flags (:mod:`.flags`) and error wording (:mod:`.errors`).

Importing it does not import torch: ``lossagg check`` and config-only tools stay light.
"""

from lossagg.config.errors import ConfigError
from lossagg.config.flags import FLAGS, add_loss_aggregation_args, config_from_args
from lossagg.config.model import LossAggregationConfig, ModeName

__all__ = [
    "FLAGS",
    "ConfigError",
    "ModeName",
    "LossAggregationConfig",
    "add_loss_aggregation_args",
    "config_from_args",
]
