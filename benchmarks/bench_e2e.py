"""End-to-end model benchmark: whole transformers models, fp16 vs jitmarlin W4 (group 128), one run.

    python benchmarks/bench_e2e.py [--json out.json] [--models llama,mixtral] [--batches 1,8]
                                   [--prefill 128,512,1024,2048] [--decode 32,256,1024] [--full]
                                   [--layers-mixtral 32] [--smoke]

Models are built from transformers configs with random weights (normal, std 0.02; norm weights 1)
directly on the GPU in fp16 -- nothing is downloaded:

    llama    Llama-2-7B shape: hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000
    mixtral  Mixtral-8x7B shape: hidden 4096, intermediate 14336, 8 experts top-2, 32 heads (8 KV
             heads), vocab 32000; 32 layers by default (--layers-mixtral): 87 GiB in fp16, so the
             fp16 model and its W4 copy (about 23 GiB) would fit the H200's 139 GiB together; each
             variant is built on its own here, so the peak is the fp16 model

Variants, measured one after the other in the same process (same seed, so the same weights):
fp16 (the plain transformers model, sdpa attention; the fp16 Mixtral experts run transformers'
default experts implementation, named in the output), jitmarlin W4 g128 and jitmarlin W4 g128
act_order (``jitmarlin.quantize_model`` in place, RTN; lm_head and embeddings stay fp16).

Peers: none. benchmarks/peers.py wraps single GEMMs (Humming, torch int4, gemlite); this script
does not wire one into every layer of a transformers model (nor has a peer MoE kernel), and says
so in its output.

Cases (per model, variant and batch): by default prefill lengths {128, 512, 1024, 2048}, each with
128 decode steps, plus decode lengths {32, 256, 1024} after a 128-token prefill (--prefill,
--decode, --base-prefill, --base-decode); --full runs the whole grid of powers of two 32..4096 for
both (hours). What is measured:

- prefill tok/s = batch x prefill_len / time of one forward over the prompt (a fresh DynamicCache,
  logits for the last position only, as generate() does), eager, timed with CUDA events after
  warm-up, median of --prefill-reps.
- decode tok/s = batch x decode_len / time of decode_len greedy decode steps, timed separately
  from the prefill: the prompt is first run into a transformers StaticCache of length
  prefill_len + decode_len (rounded up to 16), then each step feeds the previous argmax token,
  writes the cache and takes the argmax of the new logits, on the device (no host round trip).
  The token from the prefill is not counted. Mode "graph": one step is captured as a CUDA graph
  (static input token, position and 4-D attention-mask buffers advanced inside the graph) and
  replayed decode_len times; before timing, the first steps of the graph are checked against the
  same steps run eagerly (logits; later steps only while both runs pick the same tokens, since
  batch > 1 cuBLAS/SDPA results vary run to run by ~1e-3 and can swap near-tied argmaxes). If
  capture fails (e.g. a host synchronisation in the model code) or the check fails, the steps run
  eagerly and the row says "eager" with the reason printed. Prefill is always eager.
- default lengths: prefill 128, 512, 1024, 2048 (128 decode steps each) and decode 32, 256, 1024
  (after 128 prompt tokens); the Mixtral shape stops at decode 256 by default, since its fp16
  baseline decodes eagerly (transformers' grouped_mm experts cannot be captured) at ~60 ms a
  step, which alone would take the default set past 10 minutes.
- peak memory = torch.cuda.max_memory_allocated over the case (reset at its start, with only this
  variant's model resident): weights + KV cache + activations + graph pool.
- weight memory = bytes of the model's parameters and buffers.

The markdown tables at the end give every row and the ratios against fp16 of the same model,
batch and lengths (decode speedup, prefill ratio, weight-memory ratio). --json writes the rows,
the ratios, the environment (benchmarks/common.environment()) and the notes; the file is
rewritten after every case, so an interrupted run keeps what it measured. --time-budget stops
starting new cases after that many seconds (the skipped ones are listed).

--smoke: tiny configs (hidden 256, 2 layers, vocab 512) and short lengths, to check the code
paths quickly. Without a CUDA GPU it runs on the CPU (timing with time.perf_counter, no peak
memory); the quantized variants then need jitmarlin's kernels replaced by plain-PyTorch
references, as tests/test_bench_e2e.py does.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import jitmarlin  # noqa: E402
from jitmarlin.model.patch import module_bytes  # noqa: E402

GIB = 2**30
POW2 = [32, 64, 128, 256, 512, 1024, 2048, 4096]


@dataclass(frozen=True)
class ModelSpec:
    key: str
    name: str  # the shape it follows
    hidden: int
    intermediate: int
    layers: int
    full_layers: int  # layers of the real model
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 0  # 0: dense
    top_k: int = 0

    def fp16_bytes(self) -> int:
        """Bytes of the fp16 model's parameters (embeddings, lm_head, attention, MLP or experts + router, norms)."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = (self.experts * (3 * self.hidden * self.intermediate + self.hidden) if self.experts
               else 3 * self.hidden * self.intermediate)
        return 2 * (2 * self.vocab * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden)

    @property
    def label(self) -> str:
        if self.layers == self.full_layers:
            return f"{self.name} ({self.layers} layers)"
        return f"{self.name} ({self.layers} of {self.full_layers} layers)"


