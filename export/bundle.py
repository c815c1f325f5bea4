"""The deploy bundle: plain ONNX experts, the router, and a manifest that checks every byte of both.

    DEPLOY/
      manifest.json                  format, versions, per-expert config/step/val loss, sha256 of every file
      router.msgpack                 the run's router, byte for byte
      router_features.onnx           context uint8[L] -> distances [1, N] to each expert (the router as ONNX)
      experts/<id>/score.onnx        x int64[B,T] -> logprobs float32[B,T,256]
      experts/<id>/stream.onnx       x int64[B,T], h<l>/c<l> [1,B,H] -> logits [B,T,256], h<l>_out/c<l>_out

Weights are initializers, so any ONNX Runtime runs an expert with no soma-edge code. `write` builds the
whole bundle in a hidden sibling folder and renames it into place: a failed export leaves nothing behind.

`read` is on the inference path: it must not import onnx, flwr or torch. It checks
the manifest and the sha256 of every file it lists before anything is loaded. `write` reads the run through
soma_edge.rundir (RunDir, RunState, ExpertRecord), never by file names and keys of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from soma_edge import __version__, checkpoint
from soma_edge import config as config_mod
from soma_edge.config import Config
from soma_edge.corpus.router import Router
from soma_edge.engine.runtime import load_ort
from soma_edge.errors import CheckpointError, ConfigError, SomaError
from soma_edge.expert import params
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import ExpertRecord, RunState
from soma_edge.wire.protocol import weights_sha256

FORMAT = "soma-edge-deploy"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ROUTER = "router.msgpack"
FEATURES = "router_features.onnx"
QUANTIZE = ("int8",)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class BundleError(SomaError):
    """A deploy bundle that is missing, incomplete, tampered with, or not one of ours."""


# ----------------------------------------------------------------------------------------------------------
# Reading (inference path)


@dataclass(frozen=True)
class ExpertEntry:
    id: int
    version: int
    step: int
    val_loss: float | None
    params: int
    config: dict[str, Any]
    score: str  # relative paths inside the bundle
    stream: str

    @property
    def model(self) -> dict[str, int]:
        return self.config["model"]


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: dict[str, Any]
    experts: tuple[ExpertEntry, ...]
    seq_len: int
    temperature: float  # the router's default temperature
    quantize: str | None

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def read_verified(self, rel: str) -> bytes:
        """The bytes of a listed file, checked again against the manifest (it may have changed since `read`)."""
        path = self.path(rel)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise BundleError(f"{path}: cannot read ({e.strerror})") from None
        if hashlib.sha256(data).hexdigest() != self.manifest["files"][rel]["sha256"]:
            raise BundleError(f"{path}: sha256 does not match {MANIFEST}; the file was modified or corrupted")
        return data


def _field(obj: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise BundleError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise BundleError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _finite(x: int | float) -> float:
    """x as a float, NaN for what is not finite (an integer too large for a float included)."""
    try:
        x = float(x)
    except OverflowError:
        return math.nan
    return x if math.isfinite(x) else math.nan


def _safe_rel(rel: str, where: str) -> str:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise BundleError(f"{where}: refusing file path {rel!r} outside the bundle")
    return rel


def read(root: str | Path) -> Bundle:
    """Load and verify a deploy bundle: manifest schema, every listed file present with its sha256."""
    root = Path(root)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory (expected a bundle written by `soma-export onnx`)")
    try:
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{mpath}: {size} bytes is too large for a manifest")
        manifest = json.loads(mpath.read_bytes())
    except FileNotFoundError:
        raise BundleError(f"{mpath}: missing; is {root} a bundle written by `soma-export onnx`?") from None
    except OSError as e:
        raise BundleError(f"{mpath}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise BundleError(f"{mpath}: not valid JSON ({e})") from None
    where = str(mpath)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{where}: not a soma-edge deploy manifest")
    if _field(manifest, "format_version", int, where) != FORMAT_VERSION:
        raise BundleError(
            f"{where}: format_version {manifest['format_version']}; this soma-edge reads {FORMAT_VERSION}"
        )

    files = _field(manifest, "files", dict, where)
    for rel, meta in files.items():
        _safe_rel(rel, where)
        digest = _field(meta, "sha256", str, f"{where}: files[{rel!r}]")
        path = root / rel
        if not path.is_file():
            raise BundleError(f"{path}: missing from the bundle (listed in {MANIFEST})")
        if checkpoint.sha256_file(path) != digest:
            raise BundleError(f"{path}: sha256 does not match {MANIFEST}; the file was modified or corrupted")

    router = _field(manifest, "router", dict, where)
    if _field(router, "file", str, f"{where}: router") not in files:
        raise BundleError(f"{where}: router file is not listed under files")
    temperature = _finite(_field(router, "temperature", (int, float), f"{where}: router"))
    if not temperature > 0:  # json reads NaN, Infinity and 1e999; the router softmax divides by it
        raise BundleError(f"{where}: router temperature {router['temperature']!r} is not a positive finite number")
    experts = []
    for i, e in enumerate(_field(manifest, "experts", list, where)):
        w = f"{where}: experts[{i}]"
        entry = ExpertEntry(
            id=_field(e, "id", int, w),
            version=_field(e, "version", int, w),
            step=_field(e, "step", int, w),
            val_loss=e.get("val_loss"),
            params=_field(e, "params", int, w),
            config=_field(e, "config", dict, w),
            score=_field(e, "score", str, w),
            stream=_field(e, "stream", str, w),
        )
        val = entry.val_loss
        if val is not None and (not isinstance(val, (int, float)) or isinstance(val, bool)):  # eval prints it with :.4f
            raise BundleError(f"{w}: field 'val_loss' has the wrong type ({type(val).__name__})")
        if entry.id != i:
            raise BundleError(f"{w}: id {entry.id}, expected {i} (experts are listed in id order)")
        _check_model(entry, w)
        for rel in (entry.score, entry.stream):
            if rel not in files:
                raise BundleError(f"{w}: {rel} is not listed under files")
        experts.append(entry)
    if not experts:
        raise BundleError(f"{where}: the bundle has no experts")
    if _field(router, "n_experts", int, f"{where}: router") != len(experts):
        raise BundleError(f"{where}: the router maps {router['n_experts']} experts but {len(experts)} are listed")
    seq_len = _field(manifest, "seq_len", int, where)
    if seq_len < 1:
        raise BundleError(f"{where}: seq_len must be >= 1, got {seq_len}")
    return Bundle(root, manifest, tuple(experts), seq_len, temperature, manifest.get("quantize"))


def _check_model(entry: ExpertEntry, where: str) -> None:
    """The entry's config is a valid soma-edge config whose model has exactly `params` weights."""
    _field(entry.config, "model", dict, f"{where}: config")
    try:
        m = config_mod.from_dict(entry.config).model
    except ConfigError as e:
        raise BundleError(f"{where}: config: {e}") from None
    if params.count(m) != entry.params:
        raise BundleError(
            f"{where}: a model.kind = {m.kind!r} expert of embed {m.embed}, hidden {m.hidden}, layers "
            f"{m.layers} has {params.count(m)} weights, but the entry lists {entry.params}"
        )


