"""The torch reference expert: same weights, same loss, computed by torch.nn.LSTM with autograd available.

Used for the ORT parity test, the true gradient in bench/variance.py, and the first-order baseline.
Never imported by worker/, soma_edge/ or export/.
"""

from __future__ import annotations

import numpy as np
import torch

from soma_edge.config import ModelConfig
from soma_edge.params import VOCAB, from_torch_gates, layout, to_torch_gates


class TorchExpert(torch.nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        self.embed = torch.nn.Embedding(VOCAB, m.embed)
        self.lstm = torch.nn.LSTM(m.embed, m.hidden, num_layers=m.layers, batch_first=True)
        self.head = torch.nn.Linear(m.hidden, VOCAB)

    def load_flat(self, flat: np.ndarray) -> "TorchExpert":
        """Copy a soma-edge flat vector (ONNX layout, gates i,o,f,c) into the torch modules."""
        v = layout(self.m).views(flat)
        H = self.m.hidden
        with torch.no_grad():
            self.embed.weight.copy_(torch.from_numpy(v["embed"].copy()))
            for layer in range(self.m.layers):
                W, R, B = v[f"lstm{layer}.W"][0], v[f"lstm{layer}.R"][0], v[f"lstm{layer}.B"][0]
                getattr(self.lstm, f"weight_ih_l{layer}").copy_(torch.from_numpy(to_torch_gates(W, H)))
                getattr(self.lstm, f"weight_hh_l{layer}").copy_(torch.from_numpy(to_torch_gates(R, H)))
                getattr(self.lstm, f"bias_ih_l{layer}").copy_(torch.from_numpy(to_torch_gates(B[: 4 * H], H)))
                getattr(self.lstm, f"bias_hh_l{layer}").copy_(torch.from_numpy(to_torch_gates(B[4 * H :], H)))
            # ONNX computes rows @ head.W with head.W [H, 256]; torch Linear stores [256, H].
            self.head.weight.copy_(torch.from_numpy(v["head.W"].T.copy()))
            self.head.bias.copy_(torch.from_numpy(v["head.b"].copy()))
        return self

    def flat_grad(self) -> np.ndarray:
        """The gradient of the last backward pass, as a flat vector in soma-edge's layout."""
        lay = layout(self.m)
        out = np.empty(lay.size, dtype=np.float32)
        v = lay.views(out)
        H = self.m.hidden
        g = lambda p: p.grad.detach().numpy()  # noqa: E731
        v["embed"][...] = g(self.embed.weight)
        for layer in range(self.m.layers):
            v[f"lstm{layer}.W"][0] = from_torch_gates(g(getattr(self.lstm, f"weight_ih_l{layer}")), H)
            v[f"lstm{layer}.R"][0] = from_torch_gates(g(getattr(self.lstm, f"weight_hh_l{layer}")), H)
            v[f"lstm{layer}.B"][0, : 4 * H] = from_torch_gates(g(getattr(self.lstm, f"bias_ih_l{layer}")), H)
            v[f"lstm{layer}.B"][0, 4 * H :] = from_torch_gates(g(getattr(self.lstm, f"bias_hh_l{layer}")), H)
        v["head.W"][...] = g(self.head.weight).T
        v["head.b"][...] = g(self.head.bias)
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def torch_loss(m: ModelConfig, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    model = TorchExpert(m).load_flat(flat)
    with torch.no_grad():
        return float(model(torch.from_numpy(x), torch.from_numpy(y)))


def decoder_path_grad(m: ModelConfig, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(loss, autograd's gradient of the loss with respect to the head alone, hidden states detached),
    the gradient flat in soma-edge's layout order [head.W [H, 256], head.b]: what the delta rule computes."""
    model = TorchExpert(m).load_flat(flat)
    with torch.no_grad():
        h, _ = model.lstm(model.embed(torch.from_numpy(x)))
    logits = model.head(h.detach())
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1))
    loss.backward()
    g_w = model.head.weight.grad.detach().numpy().T  # torch stores [256, H]; ONNX head.W is [H, 256]
    g_b = model.head.bias.grad.detach().numpy()
    return loss.item(), np.concatenate([g_w.reshape(-1), g_b]).astype(np.float32)