SPECS = {
    "llama": ModelSpec("llama", "Llama-2-7B", 4096, 11008, 32, 32, 32, 32, 32000),
    "mixtral": ModelSpec("mixtral", "Mixtral-8x7B", 4096, 14336, 32, 32, 32, 8, 32000, experts=8, top_k=2),
}
SMOKE_SPECS = {
    "llama": ModelSpec("llama", "tiny Llama", 256, 512, 2, 2, 4, 4, 512),
    "mixtral": ModelSpec("mixtral", "tiny Mixtral", 256, 256, 2, 2, 4, 2, 512, experts=4, top_k=2),
}

# variant key -> (label, quantize_model options or None for the plain fp16 model)
VARIANTS = {
    "fp16": ("fp16", None),
    "w4": ("jitmarlin W4 g128", dict(bits=4, group_size=128, act_order=False)),
    "w4-fused": ("jitmarlin W4 g128 fused", dict(bits=4, group_size=128, act_order=False)),
    "w4-act": ("jitmarlin W4 g128 act_order", dict(bits=4, group_size=128, act_order=True)),
}
# variants that also get jitmarlin.fuse_projections (q/k/v and gate/up as one GEMM each)
FUSED_VARIANTS = ("w4-fused",)

DTYPE = torch.float16
INIT_STD = 0.02
CHECK_STEPS = 3  # decode steps compared between the CUDA graph and eager execution
CHECK_TOL = 2e-2  # max |graph - eager| / max |eager| over those steps' logits


# ---------------------------------------------------------------- small helpers


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"expected a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"expected positive integers, got {text!r}")
    return vals


def _gib(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / GIB:.2f} GiB" if n >= GIB // 8 else f"{n / 2**20:.2f} MiB"


def _reason(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device) -> float:
    """Seconds of one call of fn: CUDA events around it on the GPU (so the launches of an eager
    model count as they would in use), time.perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# default decode lengths of a model when --decode is not given (else DEFAULT decode lengths)
MODEL_DEFAULT_DECODE = {"mixtral": "32,256"}


def cases_for(args, model_key: str | None = None) -> list[tuple[int, int]]:
    """(prefill_len, decode_len) pairs: the full cross product with --full, else every prefill
    length with --base-decode steps plus every decode length after --base-prefill tokens."""
    decode = getattr(args, "decode_by_model", {}).get(model_key, args.decode)
    if args.full:
        return sorted({(p, d) for p in args.prefill for d in decode})
    return sorted({(p, args.base_decode) for p in args.prefill} | {(args.base_prefill, d) for d in decode})


# ---------------------------------------------------------------- transformers: models and API differences


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise SystemExit(f"bench_e2e needs transformers (pip install transformers): {err}") from None
    return transformers


def make_config(spec: ModelSpec):
    tf = _transformers()
    common_kw = dict(hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                     num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
                     max_position_embeddings=4096, tie_word_embeddings=False, use_cache=True)
    if spec.experts:
        return tf.MixtralConfig(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, sliding_window=None,
                                **common_kw)
    return tf.LlamaConfig(**common_kw)


def build_model(spec: ModelSpec, device: torch.device, seed: int):
    """The float16 model on `device`, built there (torch.device context, fp16 default dtype: no
    CPU copy, no fp32 copy), then filled with seeded random values: every matrix normal(0, 0.02)
    (embeddings, projections, router, experts), norm weights 1."""
    tf = _transformers()
    config = make_config(spec)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            try:
                model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            except TypeError:  # a transformers without that keyword: its default attention
                model = tf.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(saved)
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != DTYPE})
    if wrong:
        raise RuntimeError(f"the model was built with parameters in {wrong}, not {DTYPE} (transformers ignored the "
                           "default dtype): converting would need a second copy of the weights")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    return model.eval()


class ModelAPI:
    """The keyword names this transformers version's CausalLM forward takes: the cache argument
    (``cache`` from 5.2x, ``past_key_values`` before), ``cache_position`` (4.x only) and
    ``logits_to_keep`` (``num_logits_to_keep`` before 4.50)."""

    def __init__(self, model):
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def keep_last(self) -> dict:
        return {self.keep_kw: 1} if self.keep_kw else {}

    def with_cache(self, cache, positions: torch.Tensor) -> dict:
        kw = {self.cache_kw: cache, **self.keep_last()}
        if self.cache_position:
            kw["cache_position"] = positions
        return kw


def make_static_cache(model, batch: int, length: int, device: torch.device):
    """A transformers StaticCache of `length` positions, with the arguments this version takes
    (config + max_cache_len from 4.56; batch size, device and dtype before)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": length}
    batch_kw = next((k for k in ("max_batch_size", "batch_size") if k in params), None)
    if batch_kw:
        kw[batch_kw] = batch
    kw.update({k: v for k, v in (("device", device), ("dtype", DTYPE)) if k in params})
    return StaticCache(**kw)


