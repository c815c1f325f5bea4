"""Central-difference SPSA on the body, the exact delta rule on the decoder, forward passes only.

One step at weights w, for each of A minibatches (`accumulate`) and each of its K directions:
z comes from a counter-based RNG keyed by (seed, expert, step, a*K + k), optionally sparsified by a mask
from the same key, or (`noise = "rank1"`) built as a·bᵀ per weight matrix from m + n of the key's signs
(soma_edge.spsa.noise); g = (L(w+εz) - L(w-εz)) / 2ε; the estimate is ĝ = (1/AK) Σ s(g) z over the body only,
s the step's shaping of its scalars (soma_edge.spsa.shaping; none by default). Each direction's probes see the
whole minibatch, or with `split_rows` their own 1/K of its rows. With `decoder = "delta"`, one clean forward
per minibatch at w gives the step's clean loss and the exact gradient of the loss with respect to the decoder
(hidden states held fixed), which takes its own Adam step; with `decoder_from = "probes"` that gradient is
the mean of the probes' own instead, and no clean forward runs. The body's estimate goes through the
configured update (soma_edge.spsa.optim).

The noise (and its mask) is regenerated from its key and never stored (as in MeZO), so a step replays from
(key, g_1..g_AK) plus, for the delta-rule decoder, its dense gradient: `Stepper.replay` gives bit-identical
weights, because it runs the same float32 element-wise arithmetic in the same order (no BLAS anywhere in
the update). While ORT evaluates one direction (ORT releases the GIL), another thread draws the next one's
noise.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from soma_edge.config import SPSAConfig
from soma_edge.spsa.noise import (
    Rank1,
    add_rademacher,
    add_rank1,
    body_shapes,
    expand_bits,
    expand_keep,
    noise,
    noise_bits,
    probe_mask,
    rank1_factors,
    rank1_probe,
)
from soma_edge.spsa.optim import State, apply_update, mean_decoder_grad, schedule
from soma_edge.spsa.shaping import shape

LossFn = Callable[[np.ndarray], float]
PartFn = Callable[[np.ndarray, int, int], float]  # (w, i, n): the loss on part i of the minibatch's rows in n parts
PartCleanFn = Callable[[np.ndarray, int, int], tuple[float, np.ndarray]]  # ... and its decoder gradient
ProbeFn = Callable[[np.ndarray], "float | tuple[float, np.ndarray]"]  # a probe's loss, or (loss, decoder gradient)
CleanFn = Callable[[np.ndarray], tuple[float, np.ndarray]]


class Population(NamedTuple):
    """One population call (soma_edge.engine.population): the clean loss, the clean decoder gradient
    (float32, flat[layout.body:]'s length; None without decoder_grad), and the losses at w + eps z_j (lp)
    and w - eps z_j (lm), float[K]."""

    loss: float
    decoder_grad: np.ndarray | None
    lp: np.ndarray
    lm: np.ndarray


@dataclass
class Probes:
    """One minibatch's K directions, for an evaluator that takes them all at once: z float32[K, body] as
    the Stepper draws them (Gaussian), or, with rank-1 probes, each direction's `rank1_factors`, or, for
    Rademacher probes, their `noise_bits` uint8[K, bits_bytes(body)] and, sparse, their packed masks `keep`
    (z None for both)."""

    z: np.ndarray | None
    factors: list[list[Rank1 | np.ndarray]] | None = None
    bits: np.ndarray | None = None
    keep: np.ndarray | None = None  # sparse probes: uint8[K, ceil(body / 8)], each one's mask, np.packbits'd

    def direction(self, i: int, body: int) -> np.ndarray:
        """Direction i's z float32[body] from its bits (and mask): the Stepper's `_z`, bit for bit."""
        if self.bits is None:
            raise ValueError("these directions carry no keyed bits")
        z = expand_bits(self.bits[i], body)
        if self.keep is not None:
            z *= expand_keep(self.keep[i], body)  # exact: multiplies by 1.0 or 0.0, as _z
        return z

    def dense(self, body: int) -> np.ndarray:
        """z float32[K, body], expanded from the bits where the directions came as bits."""
        if self.z is not None:
            return self.z
        if self.bits is None:
            raise ValueError("rank-1 directions have no dense z here: they cross as their factors")
        return np.stack([self.direction(i, body) for i in range(len(self.bits))])

    def add_to(self, acc: np.ndarray, coefs: Sequence[float]) -> None:
        """acc += float32(coefs[i]) z_i for each direction i in order: for Rademacher and rank-1 directions
        from their bits or factors without building any z whole (soma_edge.spsa.noise.add_rademacher,
        add_rank1), bit for bit what adding each one's float32(c) z in turn gives."""
        if self.bits is not None:
            add_rademacher(acc, coefs, self.bits, self.keep)
        elif self.factors is not None:
            add_rank1(acc, coefs, self.factors)
        elif self.z is not None:
            for c, z in zip(coefs, self.z):
                _accumulate(acc, c, z)
        else:
            raise ValueError("these directions carry neither bits, factors nor z")


# Directions a replay draws at once: their bits (or factors) in memory together, 15 MB at L's 7.6M body.
REPLAY_GROUP = 16
MembersFn = Callable[[np.ndarray, Probes, float], Population]


@dataclass
class Objective:
    """One minibatch: `loss(w)` for the probes and, for the delta rule, `clean(w)` -> (loss, decoder grad).
    With `members(w, probes, eps)` (the population evaluator: soma_edge.engine.population), the Stepper evaluates
    the minibatch's clean forward and 2K probes in that one call instead. With spsa.split_rows, direction k's
    probes take `part(w, k, K)`: the loss on the k-th of K equal slices of the minibatch's rows (`part_clean`:
    with its decoder gradient, for spsa.decoder_from = "probes"); a population call splits them itself."""

    loss: LossFn
    clean: CleanFn | None = None
    members: MembersFn | None = None
    part: PartFn | None = None
    part_clean: PartCleanFn | None = None


@dataclass
class StepResult:
    step: int  # the step index this update used for its key and schedule
    grads: np.ndarray  # float64[A*K] projected gradients g: with the key, all that replays the body
    loss: float  # the clean minibatch loss where there was a clean forward, else the mean of L+ and L-
    lr: float
    eps: float
    decoder_grad: np.ndarray | None = None  # float32, the delta rule's mean gradient (replays the decoder)


class _Sums(NamedTuple):
    """What a step's evaluation gives its update: Σ g_j z_j, the g_j, each direction's (L+, L-), and per
    minibatch the clean forward's (loss, decoder gradient) for the delta rule (empty without it; with
    spsa.decoder_from = "probes", one entry: the probes' mean loss and mean decoder gradient)."""

    acc: np.ndarray
    grads: np.ndarray
    pairs: np.ndarray  # float64[A*K, 2]
    cleans: list[tuple[float, np.ndarray | None]]


@dataclass
class Stepper:
    """Runs SPSA steps for one expert.

    `body` is how many leading weights SPSA perturbs (the layout's body); the rest is the decoder, which
    the delta rule updates, SPSA perturbs as well (`decoder = "spsa"`), or nobody touches ("frozen").
    0 means the whole vector is body (no decoder). `dense` marks body weights that sparse probes always
    touch (norm gains). `shapes` is the layout's tensor shapes in order (`params.Layout.shapes`), which
    rank-1 probes (`noise = "rank1"`) need to tell matrices from vectors.

    Work runs on `parallel + 1` threads with at most `parallel` loss evaluations at once (ORT releases
    the GIL): the spare thread draws the next direction's noise and builds its probe while the others
    evaluate, so the cores never wait on numpy. On a 2-core CPU, parallel=2 (two single-thread ORT runs
    side by side) beats one two-thread run by ~20-40% (docs/BENCHMARKS.md). The main thread sums g z
    in index order, so the result is bit-identical for any `parallel`.
    """

    cfg: SPSAConfig
    seed: int
    expert: int = 0
    parallel: int = 1
    body: int = 0
    dense: np.ndarray | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    # Bench only (bench/body.py's frozen twin): no probes and no body update; the decoder's delta rule and
    # the schedule run as they would, so the twin measures what the body's learning adds.
    freeze_body: bool = False

    def __post_init__(self) -> None:
        if self.cfg.noise == "rank1" and (not self.shapes or self.cfg.density != 1):
            raise ValueError("rank-1 probes need the layout's tensor shapes and spsa.density = 1.0")
        self._pool = ThreadPoolExecutor(self.parallel + 1, thread_name_prefix="spsa")
        self._gate = threading.BoundedSemaphore(self.parallel)
        self._buffers = threading.local()

    def split(self, n: int) -> tuple[int, bool]:
        """(perturbed length, whether the delta rule trains the rest) for n weights."""
        body = self.body or n
        if self.cfg.decoder == "spsa":
            return n, False
        return body, self.cfg.decoder == "delta" and body < n

    def _z(self, step: int, j: int, n: int) -> np.ndarray:
        if self.cfg.noise == "rank1":
            # Materialized, so the update (acc += g z in index order) and its replay are the full-rank code.
            return rank1_probe(self.seed, self.expert, step, j, body_shapes(self.shapes, n))
        z = noise(self.seed, self.expert, step, j, n, self.cfg.noise)
        if self.cfg.density < 1:
            z *= self._keep(step, j, n)  # exact: multiplies by 1.0 or 0.0
        return z

    def _keep(self, step: int, j: int, n: int) -> np.ndarray:
        """The sparse probe's mask: its keyed draws, and the weights it always touches."""
        keep = probe_mask(self.seed, self.expert, step, j, n, self.cfg.density)
        if self.dense is not None:
            keep |= self.dense[:n]
        return keep

    def _probe(self, n: int) -> np.ndarray:
        buf = getattr(self._buffers, "probe", None)
        if buf is None or buf.size != n:
            buf = self._buffers.probe = np.empty(n, dtype=np.float32)
        return buf

    def direction(
        self, w: np.ndarray, loss_fn: ProbeFn, t: int, j: int, body: int, eps: float
    ) -> tuple[Any, Any, np.ndarray]:
        """Direction j of step t: (L(w + eps z), L(w - eps z), z), z perturbing the first `body` weights (each
        L what `loss_fn` gives: a loss, or a loss and the decoder gradient there)."""
        z = self._z(t, j, body)
        probe = self._probe(w.size)
        probe[body:] = w[body:]
        head = probe[:body]
        np.multiply(z, np.float32(eps), out=head)
        head += w[:body]
        with self._gate:
            lp = loss_fn(probe)
        np.multiply(z, np.float32(-eps), out=head)
        head += w[:body]
        with self._gate:
            lm = loss_fn(probe)
        return lp, lm, z

    def probe_fn(self, objs: Sequence[Objective], j: int, decoder: bool = False) -> ProbeFn:
        """What direction j's probes evaluate: its minibatch's loss, or with spsa.split_rows its own rows'
        share; with `decoder`, the clean function there (loss and decoder gradient: decoder_from = probes)."""
        K = self.cfg.directions
        obj = objs[j // K]
        if self.cfg.split_rows:
            part = obj.part_clean if decoder else obj.part
            if part is None:
                raise ValueError("spsa.split_rows needs each minibatch's loss on a share of its rows (Objective.part)")
            return lambda w: part(w, j % K, K)
        fn = obj.clean if decoder else obj.loss
        if fn is None:
            raise ValueError("the delta-rule decoder needs a clean forward (Objective.clean) per minibatch")
        return fn

    def probe_decoder(self, delta: bool) -> bool:
        """Whether the delta rule takes its gradient from the probes (spsa.decoder_from = "probes")."""
        return delta and self.cfg.decoder_from == "probes"

    def _clean(self, w: np.ndarray, clean_fn: CleanFn) -> tuple[float, np.ndarray]:
        with self._gate:
            return clean_fn(w)

    def step(self, state: State, objectives: Objective | Sequence[Objective] | LossFn) -> StepResult:
        """One update from `accumulate` minibatches (one Objective each; a bare loss function is one
        minibatch without a clean forward). Objectives with `members` are evaluated a minibatch per call
        (the population evaluator), others a probe per call; either way g_j z_j is summed in index order j
        and applied by the same code, so the log's scalars mean the same and replay is unchanged."""
        objs = _as_objectives(objectives)
        cfg, w, t = self.cfg, state.weights, state.step
        if len(objs) != cfg.accumulate:
            raise ValueError(f"spsa.accumulate = {cfg.accumulate} needs that many minibatches, got {len(objs)}")
        body, delta = self.split(w.size)
        population, from_probes = all(o.members is not None for o in objs), self.probe_decoder(delta)
        if delta and not population and not from_probes and any(o.clean is None for o in objs):
            raise ValueError("the delta-rule decoder needs a clean forward (Objective.clean) per minibatch")
        if population and delta and not population_takes(cfg):
            raise ValueError("split rows with the clean decoder gradient run on the loop (spsa.evaluator = 'loop')")
        lr, eps = schedule(cfg, t, state.opt.lr_scale)
        run = self._frozen if self.freeze_body else self._population if population else self.evaluate
        acc, grads, pairs, cleans = run(w, objs, t, body, eps, delta)
        dec, loss = None, mean_probe_loss(pairs)
        if delta:
            if any(g is None for _, g in cleans):
                raise ValueError("the delta-rule decoder needs the population evaluator's decoder gradient")
            dec = mean_decoder_grad([g for _, g in cleans])
            loss = sum(x for x, _ in cleans) / len(cleans)
        frozen = w[:body].copy() if self.freeze_body else None
        apply_update(state, cfg, body, acc, dec)
        if frozen is not None:
            w[:body] = frozen  # the moments saw zeros; weight decay alone would move the body
        return StepResult(step=t, grads=grads, loss=loss, lr=lr, eps=eps, decoder_grad=dec)

    def evaluate(self, w: np.ndarray, objs: list[Objective], t: int, body: int, eps: float, delta: bool) -> _Sums:
        """The step's sums from one loss evaluation per probe (the loop), `parallel` at a time; what the
        coordinator's audit recomputes a step with."""
        total = self.cfg.directions * self.cfg.accumulate
        from_probes = self.probe_decoder(delta)
        cleans = [self._pool.submit(self._clean, w, o.clean) for o in objs] if delta and not from_probes else []
        window = self.parallel + 1  # directions in flight; bounds memory to ~2 vectors per thread

        def submit(j):
            return self._pool.submit(self.direction, w, self.probe_fn(objs, j, from_probes), t, j, body, eps)

        futures: dict[int, Future] = {j: submit(j) for j in range(min(window, total))}
        acc = np.zeros(body, dtype=np.float32)
        grads = np.empty(total, dtype=np.float64)
        pairs, kept, dec = np.empty((total, 2)), [], None
        for j in range(total):
            lp, lm, z = futures.pop(j).result()
            if j + window < total:
                futures[j + window] = submit(j + window)
            if from_probes:  # the delta rule's gradient: the mean of the probes', summed in order (+ then -)
                (lp, gp), (lm, gm) = lp, lm
                if dec is None:
                    dec = np.array(gp, dtype=np.float32)
                else:
                    dec += gp
                dec += gm
            grads[j] = (lp - lm) / (2.0 * eps)
            pairs[j] = lp, lm
            if self.cfg.shaping == "none":
                _accumulate(acc, grads[j], z)  # as they come: one z in memory at a time
            else:
                kept.append(z)  # shaping weighs each direction by all of the step's scalars
        for j, c in enumerate(shape(self.cfg.shaping, grads) if kept else ()):
            _accumulate(acc, c, kept[j])
        if from_probes:
            dec /= np.float32(2 * total)
            return _Sums(acc, grads, pairs, [(mean_probe_loss(pairs), dec)])
        return _Sums(acc, grads, pairs, [f.result() for f in cleans])

    def _frozen(self, w: np.ndarray, objs: list[Objective], t: int, body: int, eps: float, delta: bool) -> _Sums:
        """`freeze_body`'s sums: no probes, a zero estimate, the clean forwards the delta rule needs (with
        decoder_from = "probes" as well: the probes' mean at z = 0)."""
        total = self.cfg.directions * self.cfg.accumulate
        if delta and any(o.clean is None for o in objs):
            raise ValueError("a frozen body's step still needs the clean forward per minibatch (Objective.clean)")
        cleans = [self._clean(w, o.clean) for o in objs] if delta else []
        return _Sums(np.zeros(body, dtype=np.float32), np.zeros(total), np.zeros((total, 2)), cleans)

    def _population(self, w: np.ndarray, objs: list[Objective], t: int, body: int, eps: float, delta: bool) -> _Sums:
        """The step's sums from one `members` call per minibatch: its clean forward and K directions' 2K
        probes, fed the noise `_z` draws (or, for rank-1 probes, its factors), bit for bit."""
        cfg, K = self.cfg, self.cfg.directions
        acc = np.zeros(body, dtype=np.float32)
        grads = np.empty(K * len(objs), dtype=np.float64)
        pairs, cleans, drawn = np.empty((K * len(objs), 2)), [], []
        for a, obj in enumerate(objs):
            probes = self.probes(t, range(a * K, (a + 1) * K), body)
            with self._gate:
                out = obj.members(w, probes, eps)
            for i in range(K):
                j = a * K + i
                lp, lm = float(out.lp[i]), float(out.lm[i])
                grads[j] = (lp - lm) / (2.0 * eps)
                pairs[j] = lp, lm
            drawn.append(probes)
            cleans.append(
                (minibatch_loss(cfg, pairs[a * K : (a + 1) * K], out.loss), out.decoder_grad if delta else None)
            )
        coefs = shape(self.cfg.shaping, grads)
        for a, probes in enumerate(drawn):  # minibatch by minibatch: directions j in index order
            probes.add_to(acc, coefs[a * K : (a + 1) * K])
        return _Sums(acc, grads, pairs, cleans)

    def probes(self, t: int, js: range, body: int) -> Probes:
        """Directions `js` of step t over the first `body` weights, as a population call takes them: for
        Rademacher probes their keyed bits (and, sparse, their masks packed: a device expands both), for
        rank-1 probes their factors, for Gaussian ones their dense z stacked."""
        if self.cfg.noise == "rank1":
            shapes = body_shapes(self.shapes, body)
            return Probes(None, [rank1_factors(self.seed, self.expert, t, j, shapes) for j in js])
        if self.cfg.noise == "rademacher":
            bits = np.stack([noise_bits(self.seed, self.expert, t, j, body) for j in js])
            if self.cfg.density >= 1:
                return Probes(None, bits=bits)
            return Probes(None, bits=bits, keep=np.stack([np.packbits(self._keep(t, j, body)) for j in js]))
        return Probes(np.stack([self._z(t, j, body) for j in js]))

    def replay(
        self, state: State, grads: np.ndarray, decoder_grad: np.ndarray | None = None, body_only: bool = False
    ) -> None:
        """Apply a recorded step from its scalars (and the delta rule's decoder gradient, unless
        `body_only`: the caller sets the decoder itself): no loss evaluation, bit-identical result."""
        cfg, n, t = self.cfg, state.weights.size, state.step
        total = cfg.directions * cfg.accumulate
        if len(grads) != total:
            raise ValueError(f"replay needs {total} scalars, got {len(grads)}")
        body, delta = self.split(n)
        if delta and not body_only and (decoder_grad is None or decoder_grad.shape != (n - body,)):
            raise ValueError(f"replay of a delta-rule step needs the decoder gradient float32[{n - body}]")
        acc = np.zeros(body, dtype=np.float32)
        coefs = shape(cfg.shaping, np.asarray(grads, dtype=np.float64))
        if cfg.noise == "gaussian":  # its z is drawn whole either way
            for j, c in enumerate(coefs):
                _accumulate(acc, c, self._z(t, j, body))
        else:
            for g in range(0, total, REPLAY_GROUP):
                self.probes(t, range(g, min(total, g + REPLAY_GROUP)), body).add_to(acc, coefs[g : g + REPLAY_GROUP])
        apply_update(state, cfg, body, acc, None if body_only or not delta else decoder_grad, delta and body_only)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _accumulate(acc: np.ndarray, g: float, z: np.ndarray) -> None:
    acc += np.float32(g) * z


def population_takes(cfg: SPSAConfig) -> bool:
    """Whether a population call evaluates `cfg`'s steps: not split rows with the clean forward's decoder
    gradient, since a split graph's clean member reads one slice of the rows (soma_edge.expert.population_graph)."""
    return not (cfg.split_rows and cfg.decoder == "delta" and cfg.decoder_from == "clean")


def minibatch_loss(cfg: SPSAConfig, pairs: np.ndarray, clean: float) -> float:
    """A population call's loss for its minibatch (its probes' `pairs`): the clean member's, or the probes'
    mean where that member is not the step's (the probes' decoder gradient; split rows: it reads one slice).
    The Stepper's population path and the resident runner report it alike."""
    return mean_probe_loss(pairs) if cfg.decoder_from == "probes" or cfg.split_rows else clean


def mean_probe_loss(pairs: np.ndarray) -> float:
    """The mean of a step's probe losses, summed in direction order (L+ + L- each), as a float."""
    total = 0.0
    for lp, lm in pairs.tolist():
        total += lp + lm
    return total / (2 * len(pairs)) if len(pairs) else 0.0


def _as_objectives(objectives: Objective | Sequence[Objective] | LossFn) -> list[Objective]:
    if isinstance(objectives, Objective):
        return [objectives]
    if callable(objectives):
        return [Objective(loss=objectives)]
    return list(objectives)
