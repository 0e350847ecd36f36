"""The GPU tools' host-side logic: the Diagonal memory variants of bench.mixer_throughput (arguments), the stage
time limits of bench/gpu.sh (a stage that ignores SIGTERM, as train.py does, is still stopped in time), and
bench.warm_triton's workers (each compiles and runs its share of the configurations, untimed, and keeps no
autotune results), in Triton's interpreter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TIMEOUT_FACTOR_ENV, timeout_s

from bench.mixer_throughput import variant

ROOT = Path(__file__).resolve().parents[1]


def test_variant_names_the_memory_settings() -> None:
    """``kdn_diag@<tag>`` names the Diagonal memory route, passed to the layer and the op as arguments."""
    assert variant("kdn_diag@c32") == ("kdn_diag", {"memory": "dplr", "chunk_size": 32})
    assert variant("kdn_diag@dplr") == ("kdn_diag", {"memory": "dplr"})
    assert variant("kdn_diag@asym") == ("kdn_diag", {"memory": "asym"})
    assert variant("kdn_iso") == ("kdn_iso", {})
    for tag in ("x64", "c64"):
        with pytest.raises(ValueError, match=f"unknown variant '{tag}'"):
            variant(f"kdn_diag@{tag}")
    import kdn

    for name in ("kdn_diag@c32", "kdn_diag@dplr", "kdn_diag@asym"):  # every variant builds its layer
        layer = kdn.DiagonalKDN(32, 2, 8, **variant(name)[1])
        assert (layer.memory, layer.chunk_size) == (variant(name)[1]["memory"], variant(name)[1].get("chunk_size"))


def _run_stages(script: str, env: dict[str, str]) -> tuple[str, float]:
    src = (ROOT / "bench" / "gpu.sh").read_text()
    func = re.search(r"^run_stage\(\) \{.*?^\}", src, re.S | re.M).group(0)
    start = time.monotonic()
    # SECONDS unset, then set, is a plain variable: the stage finds no time spent, so the limits below are exact
    # (bash's clock would count a second whenever a second's boundary passed before the stage)
    proc = subprocess.run(["bash", "-c", f"LOG=/dev/null; unset SECONDS; SECONDS=0; START=0; rc=0\n{func}\n"
                                         f"{script}\necho rc=$rc"],
                          env=env, capture_output=True, text=True, timeout=timeout_s(60))
    return proc.stdout, time.monotonic() - start


def test_gpu_stages_stay_inside_the_run() -> None:
    env = {"PATH": "/usr/bin:/bin", "KILL_S": "1"}
    # a stage that ignores SIGTERM is killed KILL_S seconds after its limit
    out, took = _run_stages("run_stage stubborn bash -c 'trap \"\" TERM; sleep 300'",
                            env | {"STAGE_S": "2", "GPU_S": "1000"})
    assert "limit 2 s)" in out and "=== stubborn exit 137" in out and "rc=137" in out, out
    assert took < 300, took  # stopped, not run to its end
    # a stage's limit is cut to what GPU_S leaves (minus KILL_S and 5 s for the tarball)
    out, _ = _run_stages("run_stage quick true", env | {"STAGE_S": "100", "GPU_S": "17"})
    assert "=== quick (" in out and "limit 11 s)" in out and "=== quick exit 0" in out and "rc=0" in out, out
    # and skipped when under 10 s would be left
    out, _ = _run_stages("run_stage late true", env | {"STAGE_S": "100", "GPU_S": "15"})
    assert "=== late skipped: GPU_S reached" in out and "rc=124" in out, out


WARM_SCRIPT = r"""
import json, sys, torch, triton, triton.language as tl
from bench.warm_triton import patch_autotuner


@triton.autotune(configs=[triton.Config({"B": b}) for b in (1, 2, 4, 8)], key=["n"])
@triton.jit
def kern(x_ptr, n, B: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, B), tl.full([B], B, tl.float32))