def set_cache_length(cache, n: int) -> None:
    """Static cache layers that count their own write position (transformers 5.x: a
    ``cumulative_length`` tensor, advanced inside the forward) are set to n in place; older ones
    write at the cache_position they are given."""
    for layer in getattr(cache, "layers", None) or []:
        length = getattr(layer, "cumulative_length", None)
        if isinstance(length, torch.Tensor):
            length.fill_(n)


def experts_implementation(model) -> str | None:
    return getattr(model.config, "_experts_implementation", None)


# ---------------------------------------------------------------- measurement


class Decoder:
    """Greedy decoding after a prompt, one token per sequence and step, all on the device.

    State buffers (fixed addresses, so that one captured step can be replayed): tok [B, 1] the
    last token, pos [1] its position (cache_position), posid [1, 1] (position_ids), mask
    [B, 1, 1, L] additive (0 = attend, dtype min = masked; a 4-D mask is used by transformers as
    given). step() unmasks position pos, runs the model, writes the argmax to tok and advances
    pos, so replaying it continues the sequence."""

    def __init__(self, model, api: ModelAPI, ids: torch.Tensor, decode_len: int, forward=None):
        self.model, self.api = model, api
        self.forward = forward if forward is not None else model  # the step's model call (--compile: compiled)
        dev = ids.device
        self.batch, self.prompt = ids.shape
        self.length = -(-(self.prompt + decode_len) // 16) * 16  # 16-aligned mask rows for the SDPA kernels
        self.cache = make_static_cache(model, self.batch, self.length, dev)
        low = torch.finfo(DTYPE).min
        p = self.prompt
        mask = torch.full((1, 1, p, self.length), low, dtype=DTYPE, device=dev)  # causal over the prompt
        mask[0, 0, :, :p] = torch.full((p, p), low, dtype=DTYPE, device=dev).triu(1)
        positions = torch.arange(p, device=dev)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions[None], use_cache=True,
                    **api.with_cache(self.cache, positions))
        self.first = out.logits[:, -1].argmax(-1).view(self.batch, 1)
        del out, mask
        self.tok = self.first.clone()
        self.pos = torch.full((1,), p, dtype=torch.long, device=dev)
        self.posid = torch.full((1, 1), p, dtype=torch.long, device=dev)
        self.mask = torch.full((self.batch, 1, 1, self.length), low, dtype=DTYPE, device=dev)
        self.reset()

    def reset(self) -> None:
        """Back to the state right after the prompt (the cache beyond it is masked until rewritten)."""
        self.tok.copy_(self.first)
        self.pos.fill_(self.prompt)
        self.posid.fill_(self.prompt)
        self.mask.fill_(torch.finfo(DTYPE).min)
        self.mask[..., :self.prompt] = 0
        set_cache_length(self.cache, self.prompt)

    def step(self) -> torch.Tensor:
        self.mask.index_fill_(3, self.pos, 0.0)
        out = self.forward(input_ids=self.tok, attention_mask=self.mask, position_ids=self.posid, use_cache=True,
                         **self.api.with_cache(self.cache, self.pos))
        logits = out.logits[:, -1, :]  # [B, V]
        self.tok.copy_(logits.argmax(-1).view(-1, 1))
        self.pos.add_(1)
        self.posid.add_(1)
        return logits


