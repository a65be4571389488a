"""The entries of the Hugging Face <-> Megatron parameter mappings, each usable in both directions.

Every entry names one megatron parameter and the HF tensors it is made of, and knows how to cut the HF
tensors into per-tensor-parallel-rank shards (``to_megatron``) and how to glue a list of shards back into
the HF tensors (``to_hf``). Each family builds its one table from these (``qwen3_5/mapping.py``,
``qwen3/mapping.py``; the parts both share are here); the trainer's HF initialisation, the weight sync, the
tests and the checkpoint converter all go through it (in the style of Megatron-Bridge's param-mapping classes).

Layouts that peers have got wrong, spelled out:

- Attention: megatron's ``linear_qkv`` holds per query group ``[q heads of the group, k, v]`` and TP splits whole
  groups; with Qwen3.5's output gate HF ``q_proj`` holds per head ``[q_h; gate_h]`` and megatron's group
  ``[q heads, gate heads, k, v]``.
- Fused tensors of several HF tensors (the MLP's fc1, Qwen3.5's Gated DeltaNet ``in_proj``): each part is split by
  TP first and the rank's pieces concatenated (chunking the fused tensor would mix parts across ranks).
- Vocabulary rows are padded with zeros to the padded vocab size and stripped on the way back.
- A norm whose gain is parameterised differently on the two sides is shifted by a constant (``Replicated.offset``);
  every other entry only moves bits.

Names on the megatron side use *global* layer indices; :func:`localize_layer_names` renumbers them for a
pipeline stage. HF names are those of the family's text-only causal LM (``model.layers.N...``, ``lm_head``).
"""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Part = tuple[str, int, int]  # (hf tensor name, first row, number of rows)


