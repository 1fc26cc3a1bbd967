"""The decoder shapes the scaling study plans: Llama-2 7B and 70B."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShapes:
    """A Llama-style decoder: the dims that fix every parameter's shape."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` in ``named_parameters`` order of Hugging Face's ``LlamaForCausalLM``.

        Linear weights are ``(out_features, in_features)``; k/v project to
        ``kv_heads * head_dim`` (grouped-query attention when kv_heads < heads).
        """
        h, inter = self.hidden, self.intermediate
        kv = self.kv_heads * (h // self.heads)
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


# The published configurations: Hugging Face meta-llama/Llama-2-7b-hf and
# meta-llama/Llama-2-70b-hf, config.json (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size;
# tie_word_embeddings false), and Touvron et al. 2023, "Llama 2", arXiv
# 2307.09288, Table 1 (grouped-query attention for 70B). The parameter counts
# these give, 6,738,415,616 and 68,976,648,192, are the published ones (tested).
LLAMA2_7B = DecoderShapes("llama-2-7b", vocab=32000, hidden=4096, layers=32, heads=32,
                          kv_heads=32, intermediate=11008)
LLAMA2_70B = DecoderShapes("llama-2-70b", vocab=32000, hidden=8192, layers=80, heads=64,
                           kv_heads=8, intermediate=28672)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_70B)}