def capture_decode(dec: Decoder, steps_left: int):
    """(graph, logits buffer, max relative logits difference vs eager) for one decode step, or
    raises. Warm-up on a side stream, capture, then CHECK_STEPS replays against the same steps
    run eagerly from the same state (compared as check_steps says)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec.reset()
        for _ in range(min(2, steps_left)):
            dec.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dec.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = dec.step()
    torch.cuda.synchronize()
    n = min(CHECK_STEPS, steps_left)
    dec.reset()
    ref = [dec.step().float().clone() for _ in range(n)]
    dec.reset()
    got = []
    for _ in range(n):
        graph.replay()
        got.append(logits.float().clone())
    torch.cuda.synchronize()
    diff, compared = check_steps(got, ref)
    if not math.isfinite(diff) or diff > CHECK_TOL:
        raise RuntimeError(f"the captured decode step disagrees with eager execution: max relative logits "
                           f"difference {diff:.3g} over {compared} step(s) > {CHECK_TOL}")
    return graph, logits, diff


def check_steps(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, int]:
    """(max relative logits difference, steps compared) between graph and eager decode steps.

    Both start from the same state, so step 1 must agree; a later step is compared only while the
    greedy tokens of the two runs agree. cuBLAS and SDPA at batch > 1 are not bit-reproducible
    run to run (eager against eager differs by ~1e-3 here), so on a random-weight model two
    logits within that noise can swap the argmax; then the runs feed different tokens and the
    following steps are not comparable. The step where that happens is still compared."""
    diff, compared = 0.0, 0
    for g, r in zip(got, ref):
        diff = max(diff, ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
        compared += 1
        if not torch.equal(g.argmax(-1), r.argmax(-1)):
            break
    return diff, compared


def compiled_forward(model):
    """The model's forward through torch.compile (inductor, static shapes) for --compile: the
    decode step's norms, rotary embedding, residual adds and SiLU-mul become a few fused kernels
    for every variant alike (jitmarlin's GEMMs are one opaque custom op each). One compiled
    wrapper per case; dynamo's recompile limit is raised so that cases and variants (new shapes,
    new module objects) never fall back to eager silently."""
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), 256))
    return torch.compile(model, dynamic=False)


def measure_case(model, api: ModelAPI, spec: ModelSpec, batch: int, prefill: int, decode: int, args,
                 device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(args.seed * 7919 + batch * 104729 + prefill)
    ids = torch.randint(0, spec.vocab, (batch, prefill), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # ---- prefill: one forward over the prompt, fresh DynamicCache, last-position logits
    def prefill_once():
        model(input_ids=ids, use_cache=True, **api.keep_last())

    for _ in range(args.warmup):
        prefill_once()
    _sync(device)
    t_prefill = statistics.median(time_call(prefill_once, device) for _ in range(args.prefill_reps))

    # ---- decode: StaticCache, greedy, decode steps timed on their own
    forward = compiled_forward(model) if args.compile else None
    dec = Decoder(model, api, ids, decode, forward)
    if forward is not None:  # compile (and settle) on the current stream before any capture
        for _ in range(min(2, decode)):
            dec.step()
        _sync(device)
    mode, note, diff, graph = "eager", "", None, None
    want_graph = device.type == "cuda" and args.decode_mode in ("auto", "graph")
    if want_graph:
        try:
            graph, logits_buf, diff = capture_decode(dec, decode)
            mode = "graph"
        except Exception as err:  # noqa: BLE001 - any capture problem: eager, with the reason
            if args.decode_mode == "graph":
                raise
            note = f"CUDA graph not used: {_reason(err)}"
            graph = None
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
    if graph is None:  # eager warm-up
        dec.reset()
        for _ in range(min(2, decode)):
            dec.step()
        _sync(device)
    dec.reset()
    _sync(device)
    one_step = graph.replay if graph is not None else dec.step

    def decode_all():
        for _ in range(decode):
            one_step()

    t_decode = time_call(decode_all, device)
    if args.compile:
        mode = f"compile+{mode}"
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"batch": batch, "prefill_len": prefill, "decode_len": decode,
            "prefill_tok_s": batch * prefill / t_prefill, "prefill_ms": t_prefill * 1e3,
            "decode_tok_s": batch * decode / t_decode, "decode_ms_per_step": t_decode * 1e3 / decode,
            "peak_memory_bytes": peak, "mode": mode, "prefill_mode": "eager", "decode_mode": mode,
            "graph_check_max_rel_diff": diff, "mode_note": note}


def probe(model, api: ModelAPI, spec: ModelSpec, device: torch.device, notes: list[str], label: str) -> None:
    """One small forward right after building, so a model that cannot run fails before timing.
    An fp16 MoE model whose transformers experts implementation fails (e.g. grouped_mm without
    fp16 support here) is switched to transformers' "eager" experts, and that is noted."""
    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    try:
        model(input_ids=ids, use_cache=True, **api.keep_last())
        _sync(device)
        return
    except Exception as err:  # noqa: BLE001
        impl = experts_implementation(model)
        if not spec.experts or impl in (None, "eager") or not hasattr(model, "set_experts_implementation"):
            raise
        reason = _reason(err)
    model.set_experts_implementation("eager")
    model(input_ids=ids, use_cache=True, **api.keep_last())
    _sync(device)
    notes.append(f"{label}: transformers experts implementation {impl!r} failed ({reason}); using 'eager'")
    print(f"  {notes[-1]}", flush=True)