# ----------------------------------------------------------------------------------------------------------
# Writing (needs onnx, imported where it is used so that `read` stays importable without it)


@dataclass
class _Expert:
    id: int
    version: int
    step: int
    val_loss: float | None
    config: Config
    weights: np.ndarray  # float32
    weights_sha256: str
    # The config as the checkpoint recorded it (valid: `config` was read from it). The manifest keeps these
    # bytes, so a version exports the same whatever settings later releases add (they read back as defaults).
    recorded: dict[str, Any]


VERSIONS = ("best", "latest")  # which version of each expert to export: lowest val loss, or last accepted


def _load_run(run: Path, version: str = "best") -> tuple[RunState, list[_Expert], bytes, Router]:
    """The run's last commit (state.msgpack, no fallback), its experts' `version`s and its router."""
    if not run.is_dir():
        raise CheckpointError(f"{run}: not a run directory")
    rd = RunDir(run)
    state = rd.read_state_file(rd.state_path)
    if state.phase == "seed":
        raise CheckpointError(
            f"{run}: the run is still in its seed run (federation.seed_steps); its experts have not "
            "started yet: export after a round of the experts"
        )
    if not state.experts:
        raise CheckpointError(f"{rd.state_path}: no experts recorded; has the run trained a round?")
    router_bytes = rd.router_bytes()
    try:
        router = Router.from_bytes(router_bytes)
    except SomaError as e:
        raise CheckpointError(f"{rd.router}: {e}") from None
    ids = state.expert_ids()
    if ids != list(range(router.n_experts)):
        raise CheckpointError(f"{rd.state_path}: experts {ids} do not match the router's {router.n_experts} experts")
    experts = [_load_expert(rd, i, state.expert(i), version) for i in ids]
    seq_lens = {e.config.data.seq_len for e in experts}
    if len(seq_lens) != 1:
        raise CheckpointError(f"{run}: experts were trained with different seq_len {sorted(seq_lens)}")
    return state, experts, router_bytes, router


