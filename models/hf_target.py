"""A transformers causal LM behind the own model's forward contract (models/llama.py ``Llama.forward``).

The target path for architectures the own model does not implement, and for any target with
``target.backend: transformers``. What it does, with the own model's meaning for every argument:
- ``new_cache(batch, max_len)``: the own model's slot-addressed ``KVCache`` (models/llama.py), sized by the K/V
  shapes the model's attention layers write (probed once). Each forward hands transformers a ``SlotView``, a cache
  whose ``update`` writes a layer's new keys and values at slots ``[length, length + T)`` and returns slots
  ``[0, length + T)``, and a prepared 4-D attention mask built from the slots' validity exactly as the own model
  builds it (``cache_mask``): left padding, holes, rollback by lowering ``length``, compaction (eval/tree.py,
  eval/batch_decoder.py ``RowCache``) and rows that join or leave a running batch all work as on the own model. A model
  whose attention takes no prepared 4-D mask gets ``HFCache`` instead: a transformers ``DynamicCache`` plus the
  same ``length`` / ``valid`` bookkeeping, with padding as the 2-D mask, cropped on rollback (batch 1 and the
  data engine's fixed batches only).
- ``capture_layers``: index i is the input of decoder layer i (0: the embeddings as the layers see them, Gemma's
  scaling included), n_layers the final state before the norm; read by hooks on the decoder layers, since
  transformers' ``hidden_states[-1]`` is the state after the norm.
- ``logits_at`` / ``return_hidden`` / ``head_fn``: the LM head runs on the final-norm output where asked. ``lm_head``
  applies whatever the model's own forward does after its head (Gemma's final soft-capping, Cohere's and
  Granite's logit scales), checked against transformers' logits when the target loads.
- ``attn_mask`` (a tree): a prepared 4-D additive mask, windowed in sliding-window layers (``_custom_mask``);
  ``HFCache.compact_path`` then keeps the accepted path, as eval/tree.py ``compact_cache`` does on the own cache.
Padding positions are zeroed after every layer (see ``_zero_padding``). Refused in one line: tree masks and
batched decoding where the model's attention takes no 4-D mask, layer types other than full and sliding-window
attention there, and ``head_fn`` on heads with such a transform.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import KVCache, LlamaConfig, cache_mask, default_pos, last_keys, prepare_cache


class HFCache:
    """A transformers DynamicCache with the own KVCache's ``length`` / ``max_len`` / ``valid`` contract.

    Built without the model's config: every layer keeps all its keys (sliding-window layers too; the attention
    mask applies the window), so rollback can crop any layer."""

    def __init__(self, batch: int, max_len: int, device):
        from transformers import DynamicCache

        self.dc = DynamicCache()
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len
        self.padded = False  # set once any row wrote a padding slot: the attention mask is sent from then on

    def compact_path(self, start: int, keep: list[int]) -> None:
        """Keep slots ``start + keep[j]`` as slots ``start + j`` in every layer and the validity mask, then cut the
        cache after them: a tree verify's accepted path (eval/tree.py ``compact_cache`` on the own KVCache)."""
        n = len(keep)
        if keep != list(range(n)):  # a chain, or the top path, is in place already: the next forward crops the rest
            idx = torch.tensor([*range(start), *(start + k for k in keep)], device=self.valid.device)
            layers = getattr(self.dc, "layers", None)  # transformers >= 4.56: one object per layer
            if layers is not None:
                for x in layers:
                    if getattr(x, "keys", None) is not None:
                        x.keys, x.values = x.keys.index_select(-2, idx), x.values.index_select(-2, idx)
            else:  # 4.x: per-layer lists on the cache
                for kv in (self.dc.key_cache, self.dc.value_cache):
                    kv[:] = [t.index_select(-2, idx) for t in kv]
            self.valid[:, start : start + n] = self.valid[:, idx[start:]]
        self.length = start + n


