"""Generation speed on CUDA (random weights, bf16): ``python -m bench.generate`` prints a table and writes
``bench/results/generate.json`` (header: device, versions, date, commit; rewritten after every case, so a run stopped
early keeps what it measured).

Cases (``--cases``, comma-separated; all by default):

- ``batch1``: ms per new token at batch 1 (512-token prompt) of Diagonal KDN at each ``--sizes`` size, through
  :func:`models.generate` (packed prefill, CUDA-graph step);
- ``batch64``: new tokens/s at batch 64 (the largest size);
- ``context``: ms per new token after a 32K-token prompt over that after a 1K one (the largest size);
- ``prefill``: tokens/s of the packed prefill of 64 x 4K prompts, beside the tokens/s of the training forward (the
  backbone over the same packed tokens, no cache; the largest size);
- ``anchors``: at each size, batch 1: fla's ``KDAForCausalLM`` with HF ``generate``, our full-attention Transformer
  through :func:`models.generate` and through HF's loop, and our Diagonal KDN through HF's loop;
- ``profile``: where one decoding step's time goes, at batch 1 and 64 (the largest size): the replayed graph's step
  time, and the CUDA kernels of the same step run eagerly (count and device time per step, the top kernels).

ms per new token is ``(t(n + 1 new tokens) - t(1 new token)) / n``: the prefill and the first token cancel. Beside
each row, the bandwidth floor of one step: bytes read (the weights without the embedding table, plus each row's
decoding state: recurrent memories, conv windows, attention keys and values) / 4.3 TB/s (the H200's HBM).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from trainer.checkpoint import write_json_atomic

HBM_BYTES_PER_S = 4.3e12
OUT = Path(__file__).parent / "results" / "generate.json"
CASES = ("batch1", "batch64", "context", "prefill", "anchors", "profile")
TARGETS = {  # the case's goal, as (key of the row, comparison, value)
    ("batch1", "100m"): ("ms_per_token", "<=", 1.5),
    ("batch1", "750m"): ("ms_per_token", "<=", 3.0),
    ("batch64", "750m"): ("tokens_per_s", ">=", 20000.0),
    ("context", "750m"): ("ratio_32k_1k", "<=", 1.1),
    ("prefill", "750m"): ("ratio_to_forward", ">=", 0.5),
}


def header() -> dict[str, object]:
    """Device, library versions, date and the commit of this checkout."""
    versions = {"torch": torch.__version__}
    for name in ("triton", "fla", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001 (a missing library is reported, not fatal)
            versions[name] = f"unavailable ({type(err).__name__})"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"device": torch.cuda.get_device_name(), "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "dtype": "bfloat16", "weights": "random", "hbm_bytes_per_s": HBM_BYTES_PER_S}


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up run), the device synchronised."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ms_per_token(run: Callable[[int], object], n: int, repeats: int) -> float:
    """``(t(n + 1) - t(1)) / n`` in ms, ``run(k)`` generating ``k`` new tokens."""
    return (seconds(lambda: run(n + 1), repeats) - seconds(lambda: run(1), repeats)) / n * 1e3


@functools.lru_cache(maxsize=1)
def ours(size: str, mixer: str = "kdn_diag") -> torch.nn.Module:
    """Our model at ``size`` (bf16, random weights, CUDA; the last one built is kept for the next case); full
    attention for ``mixer="attn"``."""
    from models import build_model, model_config

    kw = {"window": None} if mixer == "attn" else {}
    model = build_model(model_config(size, mixer, "recurrent", **kw)).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # rows run to max_new_tokens
    return model


def fla_kda(size: str) -> torch.nn.Module:
    """fla's ``KDAForCausalLM`` with our backbone's width, depth and heads at ``size`` (bf16, random weights)."""
    from fla.models import KDAConfig, KDAForCausalLM

    from models.sizes import SIZES

    s = SIZES[size]
    cfg = KDAConfig(hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"], num_heads=s["num_heads"],
                    head_dim=s["head_dim"], vocab_size=32000)
    model = KDAForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def floor_ms(model: torch.nn.Module, state_bytes_per_row: float, batch: int) -> float:
    """One step's bandwidth floor in ms: the weights (the embedding table aside: one row a token) and ``batch`` rows
    of decoding state, read once, at :data:`HBM_BYTES_PER_S`."""
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - emb.numel() * emb.element_size()
    return (weights + batch * state_bytes_per_row) / HBM_BYTES_PER_S * 1e3


def static_state_bytes(model: torch.nn.Module) -> float:
    """Bytes of decoding state per row in the model's static decoders (the last one built)."""
    from models.generation import decoders

    pool = decoders(model)
    if not pool.decoders:
        raise RuntimeError("no static decoder was built: generate at least two new tokens first")
    return decoder_state_bytes(list(pool.decoders.values())[-1])


