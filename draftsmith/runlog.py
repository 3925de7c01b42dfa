"""Per-run metrics: every stage appends JSON lines to ``<run>/metrics.jsonl``; wandb / tensorboard are optional
mirrors enabled from the recipe. Never log tokens or text: only numbers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from draftsmith.errors import DraftsmithError


def save_recipe(recipe, main: bool = True) -> None:
    """The run folder's ``recipe.yaml``: the exact recipe (after overrides) of the last stage that started on it.
    Stages call this once their inputs loaded, so a command that fails validation or at start leaves the previous
    copy as it was. Only the main process writes it."""
    from draftsmith.recipes.loader import dump_recipe

    if main:
        recipe.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(recipe.run_dir / "recipe.yaml", dump_recipe(recipe))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def significant(metrics: dict, digits: int = 6) -> dict:
    """``metrics`` with each float kept to ``digits`` significant figures (a tiny TFLOP/s keeps its precision where
    a fixed number of decimals would leave one digit); ints and strings unchanged."""
    return {k: float(f"{v:.{digits}g}") if isinstance(v, float) else v for k, v in metrics.items()}


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        stage: str,
        *,
        wandb: bool = False,
        tensorboard: bool = False,
        config: dict | None = None,
        enabled: bool = True,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.stage, self.enabled = stage, enabled
        self.wandb = self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                raise DraftsmithError(
                    "train.wandb is on but wandb is not installed: pip install 'draftsmith[wandb]'"
                ) from None
            self.wandb = wb.init(project="draftsmith", name=f"{Path(run_dir).name}-{stage}", config=config or {})
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DraftsmithError(
                    "train.tensorboard is on but tensorboard is not installed: pip install 'draftsmith[tensorboard]'"
                ) from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard" / stage))

    def log(self, metrics: dict, step: int | None = None) -> None:
        if not self.enabled:
            return
        row = {
            "stage": self.stage,
            "time": round(time.time(), 3),
            **({"step": step} if step is not None else {}),
            **metrics,
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(f"{self.stage}/{k}", v, step or 0)

    def drop_after(self, step: int) -> None:
        """Resume: forget this stage's rows logged after ``step`` (work the killed run did past its last
        checkpoint, which the resumed run redoes), so every step appears once."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines(keepends=True)
            if not ((r := json.loads(line)).get("stage") == self.stage and r.get("step", 0) > step)
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        tmp.replace(self.path)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
