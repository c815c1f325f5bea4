"""The SPSA update as an ONNX graph: spsa.optim.apply_update's float32 arithmetic, node for node, so that an
expert whose weights and optimizer state stay on the device (as OrtValues) can be stepped there, and on the
CPU EP the result equals the numpy update (and so its replay) bit for bit.

One step, over the perturbed tensors (the Stepper's body) and, with `decoder`, the delta-rule decoder:
- acc = 0, then acc = acc + g_j z_j for j = 0 .. k-1 in index order (spsa.stepper._accumulate), one Mul and one Add
  per direction and tensor. z_j comes from the population graph's own noise inputs (population_graph.
  noise_inputs, with k = K*A directions: for A = 1 the very arrays a population call took), expanded
  exactly: keyed bits (and masks) through their tables, once per direction for every tensor, int8 signs by
  Cast, rank-1 a_j b_j^T by a Mul of the two cast factors (every entry ±1);
- u = acc / float32(K*A); u = u + wd*w (coupled weight decay, when > 0);
- Adam (bias-corrected; spsa.optim._adam's order: m*b1 + (1-b1)*u, v*b2 + (1-b2)*(u*u), m/bc1, v/bc2,
  m_hat / (sqrt(v_hat) + adam_eps)) or, for sgd, heavy-ball momentum buf*mu + u when mu > 0;
- w - lr*u;
- with the delta rule, the decoder gradient (the mean of the A minibatches' `grad.<a>.<name>` in batch order,
  spsa.optim.mean_decoder_grad) takes its own Adam step at the decoder lr.

Every step is its own elementwise node, so no fused multiply-add or reassociation can change a bit; the
constants are the float32 values numpy uses (np.float32(1 - beta1), computed in float64 then rounded, not
1 - np.float32(beta1)). The per-step scalars (lr, decoder lr, the bias corrections) are computed on the
host exactly as spsa.optim.apply_update computes them (`scalars`) and fed as float32 [].

`update = "rms"` divides by a float64 mean over the whole body, a reduction whose summation order (numpy's
pairwise sum) ORT does not reproduce: `supported` says so, and such a run keeps the host update.

The graph is unrolled over the k directions (no Loop: slow on CUDA and refused by graph capture), four to
six small nodes per direction and tensor.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from soma_edge.config import ModelConfig, SPSAConfig
from soma_edge.expert.builder import GraphBuilder, entries
from soma_edge.expert.graph import OPSET
from soma_edge.expert.params import Layout, layout
from soma_edge.expert.population_graph import (
    Noise,
    NoiseInput,
    bits_slices,
    core_shape,
    expand_bits,
    is_matrix,
    noise_inputs,
    perturbed_size,
)
from soma_edge.spsa import optim


def supported(cfg: SPSAConfig) -> str | None:
    """None when the update graph reproduces `cfg`'s host update bit for bit, else one line saying why not."""
    if cfg.update == "rms":
        return (
            "spsa.update = 'rms' scales by a float64 mean over the whole body, whose summation order "
            "ORT does not reproduce: the update runs on the host"
        )
    return None


def _adam_body(cfg: SPSAConfig) -> bool:
    return cfg.update == "adam"


def _momentum(cfg: SPSAConfig) -> bool:
    return cfg.momentum > 0 and cfg.update != "adam"


def _check(model: ModelConfig, cfg: SPSAConfig, k: int, perturbed: Sequence[str], decoder: bool) -> Layout:
    why = supported(cfg)
    if why is not None:
        raise ValueError(why)
    lay = layout(model)
    if k != cfg.directions * cfg.accumulate:
        raise ValueError(
            f"k = {k}: a step sums spsa.directions * spsa.accumulate = {cfg.directions * cfg.accumulate} directions"
        )
    unknown = sorted(set(perturbed) - set(lay.names))
    if unknown or len(set(perturbed)) != len(perturbed):
        raise ValueError(f"perturbed tensors must be distinct layout tensors (unknown: {unknown})")
    if decoder and set(perturbed) & set(lay.decoder):
        raise ValueError("the delta-rule decoder is not perturbed: leave its tensors out of `perturbed`")
    if not perturbed and not decoder:
        raise ValueError("nothing to update: no perturbed tensors and no delta-rule decoder")
    return lay