def decoder_state_bytes(dec: object) -> float:
    """Bytes of decoding state per row in a :class:`models.generation.StaticDecoder`'s cache."""
    total = 0
    for state in dec.cache.layers.values():
        for name, t in _tensors(state):
            if name != "cursor":
                total += t.numel() * t.element_size()
    return total / dec.batch_size


def _tensors(value: object, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, with the name of the dict key above it."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _tensors(v, str(k))]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _tensors(v, name)]
    return []


def hf_state_bytes(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Bytes per row of the cache HF's loop keeps after ``ids``: our :class:`models.KDNCache`, or a cache indexed by
    layer (fla's ``FLACache``)."""
    from models import KDNCache

    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    states = list(cache.layers.values()) if isinstance(cache, KDNCache) else [cache[i] for i in range(len(cache))]
    seen: set[int] = set()
    total = 0
    for _, t in _tensors(states):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / ids.shape[0]


def prompt(B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(3, 32000, (B, T), device="cuda", generator=g)


def run_ours(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[int], object]:
    from models import generate

    return lambda k: generate(model, ids, k)


def run_hf(model: torch.nn.Module, ids: torch.Tensor, **kw: object) -> Callable[[int], object]:
    return lambda k: model.generate(ids, max_new_tokens=k, do_sample=False, pad_token_id=0, **kw)


def case_batch1(sizes: list[str], n: int, repeats: int) -> list[dict]:
    rows = []
    for size in sizes:
        model = ours(size)
        ids = prompt(1, 512)
        ms = ms_per_token(run_ours(model, ids), n, repeats)
        rows.append({"case": "batch1", "size": size, "model": "ours kdn_diag (models.generate)", "batch": 1,
                     "prompt": 512, "ms_per_token": ms, "floor_ms": floor_ms(model, static_state_bytes(model), 1)})
        del model
        torch.cuda.empty_cache()
    return rows


def case_batch64(size: str, n: int, repeats: int) -> list[dict]:
    model = ours(size)
    ids = prompt(64, 512)
    ms = ms_per_token(run_ours(model, ids), n, repeats)
    return [{"case": "batch64", "size": size, "model": "ours kdn_diag (models.generate)", "batch": 64, "prompt": 512,
             "ms_per_step": ms, "tokens_per_s": 64 / ms * 1e3,
             "floor_ms": floor_ms(model, static_state_bytes(model), 64)}]


def case_context(size: str, n: int, repeats: int) -> list[dict]:
    model = ours(size)
    per = {}
    for T in (1024, 32768):
        per[T] = ms_per_token(run_ours(model, prompt(1, T)), n, repeats)
    return [{"case": "context", "size": size, "model": "ours kdn_diag (models.generate)", "batch": 1,
             "ms_per_token_1k": per[1024], "ms_per_token_32k": per[32768], "ratio_32k_1k": per[32768] / per[1024],
             "floor_ms": floor_ms(model, static_state_bytes(model), 1)}]


def case_prefill(size: str, repeats: int) -> list[dict]:
    from models.generation import prefill

    model = ours(size)
    B, T = 64, 4096
    ids = prompt(B, T)
    mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    cu = torch.arange(0, B * T + 1, T, device="cuda")

    def forward() -> None:
        with torch.no_grad():
            model.model(ids.reshape(1, -1), cu_seqlens=cu)

    t_prefill = seconds(lambda: prefill(model, ids, mask), repeats)
    t_forward = seconds(forward, repeats)
    return [{"case": "prefill", "size": size, "model": "ours kdn_diag", "batch": B, "prompt": T,
             "tokens_per_s": B * T / t_prefill, "forward_tokens_per_s": B * T / t_forward,
             "ratio_to_forward": t_forward / t_prefill}]


def case_anchors(sizes: list[str], n: int, n_hf: int, repeats: int) -> Iterator[dict]:
    for size in sizes:
        ids = prompt(1, 512)
        # fla's model last: its first use compiles fla's kernels for new shapes, minutes on a cold cache
        builds: list[tuple[str, Callable[[], torch.nn.Module], str, int]] = [
            ("ours attn, full (models.generate)", partial(ours, size, "attn"), "ours", n),
            ("ours attn, full (HF loop)", partial(ours, size, "attn"), "hf_static_off", n_hf),
            ("ours kdn_diag (HF loop)", partial(ours, size), "hf_static_off", n_hf),
            ("fla KDAForCausalLM (HF generate)", partial(fla_kda, size), "hf", n_hf),
        ]
        for name, build, how, k in builds:
            row = {"case": "anchors", "size": size, "model": name, "batch": 1, "prompt": 512}
            try:
                model = build()
                if how == "ours":
                    row["ms_per_token"] = ms_per_token(run_ours(model, ids), k, repeats)
                    row["floor_ms"] = floor_ms(model, static_state_bytes(model), 1)
                else:
                    kw = {"static_decode": False} if how == "hf_static_off" else {}
                    row["ms_per_token"] = ms_per_token(run_hf(model, ids, **kw), k, repeats)
                    row["floor_ms"] = floor_ms(model, hf_state_bytes(model, ids), 1)
                del model
            except Exception as err:  # noqa: BLE001 (one anchor failing must not lose the others)
                row["error"] = f"{type(err).__name__}: {err}"
            torch.cuda.empty_cache()
            yield row


@torch.no_grad()
def case_profile(size: str, repeats: int, steps: int = 20) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from models.generation import StaticDecoder, prefill

    model = ours(size)
    rows = []
    for B in (1, 64):
        ids = prompt(B, 512)
        _, cache = prefill(model, ids, torch.ones_like(ids, dtype=torch.bool))
        decs, ms = {}, {}
        for graph in (False, True):
            dec = decs[graph] = StaticDecoder(model, B, {}, ids.device, graph)
            dec.cache.load(cache, B)
            if graph:  # the capture advances the state: load it again
                dec.capture()
                dec.cache.load(cache, B)
            dec.ids.copy_(ids[:, -1:])
            ms[graph] = seconds(lambda d=dec: [d.step() for _ in range(steps)], repeats) / steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                decs[False].step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
        rows.append({"case": "profile", "size": size, "model": "ours kdn_diag (static step)", "batch": B,
                     "graph_ms_per_step": ms[True], "eager_ms_per_step": ms[False],
                     "kernels_per_step": sum(e.count for e in kernels) / steps,
                     "kernel_ms_per_step": sum(e.self_device_time_total for e in kernels) / steps / 1e3,
                     "top_kernels": [{"name": e.key[:90], "per_step": e.count / steps,
                                      "us_per_step": e.self_device_time_total / steps} for e in top],
                     "floor_ms": floor_ms(model, decoder_state_bytes(decs[True]), B)})
        del decs
    return rows


def verdict(row: dict) -> str:
    target = TARGETS.get((row["case"], row["size"]))
    if target is None or row.get("model", "").startswith("fla") or target[0] not in row:
        return ""
    key, op, value = target
    ok = row[key] <= value if op == "<=" else row[key] >= value
    return f"{key} {op} {value:g}: {'met' if ok else 'MISSED'}"


def report(rows: list[dict]) -> None:
    print(f"{'case':<8} {'size':<5} {'model':<36} {'batch':>5} {'result':<44} {'floor ms':>8}  target")
    for r in rows:
        if "error" in r:
            result = "error: " + r["error"][:80]
        elif r["case"] == "batch64":
            result = f"{r['tokens_per_s']:.0f} tok/s ({r['ms_per_step']:.2f} ms/step)"
        elif r["case"] == "context":
            result = f"{r['ms_per_token_1k']:.2f} / {r['ms_per_token_32k']:.2f} ms (x{r['ratio_32k_1k']:.2f})"
        elif r["case"] == "profile":
            result = (f"graph {r['graph_ms_per_step']:.2f} ms, eager {r['eager_ms_per_step']:.2f}; "
                      f"{r['kernels_per_step']:.0f} kernels {r['kernel_ms_per_step']:.2f} ms")
        elif r["case"] == "prefill":
            result = (f"{r['tokens_per_s'] / 1e3:.0f}K tok/s vs fwd {r['forward_tokens_per_s'] / 1e3:.0f}K "
                      f"(x{r['ratio_to_forward']:.2f})")
        else:
            result = f"{r['ms_per_token']:.2f} ms/token"
        fl = f"{r['floor_ms']:.3f}" if "floor_ms" in r else "-"
        print(f"{r['case']:<8} {r['size']:<5} {r['model'][:36]:<36} {r['batch']:>5} {result:<44} {fl:>8}  "
              f"{verdict(r)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--sizes", default="100m,750m", help="model sizes of batch1 and anchors; the last one is "
                                                         "batch64's, context's and prefill's")
    ap.add_argument("--new-tokens", type=int, default=128, help="timed new tokens through models.generate")
    ap.add_argument("--hf-new-tokens", type=int, default=32, help="timed new tokens through HF's loop")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.generate needs a CUDA device (it times CUDA graphs and fused kernels)")
    cases = [c for c in args.cases.split(",") if c]
    bad = sorted(set(cases) - set(CASES))
    if bad:
        raise SystemExit(f"unknown cases {bad}; choose from {','.join(CASES)}")
    sizes = [s for s in args.sizes.split(",") if s]
    from models.sizes import SIZES

    if not sizes or set(sizes) - set(SIZES):
        raise SystemExit(f"--sizes must name sizes of {sorted(SIZES)}, got {args.sizes!r}")
    if args.new_tokens < 1 or args.hf_new_tokens < 1 or args.repeats < 1:
        raise SystemExit("--new-tokens, --hf-new-tokens and --repeats must be positive")
    result = {**header(), "cases": cases, "rows": []}
    runs = {
        "batch1": lambda: case_batch1(sizes, args.new_tokens, args.repeats),
        "batch64": lambda: case_batch64(sizes[-1], args.new_tokens, args.repeats),
        "context": lambda: case_context(sizes[-1], args.new_tokens, args.repeats),
        "prefill": lambda: case_prefill(sizes[-1], args.repeats),
        "anchors": lambda: case_anchors(sizes, args.new_tokens, args.hf_new_tokens, args.repeats),
        "profile": lambda: case_profile(sizes[-1], args.repeats),
    }
    for case in cases:
        t0 = time.perf_counter()
        try:
            for r in runs[case]():  # each row written as it comes: a run stopped mid-case keeps the rows before
                result["rows"].append({**r, "case_seconds": time.perf_counter() - t0})
                write_json_atomic(args.out, result)
        except Exception as err:  # noqa: BLE001 (a failed case is recorded; the others still run)
            result["rows"].append({"case": case, "size": sizes[-1], "model": "-", "batch": 0,
                                   "error": f"{type(err).__name__}: {err}",
                                   "case_seconds": time.perf_counter() - t0})
            write_json_atomic(args.out, result)
        torch.cuda.empty_cache()
    report(result["rows"])
    for r in result["rows"]:
        for k in r.get("top_kernels", ()):
            print(f"  batch {r['batch']:>2} {k['per_step']:>5.1f}x {k['us_per_step']:>8.1f} us  {k['name']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
