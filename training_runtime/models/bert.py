"""BERT and RoBERTa masked LMs with Hugging Face parameter names.

Both are post-LayerNorm bidirectional encoders; padding is a key mask built from
``attention_mask``. RoBERTa differs in its names (``roberta.``, ``lm_head.``) and its position
ids: real tokens count from ``pad_token_id + 1`` and padding tokens sit at ``pad_token_id``.
The output decoder's weight is tied to the word embeddings; its bias is the head's ``bias``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from dtrain.runtime.models.attention import attention
from dtrain.runtime.models.common import (
    Activation,
    HFCompatibleModel,
    activation,
    activation_then_linear,
    config_value,
    require,
)
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    type_vocab_size: int
    pad_token_id: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> BertConfig:
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={config['position_embedding_type']!r} "
                             "is not supported; use 'absolute'")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError("BERT/RoBERTa as a decoder is not supported; set is_decoder and "
                             "add_cross_attention to false")
        hidden = int(require(config, "hidden_size"))
        heads = int(require(config, "num_attention_heads"))
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads}; pick a multiple")
        return cls(
            hidden_size=hidden,
            num_layers=int(require(config, "num_hidden_layers")),
            num_heads=heads,
            intermediate_size=int(config_value(config, "intermediate_size", default=4 * hidden)),
            vocab_size=int(require(config, "vocab_size")),
            max_positions=int(config_value(config, "max_position_embeddings", default=512)),
            type_vocab_size=int(config_value(config, "type_vocab_size", default=2)),
            pad_token_id=int(config_value(config, "pad_token_id", default=0)),
            layer_norm_eps=float(config_value(config, "layer_norm_eps", default=1e-12)),
            hidden_act=str(config_value(config, "hidden_act", default="gelu")),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_positions,
            "type_vocab_size": self.type_vocab_size, "pad_token_id": self.pad_token_id,
            "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act,
        }


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, *, roberta_positions: bool) -> None:
        super().__init__()
        self.roberta_positions = roberta_positions
        self.pad_token_id = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(
            config.max_positions, config.hidden_size,
            padding_idx=config.pad_token_id if roberta_positions else None)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.roberta_positions:
            return torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        is_token = (input_ids != self.pad_token_id).long()
        return torch.cumsum(is_token, dim=1) * is_token + self.pad_token_id

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
                ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(self.position_ids(input_ids)))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig, *, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        # scale: attention's default, 1/sqrt(head_dim)
        out = attention(q, k, v, backend=self.backend, causal=False,
                        key_padding_mask=attention_mask)
        return out.transpose(1, 2).reshape(batch, seq, -1)


class BertResidualOutput(nn.Module):
    """dense -> add the residual -> LayerNorm (post-LN), HF's BertSelfOutput/BertOutput."""

    def __init__(self, in_features: int, config: BertConfig, *,
                 act: Activation | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = act  # BertOutput applies the intermediate activation (see BertIntermediate)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.dense(x) if self.act is None else activation_then_linear(x, self.act, self.dense)
        return self.LayerNorm(out + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, *, backend: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, backend=backend)
        self.output = BertResidualOutput(config.hidden_size, config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, attention_mask), x)


class BertIntermediate(nn.Module):
    """The MLP's first projection. Its activation is applied by the layer's output module,
    together with the second projection, so only the pre-activation is kept for backward."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, *, backend: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, backend=backend)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config.intermediate_size, config,
                                         act=activation(config.hidden_act))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention(x, attention_mask)
        return self.output(self.intermediate(x), x)


class RobertaLayer(BertLayer):
    """Same computation; its own class so ``_no_split_modules`` names what HF names."""


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, *, layer_class: type[BertLayer], backend: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layer_class(config, backend=backend)
                                   for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, attention_mask)
        return x


class BertModel(nn.Module):
    """The encoder without a pooler: masked-LM checkpoints carry none."""

    def __init__(self, config: BertConfig, *, roberta: bool, backend: str) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, roberta_positions=roberta)
        self.encoder = BertEncoder(config, layer_class=RobertaLayer if roberta else BertLayer,
                                   backend=backend)

    def forward(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, token_type_ids), attention_mask)


class BertPredictionTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x)) + self.bias


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictions(x)


class RobertaLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # RoBERTa's head always uses exact GELU, whatever hidden_act says
        x = self.layer_norm(nn.functional.gelu(self.dense(x)))
        return self.decoder(x) + self.bias


class BertForMaskedLM(HFCompatibleModel):
    model_type = "bert"
    hf_architecture = "BertForMaskedLM"
    base_model_prefix = "bert"
    head_name = "cls.predictions"
    _no_split_modules: ClassVar[list[str]] = ["BertLayer"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    # pre-training checkpoints carry a pooler and next-sentence head a masked LM does not use
    _ignored_hf_keys = (r"^(bert|roberta)\.pooler\.", r"^cls\.seq_relationship\.",
                        r"embeddings\.(position_ids|token_type_ids)$")

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        super().__init__(hf_config, attention=attention)
        self.config = BertConfig.from_hf(hf_config)
        self.bert = BertModel(self.config, roberta=False, backend=attention)
        self.cls = BertOnlyMLMHead(self.config)
        self.tie_weights()

    def encode(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.bert(input_ids, attention_mask, token_type_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.cls(self.encode(input_ids, attention_mask, token_type_ids))

    def from_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Older checkpoints store the decoder bias twice (decoder.bias and bias): keep one.
        state_dict = dict(state_dict)
        decoder_bias = state_dict.pop(f"{self.head_name}.decoder.bias", None)
        if decoder_bias is not None:
            state_dict.setdefault(f"{self.head_name}.bias", decoder_bias)
        return super().from_hf_state_dict(state_dict)


class RobertaForMaskedLM(BertForMaskedLM):
    model_type = "roberta"
    hf_architecture = "RobertaForMaskedLM"
    base_model_prefix = "roberta"
    head_name = "lm_head"
    _no_split_modules: ClassVar[list[str]] = ["RobertaLayer"]
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight"}

    def __init__(self, hf_config: dict[str, Any], *, attention: str = "flash") -> None:
        HFCompatibleModel.__init__(self, {"pad_token_id": 1, **hf_config}, attention=attention)
        self.config = BertConfig.from_hf(self.hf_config)
        self.roberta = BertModel(self.config, roberta=True, backend=attention)
        self.lm_head = RobertaLMHead(self.config)
        self.tie_weights()

    def encode(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.roberta(input_ids, attention_mask, token_type_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.encode(input_ids, attention_mask, token_type_ids))