@dataclass(frozen=True)
class Replicated:
    """Same tensor on every TP rank, optionally shifted (DeltaNet output norm: w_mcore = w_hf + offset)."""

    megatron: str
    hf: str
    offset: float = 0.0

    def hf_names(self) -> list[str]:
        return [self.hf]

    def to_megatron(self, hf: Mapping[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
        t = hf[self.hf] + self.offset if self.offset else hf[self.hf]
        return [t.clone() for _ in range(tp)]

    def to_hf(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        t = shards[0] - self.offset if self.offset else shards[0]
        return {self.hf: t.clone()}


@dataclass(frozen=True)
class Split:
    """One HF tensor split evenly across TP ranks along ``dim`` (column-parallel: 0, row-parallel: 1)."""

    megatron: str
    hf: str
    dim: int

    def hf_names(self) -> list[str]:
        return [self.hf]

    def to_megatron(self, hf: Mapping[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
        return [c.clone() for c in _even_chunks(hf[self.hf], tp, self.dim, self.hf)]

    def to_hf(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf: shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=self.dim)}


@dataclass(frozen=True)
class VocabSplit:
    """Embedding / output rows: padded with zero rows to ``padded_vocab``, then split on dim 0."""

    megatron: str
    hf: str
    vocab: int
    padded_vocab: int

    def hf_names(self) -> list[str]:
        return [self.hf]

    def to_megatron(self, hf: Mapping[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
        t = hf[self.hf]
        if t.shape[0] != self.vocab:
            raise ValueError(f"{self.hf}: {t.shape[0]} rows, expected vocab size {self.vocab}")
        # the largest tensor of the model: ``padded`` is already a copy, so one shard needs no other
        padded = torch.cat([t, t.new_zeros(self.padded_vocab - self.vocab, *t.shape[1:])], dim=0)
        chunks = _even_chunks(padded, tp, 0, self.hf)
        return [chunks[0]] if tp == 1 else [c.clone() for c in chunks]

    def to_hf(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        # the largest tensor of the model: no copy beyond the concatenation (a row slice is contiguous)
        full = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=0)
        return {self.hf: full[: self.vocab]}


@dataclass(frozen=True)
class PerRankConcat:
    """A fused megatron tensor whose TP shard is the concatenation of each part's own TP slice.

    ``parts`` are row ranges of HF tensors (a whole tensor or a section of one, e.g. the q rows of
    ``in_proj_qkv``), in the order megatron concatenates them within a rank.
    """

    megatron: str
    parts: tuple[Part, ...]

    def hf_names(self) -> list[str]:
        return list(dict.fromkeys(name for name, _, _ in self.parts))

    def to_megatron(self, hf: Mapping[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
        per_part = [
            _even_chunks(hf[name][start : start + rows], tp, 0, f"{name}[{start}:{start + rows}]")
            for name, start, rows in self.parts
        ]
        return [torch.cat([chunks[r] for chunks in per_part], dim=0) for r in range(tp)]

    def to_hf(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        tp = len(shards)
        sizes = [rows // tp for _, _, rows in self.parts]
        pieces = [torch.split(s, sizes, dim=0) for s in shards]
        by_name: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for i, (name, start, _) in enumerate(self.parts):
            by_name.setdefault(name, []).append((start, torch.cat([p[i] for p in pieces], dim=0)))
        return {name: torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], dim=0)
                for name, parts in by_name.items()}


@dataclass(frozen=True)
class GroupedQKV:
    """HF q_proj, k_proj, v_proj <-> megatron linear_qkv, which holds per query group ``[q heads of the group, k, v]``
    (TP splits whole groups). With ``output_gate`` (Qwen3.5's gated attention) HF q_proj holds per head ``[q_h;
    gate_h]`` and megatron's group ``[q heads, gate heads, k, v]``."""

    megatron: str
    q: str
    k: str
    v: str
    num_heads: int
    num_groups: int
    head_dim: int
    output_gate: bool = False

    def hf_names(self) -> list[str]:
        return [self.q, self.k, self.v]

    def _q_parts(self) -> int:
        return 2 if self.output_gate else 1

    def _full(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        heads_per_group, d, parts = self.num_heads // self.num_groups, self.head_dim, self._q_parts()
        q = hf[self.q].reshape(self.num_groups, heads_per_group, parts, d, -1)
        hidden = q.shape[-1]
        q_parts = [q[:, :, i].reshape(self.num_groups, heads_per_group * d, hidden) for i in range(parts)]
        k = hf[self.k].reshape(self.num_groups, d, hidden)
        v = hf[self.v].reshape(self.num_groups, d, hidden)
        return torch.cat([*q_parts, k, v], dim=1).reshape(-1, hidden)

    def to_megatron(self, hf: Mapping[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
        if self.num_groups % tp:
            raise ValueError(f"{self.megatron}: TP={tp} must divide the {self.num_groups} query groups")
        return [c.clone() for c in torch.chunk(self._full(hf), tp, dim=0)]

    def to_hf(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        heads_per_group, d, parts = self.num_heads // self.num_groups, self.head_dim, self._q_parts()
        full = torch.cat(list(shards), dim=0).reshape(self.num_groups, (parts * heads_per_group + 2) * d, -1)
        *q_parts, k, v = torch.split(full, [heads_per_group * d] * parts + [d, d], dim=1)
        hidden = full.shape[-1]
        q = torch.stack([p.reshape(self.num_groups, heads_per_group, d, hidden) for p in q_parts], dim=2)
        return {
            self.q: q.reshape(-1, hidden).clone(),
            self.k: k.reshape(-1, hidden).clone(),
            self.v: v.reshape(-1, hidden).clone(),
        }


ParamMapping = Replicated | Split | VocabSplit | PerRankConcat | GroupedQKV


def _even_chunks(t: torch.Tensor, tp: int, dim: int, what: str) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % tp:
        raise ValueError(f"{what}: size {t.shape[dim]} on dim {dim} is not divisible by TP={tp}")
    return torch.chunk(t, tp, dim=dim)


def embedding_and_head(p, padded_vocab: int) -> list[ParamMapping]:
    """Embeddings, the final norm and the LM head if untied: ``Qwen3_5ForCausalLM`` and ``Qwen3ForCausalLM`` names."""
    table: list[ParamMapping] = [
        VocabSplit("embedding.word_embeddings.weight", "model.embed_tokens.weight", p.vocab_size, padded_vocab),
        Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not p.tie_word_embeddings:
        table.append(VocabSplit("output_layer.weight", "lm_head.weight", p.vocab_size, padded_vocab))
    return table


def decoder_layer(layer: int) -> tuple[str, str]:
    """The HF and megatron name prefixes of decoder layer ``layer``."""
    return f"model.layers.{layer}.", f"decoder.layers.{layer}."


def swiglu_mlp(p, hf: str, megatron: str) -> list[ParamMapping]:
    """The pre-MLP norm (fused into fc1 on the megatron side) and the SwiGLU MLP of the layer whose names start with
    ``hf`` and ``megatron`` (:func:`decoder_layer`'s, or an MTP layer's)."""
    mc = megatron + "mlp."
    return [
        Replicated(mc + "linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
        PerRankConcat(mc + "linear_fc1.weight", (
            (hf + "mlp.gate_proj.weight", 0, p.ffn_hidden_size),
            (hf + "mlp.up_proj.weight", 0, p.ffn_hidden_size),
        )),
        Split(mc + "linear_fc2.weight", hf + "mlp.down_proj.weight", dim=1),
    ]


def attention(p, hf: str, megatron: str, output_gate: bool) -> list[ParamMapping]:
    """The input norm (fused into linear_qkv) and the grouped-query attention with per-head q/k norms of the layer
    whose names start with ``hf`` and ``megatron``."""
    a, m = hf + "self_attn.", megatron + "self_attention."
    return [
        Replicated(m + "linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
        GroupedQKV(m + "linear_qkv.weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                   p.num_attention_heads, p.num_query_groups, p.head_dim, output_gate=output_gate),
        Replicated(m + "q_layernorm.weight", a + "q_norm.weight"),
        Replicated(m + "k_layernorm.weight", a + "k_norm.weight"),
        Split(m + "linear_proj.weight", a + "o_proj.weight", dim=1),
    ]


def for_gradients(table: Sequence[ParamMapping]) -> list[ParamMapping]:
    """The same table for gradients: a constant offset between the two parameterisations has zero gradient."""
    return [dataclasses.replace(m, offset=0.0) if isinstance(m, Replicated) else m for m in table]


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], table: Sequence[ParamMapping], tp: int
                   ) -> list[dict[str, torch.Tensor]]:
    """Full HF tensors -> one megatron state dict (global layer names) per TP rank."""
    missing = [n for m in table for n in m.hf_names() if n not in hf_state]
    if missing:
        raise KeyError(f"HF state is missing {len(missing)} tensors, e.g. {missing[:3]}")
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for m in table:
        for rank, t in enumerate(m.to_megatron(hf_state, tp)):
            shards[rank][m.megatron] = t
    return shards


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], table: Sequence[ParamMapping]
                   ) -> dict[str, torch.Tensor]:
    """One megatron state dict per TP rank (global layer names) -> full HF tensors."""
    out: dict[str, torch.Tensor] = {}
    for m in table:
        out.update(m.to_hf([s[m.megatron] for s in shards]))
    return out


def localize_layer_names(names: Sequence[str], offset: int) -> dict[str, str]:
    """Global megatron names -> this pipeline stage's names (``decoder.layers.{i - offset}``)."""
    result = {}
    for name in names:
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            result[name] = f"decoder.layers.{int(index) - offset}.{rest}"
        else:
            result[name] = name
    return result