def update_inputs(
    model: ModelConfig, cfg: SPSAConfig, k: int, perturbed: Sequence[str], noise: Noise | str, decoder: bool
) -> list[NoiseInput]:
    """Every input of `build_update`'s graph, in graph order: name, numpy dtype, shape."""
    lay = _check(model, cfg, k, perturbed, decoder)
    body = [n for n in lay.names if n in perturbed]  # layout order, as the population graph's noise inputs
    shape = dict(zip(lay.names, lay.shapes))
    f32 = np.float32
    out = [NoiseInput(f"w.{n}", f32, shape[n]) for n in body]
    if _adam_body(cfg):
        out += [NoiseInput(f"{s}.{n}", f32, shape[n]) for s in ("m", "v") for n in body]
    if _momentum(cfg):
        out += [NoiseInput(f"mom.{n}", f32, shape[n]) for n in body]
    if body:
        out += noise_inputs(model, k, body, noise)
        out += [NoiseInput("g", f32, (k,)), NoiseInput("lr", f32, ())]
    if decoder:
        out += [NoiseInput(f"{s}.{n}", f32, shape[n]) for s in ("w", "m", "v") for n in lay.decoder]
        out += [NoiseInput(grad_name(n, a), f32, shape[n]) for a in range(cfg.accumulate) for n in lay.decoder]
        out.append(NoiseInput("decoder_lr", f32, ()))
    if (_adam_body(cfg) and body) or decoder:
        out += [NoiseInput("bc1", f32, ()), NoiseInput("bc2", f32, ())]
    return out


def grad_name(name: str, a: int) -> str:
    """The input carrying minibatch a's delta-rule gradient of decoder tensor `name` (a population call's
    output `grad.<name>`)."""
    return f"grad.{a}.{name}"


def update_outputs(inputs: Sequence[NoiseInput]) -> list[str]:
    """The graph's outputs: `new.<input>` for every weight and optimizer-state input (w., m., v., mom.)."""
    return [f"new.{i.name}" for i in inputs if i.name.split(".", 1)[0] in ("w", "m", "v", "mom")]


def _direction(
    g: GraphBuilder, name: str, shape: tuple[int, ...], noise: Noise, entry: dict[str, list[str]], j: int
) -> str:
    """Direction j's float32 z over tensor `name` [*shape], exactly: int8 signs cast (±1, 0), Gaussian as fed,
    or a rank-1 matrix's a_j b_j^T (a product of two ±1, so exact) in the tensor's C order. `entry`: each noise
    input's k entries (`entries`)."""
    if noise is Noise.RANK1 and is_matrix(shape):
        a = g.op("Cast", entry[f"a.{name}"][j], to=TensorProto.FLOAT)
        b = g.op("Cast", entry[f"b.{name}"][j], to=TensorProto.FLOAT)
        outer = g.op("Mul", g.op("Unsqueeze", a, g.i64([1])), g.op("Unsqueeze", b, g.i64([0])))
        return outer if core_shape(shape) == shape else g.op("Reshape", outer, g.i64(list(shape)))
    z = entry[f"z.{name}"][j]
    return z if noise is Noise.GAUSSIAN else g.op("Cast", z, to=TensorProto.FLOAT)


def _adam(g: GraphBuilder, cfg: SPSAConfig, name: str, grad: str) -> str:
    """spsa.optim._adam on `grad` with moments m.<name>, v.<name> -> new.m., new.v.; returns the Adam direction."""
    m = g.op(
        "Add",
        g.op("Mul", f"m.{name}", g.f32(np.float32(cfg.beta1))),
        g.op("Mul", g.f32(np.float32(1 - cfg.beta1)), grad),
        out=f"new.m.{name}",
    )
    gg = g.op("Mul", grad, grad)
    v = g.op(
        "Add",
        g.op("Mul", f"v.{name}", g.f32(np.float32(cfg.beta2))),
        g.op("Mul", g.f32(np.float32(1 - cfg.beta2)), gg),
        out=f"new.v.{name}",
    )
    m_hat, v_hat = g.op("Div", m, "bc1"), g.op("Div", v, "bc2")
    return g.op("Div", m_hat, g.op("Add", g.op("Sqrt", v_hat), g.f32(np.float32(cfg.adam_eps))))


