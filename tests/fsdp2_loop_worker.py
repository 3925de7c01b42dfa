"""Run by tests/test_fsdp.py under ``accelerate launch --config_file <recipes/accelerate/fsdp2.yaml, 2 processes>``
on CPU: ``draftsmith train`` (cli.dispatch -> train/loop.py) for each recipe file given, in turn, in one launch.

accelerate shards on GPUs only: on CPU it turns the config's FSDP into DDP over gloo (MULTI_CPU). The one change
made here is that choice: where the launcher asked for FSDP (ACCELERATE_USE_FSDP, set from the config) and the
accelerator came up MULTI_CPU, its state says FSDP with the plugin accelerate built from the config, so
``prepare`` applies FSDP2's ``fully_shard`` over gloo exactly as on GPUs. A DraftsmithError is printed as the CLI
prints it (one line) and the next recipe runs; any other exception fails the launch."""

from __future__ import annotations

import os
import sys

import accelerate.state as state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        assert fsdp_plugin.fsdp_version == 2, "the shipped config is FSDP2"
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = DistributedType.FSDP
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # later states copy it


state.AcceleratorState.__init__ = _fsdp_on_cpu


def main(recipes: list[str]) -> None:
    from draftsmith.cli import dispatch
    from draftsmith.errors import DraftsmithError
    from draftsmith.recipes.loader import load_recipe

    for path in recipes:
        try:
            dispatch("train", load_recipe(path, []))
        except DraftsmithError as e:
            print(f"draftsmith: error: {e}", file=sys.stderr, flush=True)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the sharded models still hold gloo threads (draftsmith.cli.entry)


if __name__ == "__main__":
    main(sys.argv[1:])