def _slot_view_class():
    """``SlotView``, built on first use (transformers is imported lazily)."""
    global _SlotView
    if _SlotView is None:
        from transformers import DynamicCache

        class SlotView(DynamicCache):
            """transformers' cache calls for one forward over a slot ``KVCache``: layer i writes its new keys and
            values at slots [s0, s0 + T) and attends over slots [0, s0 + T) under the prepared mask. Keys and
            values narrower than the buffer (DeepSeek's latent attention: values shorter than keys) use its
            leading channels. ``shapes`` (probing, no cache): record each layer's K/V shapes instead."""

            def __init__(self, cache: KVCache | None, s0: int, T: int, shapes: dict | None = None):
                super().__init__()
                self.c, self.s0, self.s1, self.shapes = cache, s0, s0 + T, shapes

            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                if self.shapes is not None:
                    self.shapes[layer_idx] = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
                    return key_states, value_states
                k, v, (a, b) = self.c.k[layer_idx], self.c.v[layer_idx], (self.s0, self.s1)
                dk, dv = key_states.shape[-1], value_states.shape[-1]
                k[:, :, a:b, :dk] = key_states
                v[:, :, a:b, :dv] = value_states
                return k[:, :, :b, :dk], v[:, :, :b, :dv]

            def get_seq_length(self, layer_idx: int | None = 0) -> int:
                return self.s0

        _SlotView = SlotView
    return _SlotView


_SlotView = None