# ---------------------------------------------------------------- tables and JSON


HEADER = ["Model", "Variant", "Batch", "Prefill len", "Decode len", "Prefill tok/s", "Decode tok/s", "Peak memory",
          "Weight memory", "mode"]
RATIO_HEADER = ["Model", "Variant", "Batch", "Prefill len", "Decode len", "Decode speedup vs fp16",
                "Prefill ratio vs fp16", "Weight-memory ratio vs fp16"]


def _mode_cell(r: dict) -> str:
    return f"prefill {r['prefill_mode']}, decode {r['decode_mode']}"


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["model"], r["variant"], r["batch"], r["prefill_len"], r["decode_len"], round(r["prefill_tok_s"], 1),
             round(r["decode_tok_s"], 1), _gib(r["peak_memory_bytes"]), _gib(r["weight_memory_bytes"]), _mode_cell(r)]
            for r in rows]


def ratios(rows: list[dict]) -> list[dict]:
    base = {(r["model"], r["batch"], r["prefill_len"], r["decode_len"]): r for r in rows if r["variant_key"] == "fp16"}
    out = []
    for r in rows:
        b = base.get((r["model"], r["batch"], r["prefill_len"], r["decode_len"]))
        if r["variant_key"] == "fp16" or b is None:
            continue
        out.append({"model": r["model"], "variant": r["variant"], "batch": r["batch"], "prefill_len": r["prefill_len"],
                    "decode_len": r["decode_len"], "decode_speedup": r["decode_tok_s"] / b["decode_tok_s"],
                    "prefill_ratio": r["prefill_tok_s"] / b["prefill_tok_s"],
                    "weight_memory_ratio": r["weight_memory_bytes"] / b["weight_memory_bytes"]})
    return out


def ratio_rows(rats: list[dict]) -> list[list]:
    return [[q["model"], q["variant"], q["batch"], q["prefill_len"], q["decode_len"], f"{q['decode_speedup']:.2f}x",
             f"{q['prefill_ratio']:.2f}x", f"{q['weight_memory_ratio']:.3f}"] for q in rats]


def summary_lines(rows: list[dict], rats: list[dict]) -> list[str]:
    """One line per (model, variant, batch): decode and prefill tok/s ranges, and for the
    quantized variants the ranges of the ratios against fp16."""

    def span(vals, fmt):
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"

    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["variant"], r["batch"]), []).append(r)
    for (model_label, variant, batch), rs in groups.items():
        qs = [q for q in rats if (q["model"], q["variant"], q["batch"]) == (model_label, variant, batch)]
        modes = ",".join(sorted({r["decode_mode"] for r in rs}))
        line = (f"{model_label} / {variant} / B={batch}: decode {span([r['decode_tok_s'] for r in rs], '{:.1f}')} "
                f"tok/s, prefill {span([r['prefill_tok_s'] for r in rs], '{:.0f}')} tok/s")
        if qs:
            line += (f"; vs fp16: decode {span([q['decode_speedup'] for q in qs], '{:.2f}')}x, prefill "
                     f"{span([q['prefill_ratio'] for q in qs], '{:.2f}')}x, weights "
                     f"{span([q['weight_memory_ratio'] for q in qs], '{:.3f}')}x")
        out.append(f"{line}; weight memory {_gib(rs[0]['weight_memory_bytes'])}; decode {modes}")
    return out


