"""The paper's vanilla Transformer: ``nn.Transformer`` with d_model 2048, ReLU and dropout.

Use it as a model spec: ``configs/transformer.py:transformer_h2048``. The paper feeds the same
embeddings (B, 256, d_model) to the encoder and the decoder and projects the decoder's output onto
a 1000-word vocabulary; ``transformer_h2048_inputs`` supplies those embeddings.

NOTE [what memsave converts here]: ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``
apply ReLU as a plain function, which ``memsave_cli.layers.convert`` swaps for its 1-bit-mask ReLU;
their ``nn.Dropout`` submodules become memsave dropouts. The dropout inside ``nn.MultiheadAttention``
is a ``dropout_p`` argument of scaled dot-product attention, not a module, and stays stock.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

D_MODEL = 2048
SEQUENCE_LENGTH = 256
VOCABULARY = 1000


class VanillaTransformer(nn.Module):
    """Encoder-decoder ``nn.Transformer`` whose decoder reads the encoder's output of the same input."""

    def __init__(self, d_model: int, vocabulary: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=d_model,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            dropout=dropout,
            activation="relu",
            batch_first=True,
        )
        self.pred = nn.Linear(d_model, vocabulary)

    def forward(self, x: Tensor) -> Tensor:
        memory = self.transformer.encoder(x)
        return self.pred(self.transformer.decoder(x, memory))


def transformer_h2048(
    vocabulary: int = VOCABULARY,
    layers: int = 6,
    dropout: float = 0.1,
    attention_dropout: float | None = None,
) -> nn.Module:
    """The paper's Transformer (H = 2048): 6 encoder and 6 decoder layers, 8 heads, FF 2048.

    ``attention_dropout`` overrides the dropout inside attention only (default: ``dropout``), to
    measure what attention with dropout keeps apart from the rest.
    """
    model = VanillaTransformer(D_MODEL, vocabulary, layers, dropout)
    if attention_dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = attention_dropout
    return model


def transformer_h2048_inputs(batch_size: int) -> Tensor:
    """Embeddings of shape (batch_size, 256, 2048), as the paper feeds them."""
    return torch.randn(batch_size, SEQUENCE_LENGTH, D_MODEL)