patch_autotuner(int(sys.argv[1]), int(sys.argv[2]))
x = torch.zeros(8)
kern[(1,)](x, 8)
print(json.dumps({"configs": [c.kwargs["B"] for c in kern.configs], "cache": kern.cache_results, "x": x.tolist()}))
"""


@pytest.mark.parametrize("worker,workers,share,x", [
    (0, 2, [1, 4], [1, 4, 4, 4, 0, 0, 0, 0]),  # both run once, untimed, in order; then the first (equal "timings")
    (1, 3, [2], [2, 2, 0, 0, 0, 0, 0, 0]),  # a share of one: run as it is
    (5, 6, [1], [1, 0, 0, 0, 0, 0, 0, 0]),  # an empty share: the first configuration
])
def test_warm_worker_compiles_only_its_share(worker: int, workers: int, share: list[int], x: list[float]) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", WARM_SCRIPT, str(worker), str(workers)], env=env,
                          capture_output=True, text=True, timeout=timeout_s(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"configs": share, "cache": False, "x": x}


def test_warm_runs_the_workload_in_every_worker(tmp_path: Path) -> None:
    (tmp_path / "warm_probe.py").write_text(
        "import os, sys\nfrom pathlib import Path\n"
        "Path(os.environ['PROBE_DIR'], str(os.getpid())).write_text(' '.join(sys.argv[1:]))\n"
        "raise SystemExit(3 if '--fail' in sys.argv else 0)\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "PROBE_DIR": str(tmp_path / "out"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-m", "bench.warm_triton", "--workers", "3", "-m", "warm_probe",
                           "--T", "8192"], env=env, capture_output=True, text=True, timeout=timeout_s(120),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    runs = [p.read_text() for p in (tmp_path / "out").iterdir()]
    assert runs == ["--T 8192"] * 3
    assert "3 workers ran `-m warm_probe --T 8192`" in proc.stdout


def test_merge_joins_sweeps_of_two_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.mixer_throughput import merge

    def row(mixer: str, T: int, tok: float) -> dict:
        return {"mixer": mixer, "T": T, "ms_fwdbwd": 4 * T / tok * 1e3, "ms_fwd": 1.0, "ms_kernel_fwdbwd": None,
                "ms_host_fwdbwd": 0.5, "tokens_per_s": tok, "peak_mem_gb": 1.0}

    a = {"header": {"device": "H200", "cuda_visible_devices": "0"},
         "results": [row("kdn_diag", 2048, 1.8e6), row("kda", 2048, 2.0e6), row("kdn_diag", 8192, 1.5e6)]}
    b = {"header": {"device": "H200", "cuda_visible_devices": "1"},
         "results": [row("gdn2", 2048, 1.4e6), {"mixer": "gdn", "T": 2048, "error": "RuntimeError: refused"}]}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, run in zip(paths, (a, b)):
        p.write_text(json.dumps(run))
    merge(paths, tmp_path / "m.json")
    m = json.loads((tmp_path / "m.json").read_text())
    assert [(r["mixer"], r["T"]) for r in m["results"]] == [
        ("kdn_diag", 2048), ("kda", 2048), ("gdn2", 2048), ("gdn", 2048), ("kdn_diag", 8192)]
    assert m["header"]["merged_from"] == [a["header"], b["header"]]
    assert (tmp_path / "m.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert re.search(r"kdn_diag\s+2048 .* 1\.800\s+0\.90 ", table), table
    assert re.search(r"gdn\s+2048\s+RuntimeError: refused", table), table


def test_gpu_pair_runs_both_gpus_then_both_together(tmp_path: Path) -> None:
    # the limits only bound a hang (scaled with the suite's): a loaded machine imports torch, triton and fla slowly
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "none"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PAIR_S": f"{timeout_s(400):.0f}",
           "PAIR1_S": f"{timeout_s(200):.0f}", "STAGE_S": f"{timeout_s(100):.0f}"}
    proc = subprocess.run(["bash", "bench/gpu_pair.sh", "throughput=--help ; bench=norm_throughput --help",
                           "throughput=--help ;",
                           " env=BENCH_ARGS=--help ; throughput "],
                          env=env, capture_output=True, text=True, timeout=timeout_s(600), cwd=ROOT)
    out = tmp_path / "out"
    assert proc.returncode == 0, proc.stderr
    gpu0 = (out / "gpu0.log").read_text()
    assert "=== throughput exit 0" in gpu0 and "=== bench norm_throughput exit 0" in gpu0, gpu0
    assert "=== throughput exit 0" in (out / "gpu1.log").read_text()
    both = (out / "both.log").read_text()
    assert "=== BENCH_ARGS=--help" in both and "=== throughput exit 0" in both, both
    listed = subprocess.run(["tar", "tzf", out / "results.tgz"], capture_output=True, text=True).stdout
    assert {"./gpu0/", "./gpu1/", "./both/"} <= set(listed.split()), listed
    assert (out / "autotune.tgz").stat().st_size > 0


@pytest.mark.parametrize("group", [0, 1, 2])
def test_gpu_pair_refuses_an_unknown_stage_before_any_work(tmp_path: Path, group: int) -> None:
    """A misspelt stage in any group stops bench/gpu_pair.sh with exit 2 before its set-up: no log, no output."""
    groups = ["throughput=--help", "bench=norm_throughput --help ; env=A=b", "kernels=x ;parity2=ddp"]
    groups[group] += " ; nope"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "none"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", "bench/gpu_pair.sh", *groups], env=env, capture_output=True, text=True,
                          timeout=timeout_s(60), cwd=ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("unknown stage nope; stages: kernels kernels=*"), proc.stderr
    assert "throughput750m_paper=*" in proc.stderr and not (tmp_path / "out").exists()


def test_timeout_factor_scales_every_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """One factor (``KDN_TEST_TIMEOUT_FACTOR``, default 4) scales every subprocess limit, the interpreter's too; a
    bad one is refused in one line, by the helper and by pytest at start-up."""
    import triton_interpret

    monkeypatch.delenv(TIMEOUT_FACTOR_ENV, raising=False)
    assert timeout_s(60) == 240
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, "2.5")
    assert timeout_s(60) == 150
    for bad in ("0", "-1", "fast", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_FACTOR_ENV, bad)
        with pytest.raises(ValueError, match=f"KDN_TEST_TIMEOUT_FACTOR='{bad}' is not a positive number"):
            timeout_s(60)
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, "0.01")  # 60 s scaled to 0.6 s: the interpreter's sleep is cut short
    with pytest.raises(subprocess.TimeoutExpired):
        triton_interpret.run_interpreted("import time; time.sleep(30)", timeout=60)
    monkeypatch.delenv(TIMEOUT_FACTOR_ENV)
    probe = f"{Path(__file__).resolve()}::test_variant_names_the_memory_settings"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", probe],
                          env={**os.environ, TIMEOUT_FACTOR_ENV: "x"}, capture_output=True, text=True,
                          timeout=timeout_s(120), cwd=ROOT)
    assert proc.returncode != 0 and "KDN_TEST_TIMEOUT_FACTOR='x' is not a positive number" in proc.stderr, proc.stderr


def test_gpu_tolerances_refuses_a_machine_without_cuda() -> None:
    from bench import gpu_tolerances

    if torch_has_cuda():
        pytest.skip("this machine has CUDA: the measurement would run")
    with pytest.raises(SystemExit, match=r"^bench.gpu_tolerances needs a CUDA GPU: run it on the GPU machine") as err:
        gpu_tolerances.main(["--seeds", "2"])
    assert "\n" not in str(err.value)


def test_gpu_tolerances_table_and_json(tmp_path: Path) -> None:
    """Each comparison and tensor's max / p99 / median over the seeds, the worst tensor under each constant, and the
    JSON written whole (no temporary file left)."""
    from bench.gpu_tolerances import format_table, summarize, write_json

    errors = {"delta_fla[kda]": {"o": [3e-3, 1e-3, 2e-3], "dfront.A_log": [0.0176, 0.004, 0.009, 0.001, 0.002]},
              "delta_fla[gdn]": {"o": [4e-3, 4.5e-3]}}
    bounds = {"delta_fla[kda]": {"o": "DELTA_TOL_O", "dfront.A_log": "DELTA_TOL_PER_HEAD_GRAD"},
              "delta_fla[gdn]": {"o": "DELTA_TOL_O"}}
    rows = summarize(errors, bounds)
    assert [(r["comparison"], r["tensor"], r["seeds"]) for r in rows] == [
        ("delta_fla[kda]", "o", 3), ("delta_fla[kda]", "dfront.A_log", 5), ("delta_fla[gdn]", "o", 2)]
    a_log = rows[1]
    assert (a_log["max"], a_log["median"], a_log["bound"]) == (0.0176, 0.004, "DELTA_TOL_PER_HEAD_GRAD")
    assert a_log["p99"] == pytest.approx(0.009 + 0.96 * (0.0176 - 0.009))  # between the two largest
    assert rows[2]["median"] == pytest.approx(4.25e-3)
    table = format_table(rows)
    assert re.search(r"delta_fla\[kda\]\s+dfront\.A_log\s+DELTA_TOL_PER_HEAD_GRAD\s+1\.76e-02\s+1\.73e-02\s+4\.00e-03",
                     table), table
    assert re.search(r"DELTA_TOL_O\s+4\.50e-03\s+\(delta_fla\[gdn\] o\)", table), table
    out = tmp_path / "results" / "tol.json"
    write_json(out, {"seeds": 5}, rows)
    written = json.loads(out.read_text())
    assert written["rows"] == rows and written["header"] == {"seeds": 5}
    assert written["by_bound"] == {"DELTA_TOL_O": {"max": 4.5e-3, "comparison": "delta_fla[gdn]", "tensor": "o"},
                                   "DELTA_TOL_PER_HEAD_GRAD": {"max": 0.0176, "comparison": "delta_fla[kda]",
                                                               "tensor": "dfront.A_log"}}
    assert [p.name for p in out.parent.iterdir()] == ["tol.json"]


def test_instafail_prints_a_failure_when_it_happens(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'planted'\n\n\ndef test_passes():\n    pass\n")
    env = {**os.environ, "KDN_INSTAFAIL": "1", "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_probe.py")], env=env, capture_output=True, text=True,
                          timeout=timeout_s(120), cwd=tmp_path)
    first = proc.stdout.index("AssertionError: planted")
    assert first < proc.stdout.index("=== FAILURES ==="), proc.stdout  # before the summary, not only in it
    assert "FAILED test_probe.py::test_fails (call)" in proc.stdout, proc.stdout


def test_profile_step_rows_and_error_rows(tmp_path: Path) -> None:
    from bench.profile_step import main

    out = tmp_path / "p.json"
    main(["--size", "toy", "--mixers", "kdn_iso", "nope", "--seq-len", "32", "--batch", "2", "--steps", "1",
          "--rows", "3", "--vocab", "256", "--device", "cpu", "--out", str(out)])
    written = json.loads(out.read_text())
    rows, header = written["results"], written["header"]
    # the figure's provenance: the commit and the command beside the device and versions
    assert {"git_commit", "command", "date", "torch", "triton"} <= header.keys() and header["device"] == "cpu"
    assert header["command"].startswith("python -m bench.profile_step --size toy")
    assert rows[0]["mixer"] == "kdn_iso" and rows[0]["ms_step"] > 0 and len(rows[0]["top"]) == 3
    assert rows[0]["tokens_per_s"] == pytest.approx(64 / rows[0]["ms_step"] * 1e3)
    assert rows[1] == {"mixer": "nope", "error": rows[1]["error"]} and "unknown mixer 'nope'" in rows[1]["error"]
    main(["--size", "toy", "--mixers", "kda", "--seq-len", "32", "--batch", "2", "--steps", "1", "--vocab", "256",
          "--device", "cpu", "--ffn-width", "90", "--out", str(out)])
    assert json.loads(out.read_text())["results"][0]["ffn_widths"] == [90]


def test_mamba3_kernel_check_reports_each_case_on_its_own(tmp_path: Path) -> None:
    """A case that fails (here: no CUDA) is a row with its error; a malformed case is refused in one line."""
    from bench.mamba3_kernels import main, parse_case, where

    trace = ('Traceback (most recent call last):\n  File "/x/bench/a.py", line 3, in f\n    g()\n'
             '  File "/usr/lib/python3/site-packages/mamba_ssm/ops/k.py", line 9, in g\n'
             '  File "/usr/lib/python3/site-packages/triton/runtime/jit.py", line 7, in run\nRuntimeError: boom')
    assert where(trace) == "mamba_ssm/ops/k.py, line 9, in g" and where("no frames") is None

    assert parse_case("mimo:256:32:64:8x64") == {"kind": "mimo", "hidden": 256, "state": 32, "head_dim": 64,
                                                 "batch": 8, "seq_len": 64}
    for bad in ("mimo:256:32:64", "mamba:256:32:64:8x64", "siso:a:32:64:8x64"):
        with pytest.raises(ValueError, match="bad case"):
            parse_case(bad)
    if torch_has_cuda():
        pytest.skip("the error row needs a machine without CUDA")
    out = tmp_path / "m.json"
    main(["--cases", "siso:64:32:64:2x64", "--timeout", f"{timeout_s(120):.0f}", "--out", str(out)])
    written = json.loads(out.read_text())
    (row,) = written["rows"]
    assert {"torch", "mamba_ssm", "tilelang", "kdn"} <= set(written["header"]["versions"])
    assert row["kind"] == "siso" and row["seq_len"] == 64 and "CUDA" in row["error"] and "out_rel_err" not in row
    assert "bench/mamba3_kernels.py" in row["where"]  # the frame that raised, outside torch


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_profile_step_kernel_groups() -> None:
    from trainer.profiling import RECURRENCE, kernel_group

    assert kernel_group("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>") == "matmul"
    assert kernel_group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_group("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimiser"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == (
        "pytorch elementwise/copy/reduce")
    assert kernel_group("layer_norm_bwd_kernel_row") == "norms"
    assert kernel_group("causal_conv1d_fwd_kernel") == "short conv"
    assert kernel_group("chunk_kda_bwd_kernel_intra") == kernel_group("_diag_gain_bwd_kernel") == RECURRENCE
    assert kernel_group("void some_library_kernel<float>") == "other"
    for name in ("triton_tem_fused_flex_attention_backward_1", "triton_red_fused_flex_attention_backward_0",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128",
                 "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>",
                 "fmha_cutlassB_bf16_aligned_64x64_k128_sm80"):
        assert kernel_group(name) == "attention", name
    assert kernel_group("triton_poi_fused__to_copy_cat_mul_sub_0") == "inductor element-wise"
    from trainer.profiling import misaligned_gemm

    assert misaligned_gemm("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_nn_align2>")
    assert misaligned_gemm("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_256x128_64x3_nt_align2>")
    assert misaligned_gemm("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>")
    assert not misaligned_gemm("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_128x128_32x5_nn_align8>")
    assert not misaligned_gemm("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_tf32_256x128_16x3_nn_align4>")
    assert not misaligned_gemm("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN")


def test_profile_summary_counts_kernels_once() -> None:
    """A CUDA user annotation (the optimiser step's range) spans kernels counted on their own: the busy time, the
    groups and the top kernels leave it out."""
    from types import SimpleNamespace

    import torch

    from trainer.profiling import summarize

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key: str, device: torch.autograd.DeviceType, us: float, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us, self_cpu_time_total=1.0,
                               count=2, is_user_annotation=annotation)

    events = [event("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", cuda, 6000.0),
              event("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<adam>", cuda, 2000.0),
              event("Optimizer.step#AdamW.step", cuda, 2100.0, annotation=True),
              event("aten::mm", cpu, 6000.0)]
    out = summarize(SimpleNamespace(key_averages=lambda: events), wall_ms=20.0, steps=2, rows=5)
    assert out["device_busy_ms"] == 4.0 and out["device_busy_frac"] == 0.4
    assert out["groups_ms"] == {"matmul": 3.0, "optimiser": 1.0}
    assert [t["name"][:6] for t in out["top"]] == ["nvjet_", "void a"]


def test_warm_triton_passes_the_workload_its_own_options() -> None:
    from bench.warm_triton import split_workload

    own, module, rest = split_workload(["--workers", "3", "-m", "pytest", "-q", "-m", "gpu", "tests/x.py"])
    assert (own, module, rest) == (["--workers", "3"], "pytest", ["-q", "-m", "gpu", "tests/x.py"])
    with pytest.raises(SystemExit, match="-m MODULE"):
        split_workload(["--workers", "3"])


def _gpu_sh_env(tmp_path: Path, out: Path) -> dict[str, str]:
    """The environment of a bench/gpu.sh run on this machine: results under ``out``, no wheels, site archives or
    caches to restore or pack, the default stage limits scaled for a slow host."""
    return {**os.environ, "NO_AUTOTUNE_TGZ": "1", "WHEELS": str(tmp_path / "no_wheels"), "OUT": str(out),
            "SITES": str(tmp_path / "no_sites"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
            "TILELANG_CACHE_DIR": str(tmp_path / "tilelang"), "GPU_S": f"{timeout_s(560):.0f}",
            "STAGE_S": f"{timeout_s(240):.0f}"}


@pytest.mark.parametrize("carried", ["folder", "summary"])
def test_gpu_mqar_stage_resumes_from_carried_job_files(tmp_path: Path, carried: str) -> None:
    """`bench/gpu.sh mqar=ARGS` seeds MQAR_OUT with the jobs MQAR_JOBS names (a folder of job files, or a grid's job
    summary), resumes the grid there (here: nothing left to train) and returns every job file."""
    from eval.mqar import parse_overrides, run_grid
    from eval.mqar.jobs import pack

    args = ["mixers=attn", "widths=64", "settings=32x4", "test_settings=", "lrs=3e-3", "train_examples=64",
            "valid_examples=32", "test_examples=32", "batch_tokens=1024", "vocab_size=64", "preset=cpu"]
    cfg, _ = parse_overrides([*args, f"out={tmp_path / 'done'}"])
    assert len(run_grid(cfg, log=lambda _: None)[0]) == 1
    root, out = Path(__file__).resolve().parents[1], tmp_path / "out"
    carry = tmp_path / "done" / "jobs" if carried == "folder" else pack(tmp_path / "done")
    env = _gpu_sh_env(tmp_path, out) | {"MQAR_OUT": str(tmp_path / "mq"), "MQAR_JOBS": str(carry)}
    proc = subprocess.run(["bash", "bench/gpu.sh", "mqar=" + " ".join(args)], cwd=root, capture_output=True,
                          text=True, timeout=timeout_s(600), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (out / "gpu.log").read_text()
    assert "1 stored, 0 to run" in log and "=== mqar " in log and "exit 0" in log, log
    listing = subprocess.run(["tar", "tzf", str(out / "mqar_jobs.tgz")], capture_output=True, text=True).stdout
    assert "jobs/attn_d64_lr0.003_s0.json" in listing


def test_gpu_bench_stages_of_one_module_write_separate_files(tmp_path: Path) -> None:
    """Two `bench=MODULE` stages of one module keep both results: MODULE.json, then MODULE_2.json. The module is
    bench.mixer_throughput joining one sweep file each (``--merge``: no GPU, and no model stack to import): each
    result names the sweep it came from."""
    out = tmp_path / "out"
    sweeps = []
    for gpu in ("0", "1"):
        sweep = tmp_path / f"sweep{gpu}.json"
        row = {"mixer": "kdn_diag", "T": 2048, "ms_fwdbwd": 4.0, "ms_fwd": 1.0, "ms_kernel_fwdbwd": None,
               "ms_host_fwdbwd": 0.5, "tokens_per_s": 2048e3, "peak_mem_gb": 1.0}
        sweep.write_text(json.dumps({"header": {"device": "H200", "cuda_visible_devices": gpu}, "results": [row]}))
        sweeps.append(sweep)
    proc = subprocess.run(["bash", "bench/gpu.sh", *(f"bench=mixer_throughput --merge {s}" for s in sweeps)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s(300),
                          env=_gpu_sh_env(tmp_path, out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    gpus = [json.loads((out / name).read_text())["header"]["cuda_visible_devices"]
            for name in ("mixer_throughput.json", "mixer_throughput_2.json")]
    assert gpus == ["0", "1"]


def test_tilelang_kernels_are_packed_without_their_scratch(tmp_path: Path) -> None:
    """``pack_tilelang`` writes nothing for an empty cache, and otherwise every compiled kernel but the scratch."""
    root, cache = Path(__file__).resolve().parents[1], tmp_path / "tl"
    (cache / "tmp").mkdir(parents=True)
    script = f'. bench/gpu_env.sh && pack_tilelang {tmp_path}/empty.tgz && mkdir -p {cache}/k1 && ' \
             f'echo so > {cache}/k1/kernel.so && echo x > {cache}/tmp/scratch && pack_tilelang {tmp_path}/full.tgz'
    proc = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, timeout=timeout_s(60),
                          env={**os.environ, "TILELANG_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "empty.tgz").exists()
    listing = subprocess.run(["tar", "tzf", str(tmp_path / "full.tgz")], capture_output=True, text=True).stdout
    assert "./k1/kernel.so" in listing and "scratch" not in listing


def test_tilelang_dispatch_refuses_a_machine_without_cuda() -> None:
    import torch

    from bench import tilelang_dispatch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tilelang_dispatch.main(["--calls", "1"])


def test_gpu_kernels_stage_selects_every_gpu_test_without_an_expression(tmp_path: Path) -> None:
    """`bench/gpu.sh kernels` runs every gpu-marked test of KDN_TESTS, one whose name ends in "nothing" too (no
    stand-in -k expression)."""
    tests = tmp_path / "test_pick.py"
    tests.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_captures_nothing():\n    pass\n\n\n"
                     "@pytest.mark.gpu\ndef test_other():\n    pass\n\n\ndef test_cpu():\n    pass\n")
    root, out = Path(__file__).resolve().parents[1], tmp_path / "out"
    env = {**os.environ, "NO_AUTOTUNE_TGZ": "1", "WHEELS": str(tmp_path / "no_wheels"), "OUT": str(out),
           "SITES": str(tmp_path / "no_sites"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "TILELANG_CACHE_DIR": str(tmp_path / "tilelang"), "KDN_TESTS": str(tests), "KDN_PYTEST_ARGS": "",
           "GPU_S": f"{timeout_s(200):.0f}", "STAGE_S": f"{timeout_s(120):.0f}"}
    proc = subprocess.run(["bash", "bench/gpu.sh", "kernels"], cwd=root, capture_output=True, text=True,
                          timeout=timeout_s(240), env=env)
    log = (out / "gpu.log").read_text()
    assert proc.returncode == 0 and "2 passed, 1 deselected" in log, log[-2000:] + proc.stderr[-2000:]


def test_provenance_names_the_command_commit_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.provenance: what each GPU figure records (bench.gpu_tolerances, bench.ncu_kernels)."""
    import torch
    import triton

    from bench import provenance

    monkeypatch.setenv("KDN_GIT_COMMIT", "abc1234")
    head = provenance("bench.ncu_kernels", ["--T", "8192"])
    assert head["command"] == "python -m bench.ncu_kernels --T 8192"
    assert head["git_commit"] == "abc1234"
    assert (head["torch"], head["triton"]) == (torch.__version__, triton.__version__)
    assert head["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert head["date"].endswith("+00:00") and "fla" in head