def _sums(g: GraphBuilder, model: ModelConfig, perturbed: Sequence[str], noise: Noise, k: int) -> dict[str, str]:
    """Each perturbed tensor's acc = 0 + g_0 z_0 + g_1 z_1 + ... in index order (spsa.stepper._accumulate; 0 + x is
    numpy's first sum too: -0 -> +0). Directions outermost, so that BITS expands direction j once for all
    tensors and the device holds one expanded direction at a time. The input g and the noise inputs are read
    an entry per direction, as trees (`entries`: no tensor read in more than MAX_FANIN pieces)."""
    lay = layout(model)
    names = [n for n in lay.names if n in perturbed]  # layout order, whatever the order of `perturbed`
    shapes = {n: tuple(lay.shapes[lay.names.index(n)]) for n in names}
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    acc = {n: g.once("ConstantOfShape", g.i64(list(shapes[n])), value=zero) for n in names}
    entry = {i.name: entries(g, i.name, 0, k) for i in noise_inputs(model, k, names, noise)}
    for j, gj in enumerate(entries(g, "g", 0, k)):
        if noise.keyed:
            keep = entry["keep"][j] if noise is Noise.SPARSE_BITS else None
            signs = expand_bits(g, entry["bits"][j], keep, perturbed_size(model, names), [])
            zs = bits_slices(g, model, signs, names, [])
        else:
            zs = {n: _direction(g, n, shapes[n], noise, entry, j) for n in names}
        for n in names:
            acc[n] = g.op("Add", acc[n], g.op("Mul", gj, zs[n]))
    return acc


def _body_update(g: GraphBuilder, cfg: SPSAConfig, name: str, acc: str, k: int) -> None:
    """new.w.<name> (and its optimizer state) from the k directions' sum acc, as spsa.optim.apply_update's body step."""
    u = g.op("Div", acc, g.f32(np.float32(k)))
    if cfg.weight_decay > 0:
        u = g.op("Add", u, g.op("Mul", g.f32(np.float32(cfg.weight_decay)), f"w.{name}"))
    if _adam_body(cfg):
        u = _adam(g, cfg, name, u)
    elif _momentum(cfg):
        u = g.op("Add", g.op("Mul", f"mom.{name}", g.f32(np.float32(cfg.momentum))), u, out=f"new.mom.{name}")
    g.op("Sub", f"w.{name}", g.op("Mul", "lr", u), out=f"new.w.{name}")


def _decoder_update(g: GraphBuilder, cfg: SPSAConfig, name: str) -> None:
    """new.w.<name> of a decoder tensor: Adam on the minibatches' mean delta-rule gradient (mean_decoder_grad:
    summed in batch order, then divided by float32(A) when A > 1), at the decoder lr."""
    grad = grad_name(name, 0)
    for a in range(1, cfg.accumulate):
        grad = g.op("Add", grad, grad_name(name, a))
    if cfg.accumulate > 1:
        grad = g.op("Div", grad, g.f32(np.float32(cfg.accumulate)))
    g.op("Sub", f"w.{name}", g.op("Mul", "decoder_lr", _adam(g, cfg, name, grad)), out=f"new.w.{name}")


def build_update(
    model: ModelConfig, cfg: SPSAConfig, k: int, perturbed: Sequence[str], noise: Noise | str, decoder: bool
) -> onnx.ModelProto:
    """The update graph of one expert shape (module docstring): k = spsa.directions * spsa.accumulate
    directions over the tensors `perturbed` (noise in the population graph's form `noise`), and with
    `decoder` the delta-rule decoder's Adam step. Inputs: `update_inputs`; outputs: `update_outputs`."""
    noise = Noise(noise)
    inputs = update_inputs(model, cfg, k, perturbed, noise, decoder)
    lay = layout(model)
    g = GraphBuilder(k)
    for name, acc in _sums(g, model, perturbed, noise, k).items():
        _body_update(g, cfg, name, acc, k)
    if decoder:
        for name in lay.decoder:
            _decoder_update(g, cfg, name)
    shapes = {i.name: i.shape for i in inputs}
    graph = helper.make_graph(
        g.nodes,
        "soma_expert_update",
        [
            helper.make_tensor_value_info(i.name, helper.np_dtype_to_tensor_dtype(np.dtype(i.dtype)), list(i.shape))
            for i in inputs
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(shapes[o[4:]])) for o in update_outputs(inputs)],
        g.inits,
    )
    graph.doc_string = (
        f"soma-edge SPSA update: kind {model.kind!r}, k = {k}, noise {noise.value!r}, update {cfg.update!r}"
    )
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="soma-edge")
    out.ir_version = 8  # as graph.py's
    onnx.checker.check_model(out)
    return out


# --- host side -----------------------------------------------------------------------------------------