def environment(device: torch.device) -> dict:
    tf = _transformers()
    if device.type == "cuda":
        env = common.environment()
    else:
        env = {"gpu": None, "device": "cpu", "torch": torch.__version__, "jitmarlin": jitmarlin.__version__,
               "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d")}
    env["transformers"] = tf.__version__
    return env


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama,mixtral", help="comma-separated: llama, mixtral")
    ap.add_argument("--variants", default="fp16,w4,w4-fused,w4-act",
                    help="comma-separated: fp16, w4, w4-fused (+ jitmarlin.fuse_projections), w4-act")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill", default=None, help="prefill lengths (default 128,512,1024,2048; --full: 32..4096)")
    ap.add_argument("--decode", default=None, help="decode lengths (default 32,256,1024, Mixtral 32,256; --full: "
                                                  "32..4096)")
    ap.add_argument("--base-prefill", type=int, default=None, help="prefill length of the decode-length cases (128)")
    ap.add_argument("--base-decode", type=int, default=None, help="decode length of the prefill-length cases (128)")
    ap.add_argument("--full", action="store_true", help="cross product of the prefill and decode lengths (default "
                    "lengths: every power of two 32..4096)")
    ap.add_argument("--layers-mixtral", type=int, default=None, help="decoder layers of the Mixtral-shaped model "
                    "(default 32, the real model's)")
    ap.add_argument("--layers-llama", type=int, default=None, help="decoder layers of the Llama-shaped model (32)")
    ap.add_argument("--prefill-reps", type=int, default=3, help="timed prefill forwards per case (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed prefill forwards per case before timing")
    ap.add_argument("--decode-mode", choices=("auto", "graph", "eager"), default="auto",
                    help="auto: CUDA graph where it captures and checks, else eager (CPU: eager)")
    ap.add_argument("--compile", action="store_true",
                    help="decode steps through torch.compile (inductor) for every variant, then the CUDA graph as "
                         "usual (mode compile+graph); prefill stays eager")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds after which no new case starts "
                    "(0: no limit); cases not run are listed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny models and lengths (runs on the CPU without a GPU)")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in SPECS:
            ap.error(f"--models: unknown model {m!r}; known: {', '.join(SPECS)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    args.batches = _ints(args.batches)
    if args.smoke:
        default_p, default_d, base_p, base_d = "16,32", "4,16", 16, 8
    elif args.full:
        default_p = default_d = ",".join(map(str, POW2))
        base_p = base_d = 128
    else:
        default_p, default_d, base_p, base_d = "128,512,1024,2048", "32,256,1024", 128, 128
    args.prefill = _ints(args.prefill or default_p)
    args.decode_by_model = ({} if args.decode or args.smoke or args.full else
                            {key: _ints(v) for key, v in MODEL_DEFAULT_DECODE.items()})
    args.decode = _ints(args.decode or default_d)
    args.base_prefill = args.base_prefill or base_p
    args.base_decode = args.base_decode or base_d
    for name in ("prefill_reps", "warmup"):
        if getattr(args, name) < (1 if name == "prefill_reps" else 0):
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is too small")
    for name in ("layers_mixtral", "layers_llama"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def model_specs(args) -> dict[str, ModelSpec]:
    base = SMOKE_SPECS if args.smoke else SPECS
    out = {}
    for key in args.models:
        spec = base[key]
        layers = args.layers_mixtral if key == "mixtral" else args.layers_llama
        if layers is not None:
            spec = ModelSpec(**{**spec.__dict__, "layers": layers})
        out[key] = spec
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif args.smoke:
        device = torch.device("cpu")
        print("# no CUDA GPU: --smoke runs on the CPU (perf_counter timing, eager decode, no peak memory); the "
              "quantized variants need jitmarlin's kernels replaced by references there", flush=True)
    else:
        raise SystemExit("bench_e2e needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs tiny models "
                         "on the CPU to check the code paths")
    tf = _transformers()
    env = environment(device)
    specs = model_specs(args)
    cases_by_model = {key: cases_for(args, key) for key in specs}
    cases = sorted({c for cs in cases_by_model.values() for c in cs})
    notes: list[str] = [
        "prefill: one eager forward over batch x prefill tokens (fresh DynamicCache, last-position logits), CUDA "
        "events, median of --prefill-reps after warm-up",
        "decode: greedy steps after the prompt was run into a StaticCache of prefill+decode positions (16-aligned); "
        "decode tok/s = batch x decode_len / time of decode_len steps (the prefill's token not counted); mode graph = "
        "one captured step replayed, checked against eager on its first steps",
        "peak memory: torch.cuda.max_memory_allocated over the case with only this variant's model resident; weight "
        "memory: bytes of parameters + buffers",
        "quantized variants: jitmarlin.quantize_model (RTN, symmetric) on every nn.Linear and MoE block except "
        "lm_head; embeddings, norms and lm_head stay fp16; 'fused' also runs jitmarlin.fuse_projections (q/k/v and "
        "gate/up as one GEMM each); act_order is left unfused, as a GPTQ desc_act checkpoint (one column order per "
        "layer) would be",
        "peers: none measured. benchmarks/peers.py wraps single GEMMs (Humming, torch int4, gemlite); putting one "
        "into every layer of a transformers model, and a peer MoE kernel for Mixtral, is not done by this script",
    ]
    print(f"# bench_e2e on {env.get('gpu') or 'cpu'}: torch {env['torch']}, transformers {tf.__version__}, "
          f"jitmarlin {env['jitmarlin']}", flush=True)
    for spec in specs.values():
        line = (f"{spec.label}: hidden {spec.hidden}, intermediate {spec.intermediate}, {spec.heads} heads "
                f"({spec.kv_heads} KV), vocab {spec.vocab}"
                + (f", {spec.experts} experts top-{spec.top_k}" if spec.experts else ""))
        notes.append(line)
        print(f"# {line}", flush=True)
    for key, spec in specs.items():
        print(f"# {spec.label}: batches {args.batches}; (prefill, decode) cases {cases_by_model[key]}", flush=True)
    print(f"# variants {args.variants}", flush=True)

    rows: list[dict] = []
    failures: list[dict] = []
    skipped: list[dict] = []
    result = {"env": env, "args": {k: v for k, v in vars(args).items()}, "cases": cases,
              "cases_by_model": {specs[k].label: v for k, v in cases_by_model.items()}, "rows": rows,
              "ratios": [], "failures": failures, "skipped": skipped, "notes": notes, "complete": False}

    def save():
        result["ratios"] = ratios(rows)
        common.write_json(args.json, result)

    def over_budget() -> bool:
        return args.time_budget > 0 and time.time() - t_start > args.time_budget

    for key, spec in specs.items():
        for vkey in args.variants:
            label, qopts = VARIANTS[vkey]
            todo = [(b, p, d) for b in args.batches for p, d in cases_by_model[key]]
            if over_budget():
                skipped += [{"model": spec.label, "variant": label, "batch": b, "prefill_len": p, "decode_len": d,
                             "reason": f"time budget of {args.time_budget:.0f} s spent"} for b, p, d in todo]
                print(f"{spec.label} / {label}: skipped, time budget of {args.time_budget:.0f} s spent", flush=True)
                continue
            free_memory(device)
            model = None
            try:
                if device.type == "cuda":
                    free, total = torch.cuda.mem_get_info(device)
                    need = spec.fp16_bytes()
                    if need + 2 * GIB > free:
                        raise RuntimeError(f"the fp16 model needs {_gib(need)} and {_gib(free)} of the GPU's "
                                           f"{_gib(total)} are free: use fewer layers (--layers-{key})")
                t0 = time.time()
                model = build_model(spec, device, args.seed)
                built = time.time() - t0
                info = f"built in {built:.1f} s"
                if qopts is not None:
                    t0 = time.time()
                    report = jitmarlin.quantize_model(model, device=device, **qopts)
                    info += f", quantized in {time.time() - t0:.1f} s: {report.summary()}"
                    del report
                    if vkey in FUSED_VARIANTS:
                        info += f"; fuse_projections: {jitmarlin.fuse_projections(model)}"
                api = ModelAPI(model)
                with torch.no_grad():
                    probe(model, api, spec, device, notes, f"{spec.label} / {label}")
                weight_bytes = module_bytes(model)
                impl = experts_implementation(model) if (spec.experts and qopts is None) else None
                if impl:
                    info += f"; transformers experts implementation {impl!r}"
                    notes.append(f"{spec.label} / {label}: the experts run transformers' {impl!r} experts "
                                 "implementation")
                print(f"{spec.label} / {label}: {info}; weights {_gib(weight_bytes)}", flush=True)
            except Exception as err:  # noqa: BLE001 - the variant is reported as failed, the run goes on
                failures.append({"model": spec.label, "variant": label, "stage": "build or first forward",
                                 "error": _reason(err, 600)})
                print(f"{spec.label} / {label}: FAILED to build or run: {_reason(err, 600)}", flush=True)
                model = None
                free_memory(device)
                save()
                continue
            for b, p, d in todo:
                if over_budget():
                    skipped.append({"model": spec.label, "variant": label, "batch": b, "prefill_len": p,
                                    "decode_len": d, "reason": f"time budget of {args.time_budget:.0f} s spent"})
                    continue
                free_memory(device)
                try:
                    with torch.no_grad():
                        r = measure_case(model, api, spec, b, p, d, args, device)
                except Exception as err:  # noqa: BLE001
                    failures.append({"model": spec.label, "variant": label, "batch": b, "prefill_len": p,
                                     "decode_len": d, "stage": "measure", "error": _reason(err, 600)})
                    print(f"  B={b} P={p} D={d}: FAILED: {_reason(err, 600)}", flush=True)
                    free_memory(device)
                    save()
                    continue
                r = {"model": spec.label, "model_key": key, "layers": spec.layers, "variant": label,
                     "variant_key": vkey, "weight_memory_bytes": weight_bytes,
                     "experts_implementation": impl, **r}
                rows.append(r)
                if r["mode_note"]:
                    print(f"  B={b} P={p} D={d}: {r['mode_note']}", flush=True)
                print(f"  B={b} P={p} D={d}: prefill {r['prefill_tok_s']:.1f} tok/s ({r['prefill_ms']:.2f} ms), "
                      f"decode {r['decode_tok_s']:.1f} tok/s ({r['decode_ms_per_step']:.3f} ms/step, "
                      f"{r['decode_mode']}), peak {_gib(r['peak_memory_bytes'])} [{time.time() - t_start:.0f} s]",
                      flush=True)
                save()
            ref = weakref.ref(model)
            del model
            free_memory(device)
            if ref() is not None:
                notes.append(f"{spec.label} / {label}: the model was still referenced after its cases (memory not "
                             "freed)")
                print(f"  WARNING: {notes[-1]}", flush=True)

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        for key, spec in specs.items():
            w = {r["variant_key"]: r["weight_memory_bytes"] for r in rows if r["model_key"] == key}
            if "fp16" in w and "w4" in w:
                notes.append(f"{spec.label}: fp16 weights {_gib(w['fp16'])} + W4 copy {_gib(w['w4'])} = "
                             f"{_gib(w['fp16'] + w['w4'])} of the GPU's {_gib(total)} (each variant was measured "
                             "alone)")
    result["complete"] = not skipped
    result["elapsed_s"] = time.time() - t_start
    table = common.markdown_table(HEADER, table_rows(rows))
    rats = ratios(rows)
    ratio_table = common.markdown_table(RATIO_HEADER, ratio_rows(rats))
    result["table"], result["ratio_table"] = table, ratio_table
    print()
    print(table)
    print()
    print("Ratios vs fp16 of the same model, batch and lengths (tok/s ratio: > 1 is faster; weight memory: < 1 is "
          "smaller):")
    print()
    print(ratio_table)
    print()
    for n in notes:
        print(f"- {n}")
    mode_notes: dict[tuple, int] = {}
    for r in rows:
        if r["mode_note"]:
            k = (r["model"], r["variant"], r["mode_note"])
            mode_notes[k] = mode_notes.get(k, 0) + 1
    for (model_label, variant, note), count in mode_notes.items():
        print(f"- {model_label} / {variant}, {count} case(s): {note}")
    print()
    print("Summary (ranges over the cases of each model, variant and batch):")
    for line in summary_lines(rows, rats):
        print(f"  {line}")
    for f in failures:
        where = "" if "batch" not in f else f" B={f['batch']} P={f['prefill_len']} D={f['decode_len']}"
        print(f"- FAILED {f['model']} / {f['variant']}{where} ({f['stage']}): {f['error']}")
    if skipped:
        print(f"- NOT RUN: {len(skipped)} case(s) ({skipped[0]['reason']}), from {skipped[0]['model']} / "
              f"{skipped[0]['variant']} B={skipped[0]['batch']} P={skipped[0]['prefill_len']} "
              f"D={skipped[0]['decode_len']} on")
    print(f"# done in {result['elapsed_s']:.0f} s", flush=True)
    save()
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(1 if res["failures"] or not res["rows"] else 0)
