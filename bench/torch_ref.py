"""The torch reference experts (both model kinds): same weights, same loss, computed by torch.nn.LSTM with
autograd available.

Used for the ORT parity test, the true gradient in bench/variance.py, and the first-order baseline.
Never imported by worker/, soma_edge/ or export/.
"""

from __future__ import annotations

import numpy as np
import torch

from soma_edge.config import ModelConfig
from soma_edge.expert.params import VOCAB, from_torch_gates, layout, to_torch_gates


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
        return self._flat(lambda p: p.grad.detach().numpy())

    def flat_weights(self) -> np.ndarray:
        """The weights, as a flat vector in soma-edge's layout (load_flat's inverse)."""
        return self._flat(lambda p: p.detach().numpy())

    def _flat(self, g) -> np.ndarray:
        """`g(parameter)` (its weights or its gradient, as an array) of every parameter, in the flat layout."""
        lay = layout(self.m)
        out = np.empty(lay.size, dtype=np.float32)
        v = lay.views(out)
        H = self.m.hidden
        v["embed"][...] = g(self.embed.weight)
        for layer in range(self.m.layers):
            v[f"lstm{layer}.W"][0] = from_torch_gates(g(getattr(self.lstm, f"weight_ih_l{layer}")), H)
            v[f"lstm{layer}.R"][0] = from_torch_gates(g(getattr(self.lstm, f"weight_hh_l{layer}")), H)
            v[f"lstm{layer}.B"][0, : 4 * H] = from_torch_gates(g(getattr(self.lstm, f"bias_ih_l{layer}")), H)
            v[f"lstm{layer}.B"][0, 4 * H :] = from_torch_gates(g(getattr(self.lstm, f"bias_hh_l{layer}")), H)
        v["head.W"][...] = g(self.head.weight).T
        v["head.b"][...] = g(self.head.bias)
        return out

    def hidden(self, x: torch.Tensor, state: list[torch.Tensor] | None = None):
        """Top-layer outputs [B, T, H] and the final (h, c) per layer, from `state` (h0, c0, h1, c1, ...)."""
        init = None if state is None else (torch.cat(state[0::2]), torch.cat(state[1::2]))
        h, (hn, cn) = self.lstm(self.embed(x), init)
        return h, [t for layer in range(self.m.layers) for t in (hn[layer : layer + 1], cn[layer : layer + 1])]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)

    def decoder_grad(self) -> np.ndarray:
        g_w = self.head.weight.grad.detach().numpy().T  # torch stores [256, H]; ONNX head.W is [H, 256]
        return np.concatenate([g_w.reshape(-1), self.head.bias.grad.detach().numpy()])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _ce(self.logits(self.hidden(x)[0]), y)


class TorchSomaExpert(torch.nn.Module):
    """The paper's expert: pre-norm residual blocks (bias-free LSTM, bias-free MLP with exact GELU, gain-only
    LayerNorm), a final LayerNorm, and one byte matrix E tied as embedding and decoder."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        d = m.hidden
        self.E = torch.nn.Parameter(torch.zeros(VOCAB, d))
        self.lstms = torch.nn.ModuleList(torch.nn.LSTM(d, d, bias=False, batch_first=True) for _ in range(m.layers))
        self.w1 = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(d, 4 * d)) for _ in range(m.layers))
        self.w2 = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(4 * d, d)) for _ in range(m.layers))
        self.g1 = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(d)) for _ in range(m.layers))
        self.g2 = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(d)) for _ in range(m.layers))
        self.gf = torch.nn.Parameter(torch.ones(d))

    def _pairs(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(flat name, torch tensor, whether it is an LSTM matrix in torch's gate order)."""
        out = []
        for b in range(self.m.layers):
            p = f"block{b}."
            out += [
                (p + "ln1.g", self.g1[b], False),
                (p + "lstm.W", self.lstms[b].weight_ih_l0, True),
                (p + "lstm.R", self.lstms[b].weight_hh_l0, True),
                (p + "ln2.g", self.g2[b], False),
                (p + "mlp.W1", self.w1[b], False),
                (p + "mlp.W2", self.w2[b], False),
            ]
        return out + [("ln_f.g", self.gf, False), ("E", self.E, False)]

    def load_flat(self, flat: np.ndarray) -> "TorchSomaExpert":
        v = layout(self.m).views(flat)
        with torch.no_grad():
            for name, t, gates in self._pairs():
                a = v[name][0] if gates else v[name]
                t.copy_(torch.from_numpy(to_torch_gates(a, self.m.hidden) if gates else a.copy()))
        return self

    def flat_grad(self) -> np.ndarray:
        return self._flat(lambda p: p.grad.detach().numpy())

    def flat_weights(self) -> np.ndarray:
        return self._flat(lambda p: p.detach().numpy())

    def _flat(self, get) -> np.ndarray:
        out = np.empty(layout(self.m).size, dtype=np.float32)
        v = layout(self.m).views(out)
        for name, t, gates in self._pairs():
            g = get(t)
            if gates:
                v[name][0] = from_torch_gates(g, self.m.hidden)
            else:
                v[name][...] = g
        return out

    def _ln(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (self.m.hidden,), weight=g, bias=None, eps=1e-5)

    def hidden(self, x: torch.Tensor, state: list[torch.Tensor] | None = None):
        """The final LN's output [B, T, d] and each block's final (h, c), from `state` (h0, c0, h1, c1, ...)."""
        r, out = self.E[x], []
        for b in range(self.m.layers):
            init = None if state is None else (state[2 * b], state[2 * b + 1])
            y, (hn, cn) = self.lstms[b](self._ln(r, self.g1[b]), init)
            r = r + y
            u = self._ln(r, self.g2[b]) @ self.w1[b]
            r = r + torch.nn.functional.gelu(u, approximate="none") @ self.w2[b]
            out += [hn, cn]
        return self._ln(r, self.gf), out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.E.T

    def decoder_grad(self) -> np.ndarray:
        return self.E.grad.detach().numpy().reshape(-1).copy()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _ce(self.logits(self.hidden(x)[0]), y)


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference(m: ModelConfig, flat: np.ndarray | None = None) -> "TorchExpert | TorchSomaExpert":
    """The torch module for `m`'s kind, loaded with `flat` if given."""
    model = TorchSomaExpert(m) if m.kind == "soma" else TorchExpert(m)
    return model if flat is None else model.load_flat(flat)


def torch_loss(m: ModelConfig, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    model = reference(m, flat)
    with torch.no_grad():
        return float(model(torch.from_numpy(x), torch.from_numpy(y)))


def decoder_path_grad(m: ModelConfig, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """(loss, autograd's gradient of the loss with respect to the decoder alone, hidden states detached),
    the gradient flat in soma-edge's layout order ([head.W [H, 256], head.b], or E [256, d] for the tied
    kind, whose embedding role is cut off by the detach): what the delta rule computes."""
    model = reference(m, flat)
    with torch.no_grad():
        h, _ = model.hidden(torch.from_numpy(x))
    loss = _ce(model.logits(h.detach()), torch.from_numpy(y))
    loss.backward()
    return loss.item(), model.decoder_grad().astype(np.float32)


def stream_logits(m: ModelConfig, flat: np.ndarray, x: np.ndarray, state: list[np.ndarray] | None = None):
    """(logits [B, T, 256], states after x in the streaming graph's order) from the torch reference."""
    model = reference(m, flat)
    with torch.no_grad():
        st = None if state is None else [torch.from_numpy(s) for s in state]
        h, out = model.hidden(torch.from_numpy(x), st)
        return model.logits(h).numpy(), [s.numpy() for s in out]