def _load_expert(rd: RunDir, i: int, rec: ExpertRecord, version: str) -> _Expert:
    """Expert i's `version` ("best" or "latest"), checked against state.msgpack, its own header and config."""
    meta = rec.best if version == "best" and rec.best is not None else rec  # runs from before guards have no best
    rel = Path(str(meta.path))
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointError(f"{rd.state_path}: expert {i} has a bad path {str(rel)!r}")
    path = rd.root / rel
    body = rd.load_expert(str(rel))
    weights = body.get("weights")
    if not isinstance(weights, np.ndarray) or weights.ndim != 1 or weights.dtype.name not in ("float32", "float16"):
        raise CheckpointError(f"{path}: weights must be a flat float32 or float16 array")
    digest = weights_sha256(weights)
    for name, want in (("the file's sha256", body.get("sha256")), ("state.msgpack's sha256", meta.sha256)):
        if digest != want:
            raise CheckpointError(f"{path}: weights do not match {name}; the checkpoint is inconsistent")
    if body.get("expert") != i or body.get("version") != meta.version:
        raise CheckpointError(
            f"{path}: holds expert {body.get('expert')} v{body.get('version')}, state.msgpack expects "
            f"expert {i} v{meta.version}"
        )
    try:
        cfg = config_mod.from_dict(body.get("config") or {})
    except ConfigError as e:
        raise CheckpointError(f"{path}: config: {e}") from None
    w32 = weights.astype(np.float32)
    if w32.size != params.count(cfg.model):
        raise CheckpointError(f"{path}: {w32.size} weights, but the config's model has {params.count(cfg.model)}")
    if not np.all(np.isfinite(w32)):
        raise CheckpointError(f"{path}: weights hold NaN or infinity")
    val = body.get("val_loss")
    step, loss = int(body.get("step", 0)), None if val is None else float(val)
    return _Expert(i, int(body["version"]), step, loss, cfg, w32, digest, dict(body.get("config") or {}))


def _quantize_int8(model: bytes) -> bytes:
    # Dynamic quantization works on files; do it in a private temp folder.
    # onnxruntime.quantization (it imports onnx) only on this path: `read` is on the inference path.
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="soma-q-") as tmp:
        src, dst = Path(tmp, "f32.onnx"), Path(tmp, "int8.onnx")
        src.write_bytes(model)
        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # it warns about pre-processing and the int64 input
        try:
            quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
        finally:
            logging.getLogger().setLevel(quiet)
        return dst.read_bytes()


def _router_features(router: Router) -> bytes | None:
    # soma_edge.expert.graph imports onnx at module level: only on the writing path, as `read` is on the inference path.
    from soma_edge.expert import graph

    try:
        return graph.router_features(router).SerializeToString()
    except NotImplementedError as e:  # a featurizer this builder does not know: the msgpack router still works
        logging.getLogger("export.bundle").warning("no ONNX router featurizer in the bundle: %s", e)
        return None


