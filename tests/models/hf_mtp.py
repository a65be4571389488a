"""The multi-token-prediction head of a released Qwen3.5 checkpoint, for tests. transformers has no MTP module (its
Qwen3.5 models ignore ``mtp.*`` on load), so the head is assembled under the names vLLM's Qwen3.5 MTP drafter loads
(``vllm/model_executor/models/qwen3_5_mtp.py``): ``fc`` ``[hidden, 2 * hidden]``, the norms ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden`` and ``norm``, and ``layers.0``, a gated-attention decoder layer built by transformers
(``Qwen3_5DecoderLayer``), so that the layer's names and shapes come from transformers, not from this project."""

import torch

MTP = "mtp."


def hf_mtp_tensors(preset, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    generator = torch.Generator().manual_seed(seed)
    h = preset.hidden_size
    layer = Qwen3_5DecoderLayer(preset.family.hf_config(preset), preset.layer_types().index("full_attention"))
    shapes = {f"{MTP}fc.weight": (h, 2 * h), **{f"{MTP}{n}.weight": (h,) for n in
                                                 ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
              **{f"{MTP}layers.0.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def hf_mtp_loss_and_grads(model, head: dict[str, torch.Tensor], batch: dict, scale: float):
    """The objective of a run that trains the head, from transformers' Qwen3.5 (``model``) with the head wired as
    vLLM's drafter runs it: at position t, ``fc(cat(pre_fc_norm_embedding(embed(x[t+1])), pre_fc_norm_hidden(h[t])))``
    through ``layers.0`` and ``norm`` to the shared ``lm_head`` predicts x[t+2], where h is the model's last hidden
    state. The main masked mean cross entropy plus ``scale`` times the head's, over the positions of the loss mask
    rolled left once (the last one has no x[t+2]); returns it and every gradient (the head's under its HF names)."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    config = model.config
    h, eps = config.hidden_size, config.rms_norm_eps
    mtp = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        **{n: Qwen3_5RMSNorm(h, eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
        "layers": torch.nn.ModuleList([Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))]),
    })
    mtp.load_state_dict({k.removeprefix(MTP): v for k, v in head.items()})
    model.zero_grad()
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    hidden = model.model(tokens).last_hidden_state
    ce = lambda hs, y: F.cross_entropy(model.lm_head(hs).flatten(0, 1).float(), y.flatten(), reduction="none")  # noqa: E731
    main = (ce(hidden, labels) * mask.flatten()).sum() / mask.sum()
    next_tokens = torch.cat([tokens[:, 1:], labels[:, -1:]], dim=1)
    x = mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](model.model.embed_tokens(next_tokens)),
                             mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    x = mtp["layers"][0](x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=causal,
                         position_ids=positions)
    mtp_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    mtp_labels = torch.cat([labels[:, 1:], torch.zeros_like(labels[:, :1])], dim=1)
    loss = main + scale * (ce(mtp["norm"](x), mtp_labels) * mtp_mask.flatten()).sum() / mtp_mask.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads | {MTP + n: p.grad.detach().clone() for n, p in mtp.named_parameters()}
