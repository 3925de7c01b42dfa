"""Online distillation (docs/algorithms.md A9): keep the drafter learning from recorded traffic, with versioned swaps.

- ``Versions``: ``<online dir>/versions/vNNNN`` drafter checkpoints and ``current.json`` ({version, history}),
  both written by rename, so a kill at any point leaves the last good version current. v0000 is the recipe's
  trained drafter. ``rollback`` steps ``current`` back; servers pick the change up between requests.
- ``Learner.round``: the recorded traffic (traffic.py) minus a held-out window of the newest requests becomes
  a data folder in the data stage's record format (the target's top-k teacher signals); the one train loop
  (train/loop.py) fine-tunes the current version on it; the candidate and the current version then decode the
  held-out prompts with the real decoder, and the candidate is published only if its measured τ is higher.
- ``online``: ``draftsmith online RECIPE``, the same learner fed by request logs (JSONL files that grow) for
  clusters whose serving engine is elsewhere; every published version is also exported (the recipe's export
  section).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch

from draftsmith.data.engine import Capture, score_batch
from draftsmith.data.records import FORMAT, Record, shard_name, write_json_atomic, write_manifest, write_shard
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.own_vocab import for_decoding
from draftsmith.models.loading import encode_chat, load_model, read_json, stop_ids, tokenizer_hash
from draftsmith.models.registry import load_drafter
from draftsmith.runlog import RunLog
from draftsmith.serving.traffic import TrafficBuffer

log = logging.getLogger("draftsmith.online")
VERSION = re.compile(r"v\d{4,}")


def online_dir(recipe) -> Path:
    return Path(recipe.online.dir) if recipe.online.dir else recipe.run_dir / "online"


class Versions:
    def __init__(self, root: Path, initial: Path):
        self.root, self.dir = Path(root), Path(root) / "versions"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.root / "current.json"
        if not self.file.is_file():
            if not (Path(initial) / "drafter.json").is_file():
                raise DraftsmithError(
                    f"online: no trained drafter at {initial} (train it first, or set eval.checkpoint)"
                )
            self._copy(Path(initial), "v0000")
            write_json_atomic(self.file, {"version": "v0000", "history": ["v0000"]})

    def _copy(self, src: Path, name: str) -> Path:
        tmp = self.dir / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("train_state*"))
        os.replace(tmp, self.dir / name)
        return self.dir / name

    def names(self) -> list[str]:
        """The published versions: vNNNN folders of the store holding a drafter (a rollback names one of these)."""
        return sorted(
            p.name for p in self.dir.iterdir() if VERSION.fullmatch(p.name) and (p / "drafter.json").is_file()
        )

    def state(self) -> dict:
        return json.loads(self.file.read_text())

    def current(self) -> tuple[str, Path]:
        v = self.state()["version"]
        return v, self.dir / v

    def publish(self, ckpt: Path) -> str:
        done = [p.name for p in self.dir.glob("v[0-9][0-9][0-9][0-9]")]
        name = f"v{max(int(n[1:]) for n in done) + 1:04d}"
        self._copy(ckpt, name)
        st = self.state()
        write_json_atomic(self.file, {"version": name, "history": [*st["history"], name]})
        return name

    def rollback(self, to: str | None = None) -> str:
        st = self.state()
        hist = st["history"]
        if to is None:
            if len(hist) < 2:
                raise DraftsmithError("online: nothing to roll back to (only one version was ever current)")
            to = hist[-2]
            hist = hist[:-1]
        else:
            names = self.names()
            if to not in names:
                known = ", ".join(names) if len(names) <= 5 else f"{names[0]} .. {names[-1]}"
                raise DraftsmithError(f"online: no version {to!r} in {self.dir} (known: {known})")
            hist = [*hist, to]
        write_json_atomic(self.file, {"version": to, "history": hist})
        return to


class Learner:
    """One learner per online folder. ``tgt``: the plain (unoptimised) target, used for teacher signals and the
    held-out decodes."""

    def __init__(self, recipe, buffer: TrafficBuffer, versions: Versions, tgt=None):
        self.recipe, self.oc, self.buffer, self.versions = recipe, recipe.online, buffer, versions
        self.root = versions.root
        t = recipe.target
        self.tgt = tgt or load_model(t.model, torch.float32, "cpu", t.trust_remote_code, t.revision, backend=t.backend)
        self.eos = stop_ids(self.tgt.path, self.tgt.tokenizer)
        self.runlog = RunLog(self.root, "online")
        self.state_file = self.root / "learner.json"
        st = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        self.rounds, self.last_seq, self.last_time = st.get("rounds", 0), st.get("last_seq", -1), time.time()

    def due(self) -> bool:
        recs = self.buffer.read(self.last_seq)
        if len(self.buffer.read()) < self.oc.min_records or not recs:
            return False
        return len(recs) >= self.oc.update_every_requests or time.time() - self.last_time >= self.oc.update_every_s

    def round(self) -> dict:
        """One update: train a candidate on the buffer, compare τ on the held-out window, publish if better."""
        t0 = time.perf_counter()
        recs = self.buffer.read()
        hold, train_recs = recs[-self.oc.holdout :], recs[: -self.oc.holdout]
        if not train_recs:
            raise DraftsmithError(f"online: {len(recs)} records, all held out: lower online.holdout")
        n = self.rounds + 1
        run = self.root / "rounds" / f"r{n:04d}"
        shutil.rmtree(run, ignore_errors=True)  # a round a kill interrupted starts over
        self._write_data(run / "data", train_recs)
        version, current = self.versions.current()
        from draftsmith.recipes.loader import validate
        from draftsmith.train.loop import train

        d = self.recipe.model_dump(mode="json")
        d["out_dir"] = str(run)
        d["train"].update(
            steps=self.oc.steps_per_update,
            init_checkpoint=str(current),
            resume=False,
            eval_every=0,
            save_every=0,
            wandb=False,
            tensorboard=False,
            log_every=max(1, min(d["train"]["log_every"], self.oc.steps_per_update)),
        )
        own = read_json(current / "drafter.json").get("draft_tokenizer")
        if own:  # its own vocabulary: the candidate keeps the current version's tokenizer (never a new BPE)
            d["drafter"]["tokenizer"] = str(current / own)
        candidate = train(validate(d, f"{self.recipe.name} (online round {n})"))
        tau_cur, tau_new = self.held_out_tau(current, hold), self.held_out_tau(candidate, hold)
        swapped = tau_new > tau_cur
        new_version = self.versions.publish(candidate) if swapped else version
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # published versions are copies
        self.rounds, self.last_seq, self.last_time = n, recs[-1]["seq"], time.time()
        write_json_atomic(self.state_file, {"rounds": n, "last_seq": self.last_seq})
        out = {
            "round": n,
            "records": len(train_recs),
            "held_out": len(hold),
            "tau_current": round(tau_cur, 4),
            "tau_candidate": round(tau_new, 4),
            "swapped": swapped,
            "version": new_version,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        self.runlog.log(out, step=n)
        log.info(
            "online round %d: τ %.3f -> %.3f on %d held-out requests; %s",
            n,
            tau_cur,
            tau_new,
            len(hold),
            f"published {new_version}" if swapped else f"kept {version}",
        )
        return out

    def _write_data(self, data_dir: Path, recs: list[dict]) -> None:
        data_dir.mkdir(parents=True)
        cap = Capture(topk=self.oc.topk)
        seqs = [r["prompt"] + r["response"] for r in recs]
        masks = [[0] * len(r["prompt"]) + self._response_mask(r) for r in recs]
        records = []
        with torch.no_grad():
            for a in range(0, len(seqs), 8):
                gen = score_batch(self.tgt.model, seqs[a : a + 8], masks[a : a + 8], cap)
                for j, g in enumerate(gen):
                    records.append(
                        Record(seqs[a + j], masks[a + j], prompt_index=recs[a + j]["seq"], signals=dict(g.loss_signals))
                    )
        entry = write_shard(data_dir / shard_name(0), records, {"online": "1"})
        manifest = {
            "format": FORMAT,
            "target": self.recipe.target.model,
            "tokenizer_hash": tokenizer_hash(self.tgt.tokenizer),
            "recipe": self.recipe.name,
            "responses": "traffic",
            "n_sequences": entry["n_sequences"],
            "n_tokens": entry["n_tokens"],
            "n_loss_tokens": entry["n_loss_tokens"],
            "signals": {
                "topk": {"k": cap.topk, "dtype": "float32", "axis": "loss", "tail": "1 - sum(exp(topk_logprobs))"}
            }
            if cap.topk
            else {},
            "shards": [entry],
        }
        write_manifest(data_dir, manifest)

    def _response_mask(self, r: dict) -> list[int]:
        """online.positions=all: every response token; wrong: only where the target overruled the serving drafter
        (OSD's mask), when the record carries them (request logs from elsewhere do not: all)."""
        if self.oc.positions == "all" or not r.get("target_positions"):
            return [1] * len(r["response"])
        m = [0] * len(r["response"])
        for p in r["target_positions"]:
            m[p] = 1
        return m

    def held_out_tau(self, ckpt: Path, hold: list[dict]) -> float:
        """Measured τ of the drafter at ``ckpt`` on the held-out requests (greedy, the eval's draft length)."""
        drafter, info = load_drafter(ckpt)
        drafter = for_decoding(ckpt, drafter, info, self.tgt.tokenizer, self.recipe.eval)
        tokens = forwards = 0
        for r in hold:
            _, st = speculative_generate(
                self.tgt.model,
                drafter,
                torch.tensor(r["prompt"]),
                min(len(r["response"]), self.oc.eval_tokens),
                draft_len=self.recipe.eval.draft_len,
                eos_ids=self.eos,
            )
            tokens, forwards = tokens + st.new_tokens, forwards + st.target_forwards
        return tokens / max(forwards, 1)


# ---- `draftsmith online`: the learner fed by request logs -----------------------------------------------------


def _log_record(line: dict, tok, eos: set[int]) -> dict | None:
    """One request-log line -> a traffic record: {"prompt": ids, "response": ids} (token ids) or
    {"messages": [...], "response": "text"} (tokenised with the target's chat template)."""
    if "prompt" in line and "response" in line and isinstance(line["prompt"], list):
        return {"prompt": [int(t) for t in line["prompt"]], "response": [int(t) for t in line["response"]]}
    if "messages" in line and isinstance(line.get("response"), str):
        resp = tok.encode(line["response"], add_special_tokens=False)
        return {"prompt": encode_chat(tok, line["messages"]), "response": resp + [min(eos)] if eos else resp}
    return None


class LogFollower:
    """Reads the complete new lines of growing JSONL files into the buffer; byte offsets persist in
    ``log_offsets.json`` after each file's batch is durably in the buffer."""

    def __init__(self, patterns: list[str], buffer: TrafficBuffer, state: Path, tok, eos: set[int]):
        self.patterns, self.buffer, self.state, self.tok, self.eos = patterns, buffer, state, tok, eos
        self.offsets = json.loads(state.read_text()) if state.is_file() else {}

    def poll(self) -> int:
        added = 0
        for path in sorted({p for pat in self.patterns for p in glob.glob(pat)}):
            start = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # only complete lines: a writer may be mid-line
            for i, raw in enumerate(data[:end].splitlines()):
                if not raw.strip():
                    continue
                try:
                    rec = _log_record(json.loads(raw), self.tok, self.eos)
                except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply
                    rec = None
                if rec is None:
                    log.warning(
                        "online: %s: skipped a line that is not a request record (line %d of this batch)", path, i + 1
                    )
                    continue
                self.buffer.append({**rec, "source": "log"})
                added += 1
            if end:
                self.offsets[path] = start + end
                write_json_atomic(self.state, self.offsets)
        return added


def online(recipe, rollback: str | None = None) -> None:
    """`draftsmith online RECIPE`: follow online.logs, learn, publish (and export) improved versions."""
    oc, root = recipe.online, online_dir(recipe)
    ckpt = Path(recipe.eval.checkpoint) if recipe.eval.checkpoint else recipe.run_dir / "checkpoints" / "final"
    versions = Versions(root, ckpt)
    if rollback is not None:
        print(f"online: current version is now {versions.rollback(rollback or None)}")
        return
    if not oc.logs:
        raise DraftsmithError("online.logs: list the request-log JSONL files (globs) to learn from")
    buffer = TrafficBuffer(root / "traffic", oc.buffer_max_records)
    learner = Learner(recipe, buffer, versions)
    follower = LogFollower(list(oc.logs), buffer, root / "log_offsets.json", learner.tgt.tokenizer, learner.eos)
    rounds = 0
    while oc.max_rounds == 0 or rounds < oc.max_rounds:
        follower.poll()
        if learner.due():
            out = learner.round()
            rounds += 1
            print(
                f"online: round {out['round']}: τ {out['tau_current']:.3f} -> {out['tau_candidate']:.3f}, "
                f"{'published ' + out['version'] if out['swapped'] else 'kept ' + out['version']}"
            )
            if out["swapped"] and recipe.export.enabled:
                from draftsmith.export.writer import export

                for fmt in recipe.export.formats:
                    export(versions.current()[1], fmt, root / "export" / fmt, recipe)
        else:
            time.sleep(oc.poll_s)