STEP_INPUTS = ("g", "lr", "decoder_lr", "bc1", "bc2")  # what the host feeds each step: the g_j and `scalars`


def scalars(cfg: SPSAConfig, step: int, adam_t: int, lr_scale: float) -> dict[str, np.ndarray]:
    """The step's float32 scalar inputs, computed as spsa.optim.apply_update computes them for a state at `step` whose
    Adam moments are behind `adam_t` updates: lr, decoder_lr, bc1 = float32(1 - beta1**t), bc2 (t = adam_t+1)."""
    t = adam_t + 1
    return {
        "lr": np.array(np.float32(optim.schedule(cfg, step, lr_scale)[0])),
        "decoder_lr": np.array(np.float32(optim.decoder_lr(cfg, step, lr_scale))),
        "bc1": np.array(np.float32(1 - cfg.beta1**t)),
        "bc2": np.array(np.float32(1 - cfg.beta2**t)),
    }


def update_feeds(
    model: ModelConfig,
    cfg: SPSAConfig,
    state: optim.State,
    g: np.ndarray,
    noise: dict[str, np.ndarray],
    decoder_grads: Sequence[dict[str, np.ndarray]] = (),
) -> dict[str, np.ndarray]:
    """Every feed a step's update graph may take, from a host State (its weights, moments and momentum as
    per-tensor views; zeros where the state has none yet, as spsa creates them), the step's projected
    gradients g (cast to float32, as spsa.stepper._accumulate does), its noise inputs, and per minibatch the
    population's decoder gradients {"grad.<name>": ...}. `run_update` takes the ones its graph needs."""
    lay = layout(model)
    n = lay.size
    opt = state.opt
    m, v = (opt.adam_m, opt.adam_v) if opt.adam_m is not None else (np.zeros(n, np.float32), np.zeros(n, np.float32))
    mom = opt.momentum if opt.momentum is not None else np.zeros(n, np.float32)
    feeds: dict[str, np.ndarray] = {}
    for prefix, flat in (("w", state.weights), ("m", m), ("v", v), ("mom", mom)):
        feeds.update({f"{prefix}.{k}": a for k, a in lay.views(flat).items()})
    feeds.update(noise)
    feeds["g"] = np.asarray(g).astype(np.float32)
    for a, grads in enumerate(decoder_grads):
        feeds.update({grad_name(k[len("grad.") :], a): x for k, x in grads.items()})
    feeds.update(scalars(cfg, state.step, opt.adam_t, opt.lr_scale))
    return feeds


def run_update(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One update on an ORT session of `build_update`'s graph: {output name: array}, from the feeds it takes."""
    names = [o.name for o in session.get_outputs()]
    outs = session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})
    return dict(zip(names, outs))


def write_back(
    model: ModelConfig, cfg: SPSAConfig, state: optim.State, outs: dict[str, np.ndarray], decoder: bool
) -> None:
    """Put an update's outputs into a host State and advance its counters as spsa.optim.apply_update does (the step; the
    Adam count when Adam ran), so the State equals the one apply_update would have left."""
    store(model, cfg, state, {name[len("new.") :]: value for name, value in outs.items()}, decoder)
    advance(cfg, state, decoder)


def store(
    model: ModelConfig, cfg: SPSAConfig, state: optim.State, arrays: dict[str, np.ndarray], decoder: bool
) -> None:
    """Put per-tensor arrays named as the update graph's inputs (`w.<name>`, `m.<name>`, `v.<name>`,
    `mom.<name>`) into a host State's flat vectors, creating the moments where spsa would have."""
    lay = layout(model)
    opt, n = state.opt, lay.size
    if (_adam_body(cfg) or decoder) and opt.adam_m is None:
        opt.adam_m, opt.adam_v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    if _momentum(cfg) and opt.momentum is None:
        opt.momentum = np.zeros(n, np.float32)
    flats = {"w": state.weights, "m": opt.adam_m, "v": opt.adam_v, "mom": opt.momentum}
    for name, value in arrays.items():
        prefix, tensor = name.split(".", 1)
        lay.views(flats[prefix])[tensor][...] = value


def advance(cfg: SPSAConfig, state: optim.State, decoder: bool) -> None:
    """A step's counters, as spsa.optim.apply_update advances them: the step, and the Adam count when Adam ran."""
    if _adam_body(cfg) or decoder:
        state.opt.adam_t += 1
    state.step += 1
