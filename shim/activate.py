"""What the shim does when a Python process starts with ``JITCKPT_DIR`` set.

Only cheap, standard-library work happens here (a pid file, a few post-import
hooks); everything that needs torch or transformers waits until the user's
program imports them.
"""

from __future__ import annotations

from . import config as shim_config
from . import launcher, pids
from .exitstatus import STATUS
from .hooks import when_imported
from .log import failed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType

    from .config import ShimConfig

HF_TRAINER_MODULE = "transformers.trainer"
LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
TORCH_DISTRIBUTED_MODULE = "torch.distributed"
TORCH_MODULE = "torch"
ACCELERATE_DATA_MODULE = "accelerate.data_loader"
ACCELERATOR_MODULE = "accelerate.accelerator"
STATEFUL_LOADER_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"
FABRIC_MODULES = ("lightning.fabric.fabric", "lightning_fabric.fabric")
TORCHTITAN_TRAINER_MODULE = "torchtitan.trainer"
# Where the save_pretrained a plain loop's final model may be written with is defined.
SAVE_PRETRAINED_MODULES = ("transformers.modeling_utils", "transformers.tokenization_utils_base")


def _on_hf_trainer(config: ShimConfig) -> None:
    def hook(module: ModuleType) -> None:
        from .frameworks.hf import trainer as hf

        hf.install(module, config)

    when_imported(HF_TRAINER_MODULE, hook)


def _on_lightning(config: ShimConfig) -> None:
    def hook(module: ModuleType) -> None:
        from .frameworks.lightning import trainer as lightning

        lightning.install(module, config)

    for name in LIGHTNING_PACKAGES:
        when_imported(name, hook)


def _on_torchtitan(config: ShimConfig) -> None:
    def hook(module: ModuleType) -> None:
        from .frameworks.torchtitan import trainer as torchtitan

        torchtitan.install(module, config)

    when_imported(TORCHTITAN_TRAINER_MODULE, hook)


def _on_torch_distributed(config: ShimConfig) -> None:
    def hook(module: ModuleType) -> None:
        from . import glooexit, lease, watcher

        glooexit.install()
        if not pids.is_multiprocessing_child():
            lease.take(config.socket_path)  # a launcher or a training process from here on
        watcher.start(config)

    when_imported(TORCH_DISTRIBUTED_MODULE, hook)


def _on_torch(config: ShimConfig) -> None:
    def hook(module: ModuleType) -> None:
        from .frameworks.plain import loop as plainloop

        plainloop.install(module, config)

    def accelerate(module: ModuleType) -> None:
        from .frameworks.plain import loop as plainloop

        plainloop.install_accelerate(module)

    def accelerator(module: ModuleType) -> None:
        from .frameworks.plain import loop as plainloop

        plainloop.install_accelerator(module)

    def fabric(module: ModuleType) -> None:
        from . import finalsaves
        from .frameworks.fabric import strategies

        strategies.install(module)
        finalsaves.watch_fabric_save(module)

    def stateful_loader(module: ModuleType) -> None:
        from .frameworks.plain import loop as plainloop

        plainloop.install_stateful_loader(module)

    def save_pretrained(module: ModuleType) -> None:
        from . import finalsaves

        finalsaves.watch_save_pretrained(module)

    when_imported(TORCH_MODULE, hook)
    when_imported(ACCELERATE_DATA_MODULE, accelerate)
    when_imported(ACCELERATOR_MODULE, accelerator)
    when_imported(STATEFUL_LOADER_MODULE, stateful_loader)
    for name in FABRIC_MODULES:
        when_imported(name, fabric)
    for name in SAVE_PRETRAINED_MODULES:
        when_imported(name, save_pretrained)


def activate() -> None:
    """Set the shim up in this process; never raises."""
    try:
        config = shim_config.from_env()
        if config is None:
            return
        if not pids.is_multiprocessing_child():
            pids.register(config.pids_dir)
        launcher.install(config)
        STATUS.install()  # from the start: a script may bind sys.exit before any Trainer exists
        _on_hf_trainer(config)
        _on_lightning(config)
        _on_torchtitan(config)
        _on_torch_distributed(config)
        _on_torch(config)
    except Exception as exc:
        failed("jitckpt shim activation", exc)