def _graphs(e: _Expert, quantize: str | None) -> dict[str, bytes]:
    # onnx (and soma_edge.expert.graph, which imports it): only on the writing path, as `read` is on the inference path.
    import onnx

    from soma_edge.expert import graph

    out = {}
    for kind, mode in (("score", "logprobs"), ("stream", "stream")):
        model = graph.build(e.config.model, mode, e.weights)
        model.doc_string = f"soma-edge expert {e.id} v{e.version} ({kind}), step {e.step}"
        data = model.SerializeToString()
        if quantize == "int8":
            data = _quantize_int8(data)
        onnx.checker.check_model(onnx.load_model_from_string(data), full_check=True)
        out[kind] = data
    return out


def _check_write(out: Path, quantize: str | None, force: bool, version: str) -> None:
    if version not in VERSIONS:
        raise BundleError(f"--version must be one of {', '.join(VERSIONS)}, got {version!r}")
    if quantize is not None and quantize not in QUANTIZE:
        raise BundleError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if quantize == "int8":
        # The quantizer is onnxruntime's: without it, the DeviceError that names what to install (the other
        # commands' one line), before anything is read or written.
        load_ort()
    if out.exists() and not force:
        raise BundleError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not (out / MANIFEST).is_file():
        raise BundleError(f"{out}: exists and is not a deploy bundle; refusing to replace it")


def _entry(e: _Expert, rels: dict[str, str]) -> dict[str, Any]:
    """An expert's entry in the manifest."""
    return {
        "id": e.id,
        "version": e.version,
        "step": e.step,
        "val_loss": e.val_loss,
        "params": int(e.weights.size),
        "weights_sha256": e.weights_sha256,
        "config": e.recorded,
        "score": rels["score"],
        "stream": rels["stream"],
    }


def _manifest(
    run: Path,
    state: RunState,
    version: str,
    quantize: str | None,
    router: Router,
    *,
    seq_len: int,
    features: str | None,
    experts: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest: `features` names the router featurizer's file (None: there is none), `experts` holds
    the experts' entries and `files` the sha256 and size of every file."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "soma_edge": __version__,
        "run": {"name": run.resolve().name, "round": state.round, "version": version},
        "quantize": quantize,
        "seq_len": seq_len,
        "router": {
            "file": ROUTER,
            "n_experts": router.n_experts,
            "temperature": float(router.temperature),
            # Routing without soma-edge: distances from the featurizer graph (a non-empty context), or
            # the prior for a document's first window; top-k of softmax(-d^2 / temperature).
            "features": features,
            "prior": [float(p) for p in router.prior],
        },
        "experts": experts,
        "files": files,
    }


def _into_place(tmp: Path, out: Path) -> None:
    """Rename the finished bundle to `out`, replacing the one there (if any) only once it is complete."""
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, old / "bundle")
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def write(
    run: str | Path, out: str | Path, quantize: str | None = None, force: bool = False, version: str = "best"
) -> dict[str, Any]:
    """Export a run directory to a deploy bundle at `out` (each expert's `version`: "best" or "latest");
    returns the manifest."""
    run, out = Path(run), Path(out)
    _check_write(out, quantize, force, version)
    state, experts, router_bytes, router = _load_run(run, version)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    files: dict[str, dict[str, Any]] = {}

    def put(rel: str, data: bytes) -> None:
        checkpoint.atomic_write(tmp / rel, data)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    try:
        put(ROUTER, router_bytes)
        features = _router_features(router)
        if features is not None:
            put(FEATURES, features)
        entries = []
        for e in experts:
            rels = {}
            for kind, data in _graphs(e, quantize).items():
                rels[kind] = f"experts/{e.id}/{kind}.onnx"
                put(rels[kind], data)
            entries.append(_entry(e, rels))
        manifest = _manifest(
            run,
            state,
            version,
            quantize,
            router,
            seq_len=experts[0].config.data.seq_len,
            features=FEATURES if features is not None else None,
            experts=entries,
            files=files,
        )
        checkpoint.atomic_write(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        read(tmp)  # what we wrote must verify
        _into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