class LogitHead:
    """The LM head as the model's own forward applies it: linear, then an optional scale and soft-cap. A plain
    object, not a submodule: the weights stay registered once, under ``hf``."""

    def __init__(self, linear: nn.Module, scale: float = 1.0, softcap: float | None = None):
        self.linear, self.scale, self.softcap = linear, scale, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def plain(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.linear(h)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _head_transform(config) -> tuple[float, float | None]:
    """(scale, soft-cap) applied after the LM head by the families that have one."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
    if getattr(config, "logits_scaling", None):  # Granite divides
        scale /= float(config.logits_scaling)
    return scale, getattr(config, "final_logit_softcapping", None)


def _first_attr(module: nn.Module, names: tuple[str, ...]) -> list | None:
    """The first of ``names`` that ``module`` has, wrapped in a list so nn.Module does not register it twice."""
    return next(([getattr(module, n)] for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def _grab_input(store: dict, i: int, module, args, kwargs) -> None:
    store[i] = args[0] if args else kwargs["hidden_states"]


def _grab_output(store: dict, i: int, module, args, out) -> None:
    store[i] = out[0] if isinstance(out, tuple) else out


def _zero_padding(keep: torch.Tensor, module, args, out):
    """A layer's output with padding positions set to 0. A left-padded row's padding queries see no valid key; some
    attention kernels make such a row NaN (eager attention's float32 softmax turns a float64 mask's minimum into
    -inf), and NaN values at masked keys would still reach the real tokens through 0 * NaN in the next layer."""
    h = out[0] if isinstance(out, tuple) else out
    h = h.masked_fill(~keep[..., None], 0)
    return (h, *out[1:]) if isinstance(out, tuple) else h


class HFTarget(nn.Module):
    """A transformers causal LM behind the own model's API: batched data generation, teacher-forced scoring, AR,
    chain and tree decoding (see the module docstring)."""

    def __init__(self, hf_model, cfg: LlamaConfig, check_head: bool = True):
        super().__init__()
        self.hf = hf_model
        self.cfg = cfg  # sizes only (vocabulary, width, depth): what drafter builders, captures and reports read
        self.model_type = hf_model.config.model_type
        base = hf_model.base_model
        self._layers = _first_attr(base, ("layers", "h", "blocks"))  # (plain attributes: registered under hf)
        self._norm = _first_attr(base, ("norm", "ln_f", "final_layernorm"))
        self.lm_head = LogitHead(hf_model.get_output_embeddings(), *_head_transform(hf_model.config))
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.x renames it
        self._cache_position = "cache_position" in params
        if check_head:
            self._check_head()

    @property
    def embed_tokens(self):
        return self.hf.get_input_embeddings()

    @property
    def norm(self) -> nn.Module:
        if self._norm is None:
            raise DraftsmithError(f"a {self.model_type!r} target: no final norm found (hidden_last needs one)")
        return self._norm[0]

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_cache(self, batch: int, max_len: int) -> KVCache | HFCache:
        """The slot cache where the model takes a prepared 4-D mask (every path, batches included), else
        ``HFCache`` (see the module docstring)."""
        w = self.embed_tokens.weight
        kinds = set(getattr(self.hf.config.get_text_config(decoder=True), "layer_types", None) or ())
        recurrent = sorted(kinds - {"full_attention", "sliding_attention"})
        if recurrent:
            raise DraftsmithError(
                f"a {self.model_type!r} target has {'/'.join(recurrent)} layers, whose recurrent state cannot roll "
                f"back a rejected draft: draftsmith cannot decode with it"
            )
        if not self.slots_ok:
            return HFCache(batch, max_len, w.device)
        return KVCache(self._slot_cfg(), batch, max_len, w.dtype, w.device)

    @property
    def slots_ok(self) -> bool:
        """Whether the slot cache (and so batched decoding with rows that come and go) runs this model."""
        try:
            self._mask_support()
        except DraftsmithError:
            return False
        return True

    def require_slots(self, what: str) -> None:
        """A one-line error starting with ``what`` where this model cannot run on the slot cache."""
        self._mask_support(what)

    @torch.no_grad()
    def _slot_cfg(self) -> LlamaConfig:
        """The sizes of a slot cache that holds every attention layer's keys and values: layers, K/V heads and the
        widest head, from one probing forward of two tokens."""
        if not hasattr(self, "_slot_sizes"):
            shapes: dict[int, tuple[int, int, int]] = {}
            dev = self.embed_tokens.weight.device
            view = _slot_view_class()(None, 0, 2, shapes)
            kw = {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=dev), self._cache_kw: view, "use_cache": True}
            if self._cache_position:
                kw["cache_position"] = torch.arange(2, device=dev)
            self.hf.base_model(**kw)
            if not shapes or {h for h, _, _ in shapes.values()} != {next(iter(shapes.values()))[0]}:
                raise DraftsmithError(f"a {self.model_type!r} target: its attention layers write no uniform K/V cache")
            heads = next(iter(shapes.values()))[0]
            self._slot_sizes = (max(shapes) + 1, heads, max(max(dk, dv) for _, dk, dv in shapes.values()))
        n, heads, hd = self._slot_sizes
        return replace(self.cfg, n_layers=n, n_kv_heads=heads, head_dim=hd)

    @torch.no_grad()
    def _check_head(self) -> None:
        """transformers' logits against ``lm_head`` on the final-norm output, on four tokens: a family whose
        forward changes logits some other way would give wrong teacher signals, so it is refused here."""
        ids = torch.arange(1, 5, device=self.embed_tokens.weight.device)[None] % self.cfg.vocab_size
        want = self.hf(input_ids=ids).logits.float()
        got = self.lm_head(self.hf.base_model(input_ids=ids).last_hidden_state).float()
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * (1 + float(want.abs().max()))):
            raise DraftsmithError(
                f"a {self.model_type!r} target: its logits are not its LM head on its final hidden state "
                f"(a transform draftsmith does not know); it cannot be a target here"
            )

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = None,
        cache: HFCache | None = None,
        valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
        return_hidden: bool = False,
        head_fn=None,
    ):
        """The own model's forward (models/llama.py ``Llama.forward``); every argument means the same."""
        if head_fn is not None and not self.lm_head.plain:
            raise DraftsmithError(f"a {self.model_type!r} target's LM head soft-caps or scales: no chunked head loss")
        B, T = ids.shape
        pos = default_pos(ids, cache) if pos is None else pos
        kw: dict = {"input_ids": ids, "position_ids": pos}
        slot = isinstance(cache, KVCache)
        if slot:
            if cache.slots is not None:
                raise ValueError("a transformers target runs eagerly: no static-shape (CUDA graph) cache")
            s0 = cache.length
            allowed = prepare_cache(cache, T, valid, attn_mask)  # marks the new slots valid, checks room
            if allowed is None:  # one new token, no hole anywhere: every slot (the own model's unmasked path)
                allowed = cache_mask(cache, T, None)
            kw.update({self._cache_kw: _slot_view_class()(cache, s0, T), "use_cache": True})
            kw["attention_mask"] = self._prepared_mask(allowed)
            if self._cache_position:
                kw["cache_position"] = torch.arange(s0, s0 + T, device=ids.device)
        elif cache is not None:
            if cache.length + T > cache.max_len:
                raise ValueError(f"KV cache overflow: {cache.length}+{T} > {cache.max_len}")
            extra = cache.dc.get_seq_length() - cache.length
            if extra > 0:  # a rejected draft: roll back (a negative count drops that many, 4.x and 5.x)
                cache.dc.crop(-extra)
            s0 = cache.length
            cache.valid[:, s0 : s0 + T] = True if valid is None else valid
            cache.padded |= valid is not None
            kw.update({self._cache_kw: cache.dc, "use_cache": True})
            if attn_mask is not None:
                kw["attention_mask"] = self._custom_mask(attn_mask, cache.valid[:, : s0 + T])
            elif cache.padded:
                kw["attention_mask"] = cache.valid[:, : s0 + T].long()
            if self._cache_position:
                kw["cache_position"] = torch.arange(s0, s0 + T, device=ids.device)
        else:
            kw["use_cache"] = False
            if attn_mask is not None:
                keys = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid
                kw["attention_mask"] = self._custom_mask(attn_mask, keys)
            elif valid is not None:
                kw["attention_mask"] = valid.long()
        captured: dict[int, torch.Tensor] = {}
        hooks = self._hooks(captured, capture_layers)
        if valid is not None and not bool(valid.all()):
            hooks += [layer.register_forward_hook(partial(_zero_padding, valid)) for layer in self._layer_list()]
        try:
            h = self.hf.base_model(**kw).last_hidden_state  # after the final norm
        finally:
            for hook in hooks:
                hook.remove()
        if cache is not None:
            cache.length += T
        h = h[logits_at] if logits_at is not None else h
        if head_fn is not None:
            return head_fn(h, self.lm_head.weight)
        logits = h if return_hidden else self.lm_head(h)
        return (logits, captured) if capture_layers else logits

    def _custom_mask(self, attn_mask: torch.Tensor, keys_valid: torch.Tensor) -> torch.Tensor | dict:
        """A custom (tree) mask (1|B, T, S) over the cache's slots and the new tokens, keys valid (B, S), each query
        seeing itself, prepared for transformers (``_prepared_mask``)."""
        T, S = attn_mask.shape[1], keys_valid.shape[1]
        dev = attn_mask.device
        self_slot = torch.arange(S - T, S, device=dev)[:, None] == torch.arange(S, device=dev)[None]
        return self._prepared_mask(((attn_mask & keys_valid[:, None]) | self_slot)[:, None])

    def _prepared_mask(self, allowed: torch.Tensor) -> torch.Tensor | dict:
        """``allowed`` (B|1, 1, T, S) bool as transformers takes a prepared mask (masking_utils returns a 4-D mask
        as is): additive, 0 where a query may attend and the dtype's minimum elsewhere. Sliding-window layers get
        the window on top, by position as the own model applies it (models/llama.py ``last_keys``); where full and
        windowed layers mix, a dict by layer type, which those models' forwards take in place of a mask."""
        self._mask_support()
        dev = allowed.device
        conf = self.hf.config
        window = getattr(conf, "sliding_window", None)
        types = list(getattr(conf, "layer_types", None) or [])
        windowed = None
        if window is not None and (not types or "sliding_attention" in types):
            windowed = last_keys(allowed, window)
        dtype = self.embed_tokens.weight.dtype

        def additive(m: torch.Tensor) -> torch.Tensor:
            return torch.zeros(m.shape, dtype=dtype, device=dev).masked_fill(~m, torch.finfo(dtype).min)

        if windowed is None:
            return additive(allowed)
        if not types or "full_attention" not in types:  # every layer slides (Mistral, Phi-3)
            return additive(windowed)
        return {"full_attention": additive(allowed), "sliding_attention": additive(windowed)}

    def _mask_support(self, what: str = "tree attention (eval.strategy=tree/dynamic_tree)") -> str:
        """How the transformers model takes a prepared mask: "by_type" (a dict per layer type, or one 4-D mask) or
        "4d" (one 4-D mask); refused in one line starting with ``what`` where its attention builds its own mask
        from a 2-D one, has layer types other than full and sliding-window attention, or mixes the two under one
        mask."""
        if not hasattr(self, "_mask_how"):
            try:
                src = inspect.getsource(inspect.getmodule(type(self.hf.base_model)))
            except (OSError, TypeError):  # no source to read: assume the worst
                src = ""
            self._mask_how = (
                "by_type" if "causal_mask_mapping" in src else "4d" if "create_causal_mask" in src else "none"
            )
        fix = "decode chains at batch 1 (eval.strategy=chain) or use the own model"
        if self._mask_how == "none":
            raise DraftsmithError(
                f"{what}: the {self.model_type!r} target's transformers attention takes no 4-D mask; {fix}"
            )
        conf = self.hf.config
        types = set(getattr(conf, "layer_types", None) or [])
        if types - {"full_attention", "sliding_attention"}:
            raise DraftsmithError(
                f"{what}: the {self.model_type!r} target has layer types {sorted(types)}; only full and "
                f"sliding-window attention take a prepared mask here; {fix}"
            )
        if getattr(conf, "sliding_window", None) is not None and len(types) == 2 and self._mask_how != "by_type":
            raise DraftsmithError(
                f"{what}: the {self.model_type!r} target mixes full and sliding-window layers, and its "
                f"transformers forward takes one mask for all of them; {fix}"
            )
        return self._mask_how

    def _layer_list(self) -> nn.ModuleList:
        if self._layers is None:
            raise DraftsmithError(f"a {self.model_type!r} target: no decoder layer list found (layer capture, padding)")
        return self._layers[0]

    def _hooks(self, store: dict, capture_layers: tuple[int, ...]) -> list:
        n = self.cfg.n_layers
        if not capture_layers:
            return []
        bad = [i for i in capture_layers if not 0 <= i <= n]
        if bad:
            raise ValueError(f"capture_layers {bad} outside 0..{n}")
        layers = self._layer_list()
        hooks = [
            layers[i].register_forward_pre_hook(partial(_grab_input, store, i), with_kwargs=True)
            for i in capture_layers
            if i < n
        ]
        if n in capture_layers:
            hooks.append(layers[n - 1].register_forward_hook(partial(_grab_output, store, n)))
        return hooks

    def num_params(self, exclude_embeddings: bool = False) -> int:
        if hasattr(self, "_counts"):  # packed weights are not parameters (optimize_for_inference)
            return self._counts[exclude_embeddings]
        n = sum(p.numel() for p in self.hf.parameters())
        return n - self.embed_tokens.weight.numel() if exclude_embeddings else n

    def optimize_for_inference(self) -> HFTarget:
        """Pre-pack every linear layer's weight for oneDNN on CPU (``FusedLinear`` of one layer: the own model's
        fast path without its q/k/v fusion, which transformers' modules do not allow); the LM head keeps its
        ``weight`` for ``head_fn`` readers. Inference only: the model stops training, and its parameter counts
        are kept. Elsewhere (CUDA, other dtypes) the modules stay as they are."""
        from draftsmith.models.llama import FusedLinear

        self._counts = (self.num_params(), self.num_params(exclude_embeddings=True))
        head = self.lm_head.linear
        for parent in list(self.hf.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                packed = FusedLinear(child)
                if packed.packed is None:  # not packable here: keep it
                    continue
                if child is head:
                    packed.weight = child.weight  # tied or not, readers of lm_head.weight see the same tensor
                    self.lm_head.linear = packed
                setattr(parent, name, packed)
        self.requires_grad_(False)
        return self

    # ---- what drafter builders copy from the target (models/draft_lm.py, models/eagle.py) ----

    @property
    def llama_shaped(self) -> bool:
        """Whether the decoder layers hold the own model's Block tensors under the same names (Llama, Mistral,
        Qwen2, Qwen3): only then can a drafter copy them (drafter.init_layers)."""
        from draftsmith.models.loading import SUPPORTED_ARCHS

        return self.model_type in SUPPORTED_ARCHS

    @property
    def layers(self) -> nn.ModuleList:
        return self._layer_list()

    @torch.no_grad()
    def io_weights(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings, final-norm weight, LM head) as a draft Llama uses them: plain lookup, RMSNorm x * w and
        a linear head. A (1 + w) norm (Gemma) is folded into w; anything else the draft cannot reproduce (a
        soft-capped or scaled head, scaled embeddings, another norm) is refused in one line naming ``key``."""
        why, norm = None, None
        if not self.lm_head.plain:
            why = "soft-caps or scales its logits after the LM head"
        else:
            ids = torch.arange(1, 5, device=self.embed_tokens.weight.device)[None] % self.cfg.vocab_size
            _, cap = self(ids, capture_layers=(0,), return_hidden=True)
            if not torch.allclose(cap[0].float(), self.embed_tokens(ids).float(), rtol=1e-4, atol=1e-6):
                why = "changes its token embeddings before the first layer (a scale, position embeddings)"
        w = getattr(self.norm, "weight", None) if why is None else None
        if why is None and w is not None:
            x = torch.randn(4, self.cfg.dim, generator=torch.Generator().manual_seed(0)).to(w)
            xf = x.float()
            unit = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
            got = self.norm(x).float()
            norm = next((c for c in (w, w + 1) if torch.allclose(unit * c.float(), got, rtol=1e-3, atol=1e-4)), None)
        if why is None and norm is None:
            why = f"has a final norm ({type(self.norm).__name__}) that is not an RMSNorm"
        if why is not None:
            raise DraftsmithError(
                f"{key}: the {self.model_type!r} target {why}, which the draft (a Llama) does not reproduce: "
                f"set {key}=false"
            )
        return self.embed_tokens.weight, norm, self.lm_head.weight


def layer_state(target, i: int, key: str) -> dict[str, torch.Tensor]:
    """Target layer ``i``'s tensors under the own Block's names, for a drafter that copies it (``key``: the recipe
    key that asked); a transformers-path target of another family is refused in one line."""
    if isinstance(target, HFTarget) and not target.llama_shaped:
        raise DraftsmithError(
            f"{key}: a {target.model_type!r} target's layers are not Llama layers and cannot be copied into the "
            f"draft; set {key}=null"
        )
    return target.layers[i].state_dict()


def io_weights(target, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeddings, final-norm weight, LM head) a draft Llama copies from ``target`` (see ``HFTarget.io_weights``)."""
    if isinstance(target, HFTarget):
        return target.io_weights(key)
    return target.embed_tokens.weight, target.norm.weight, target.lm_head.weight


def hf_sizes(cfg: dict) -> LlamaConfig:
    """The sizes a drafter builder needs, from any HF config (names differ across families); a Llama-family
    config maps in full, as the own model reads it, so drafters build the same on both paths."""
    from draftsmith.models.loading import SUPPORTED_ARCHS, config_from_hf

    if cfg.get("model_type") in SUPPORTED_ARCHS:
        try:
            return config_from_hf(cfg)
        except DraftsmithError:  # a field the own model does not implement (why auto chose this path): sizes only
            pass

    def get(*names, default=None):
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        if default is None:
            raise DraftsmithError(f"config.json has none of {names}")
        return default

    dim = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    return LlamaConfig(
        vocab_size=get("vocab_size"),
        dim=dim,
        n_layers=get("num_hidden_layers", "n_layer"),
        n_heads=heads,
        n_kv_heads=get("num_key_value_heads", default=heads),
        hidden_dim=get("intermediate_size", "n_inner", default=4 * dim),
        head_dim=cfg.get("head_dim"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta") or get("rope_theta", default=1e4)),
        norm_eps=float(get("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-5)),
    )


def load_hf_target(path, cfg: dict, dtype, device: str, trust_remote_code: bool) -> HFTarget:
    from transformers import PreTrainedModel

    from draftsmith.models.loading import hf_model_from_folder

    kw = {}
    if dtype == torch.float64 and hasattr(PreTrainedModel, "get_correct_experts_implementation"):
        kw["experts_implementation"] = "eager"  # transformers' default MoE kernel (grouped_mm) has no float64
    hf = hf_model_from_folder(path, "target.model", dtype=dtype, trust_remote_code=trust_remote_code, **kw)
    return HFTarget(hf.to(device).eval(), hf_sizes(cfg))
