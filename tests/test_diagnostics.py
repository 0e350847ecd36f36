"""eval.diagnostics: the float64 filter loop against kdn's recurrences, beta_eff and NIS of tiny CPU models, the mu
intervention and the written figures and tables."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from eval_fixtures import verse_shards

import kdn
import models
from data import PrepareConfig, load_tokenizer
from eval import diagnostics as dg


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_terms(kind: str, B: int = 2, T: int = 24, H: int = 3, K: int = 8, V: int = 5) -> dg.FilterTerms:
    gen = torch.Generator().manual_seed(1)
    f64 = torch.float64

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64)

    k = F.normalize(rnd(B, T, H, K), dim=-1)
    g = -0.3 * torch.rand(B, T, H, K, generator=gen, dtype=f64)
    v = rnd(B, T, H, V)
    if kind == "delta":
        return dg.FilterTerms("delta", k, v, g, beta=torch.sigmoid(rnd(B, T, H)))
    omega = 0.05 + 0.2 * torch.rand(*((B, T, H) if kind == "iso" else (B, T, H, K)), generator=gen, dtype=f64)
    r = 0.01 + torch.rand(B, T, H, generator=gen, dtype=f64)
    p0 = 0.5 + torch.rand(*((B, H) if kind == "iso" else (B, H, K)), generator=gen, dtype=f64)
    return dg.FilterTerms(kind, k, v, g, omega, r, p0, mu=torch.tensor([1.0, 8.0, 32.0], dtype=f64))


@pytest.mark.parametrize("kind", ["diag", "iso"])
def test_filter_loop_reproduces_kdn_memory_and_gain(kind: str) -> None:
    t = random_terms(kind)
    tr = dg.filter_trace(t)
    q = torch.randn_like(t.k)
    fn = kdn.diagonal_kdn if kind == "diag" else kdn.isotropic_kdn
    _, (S, p) = fn(q, t.k, t.v, t.g, t.omega, t.r, mu=t.mu, initial_state=(None, t.p0), output_final_state=True,
                   backend="torch")
    assert rel(tr["S"], S) < 1e-10 and rel(tr["unc"][:, -1], p) < 1e-10
    gain = kdn.diagonal_kdn_gain if kind == "diag" else kdn.isotropic_kdn_gain
    kappa, _ = gain(t.k, t.g, t.omega, t.r, mu=t.mu, initial_state=t.p0)
    beta = (kappa * t.k).sum(-1) if kind == "diag" else kappa * (t.k * t.k).sum(-1)
    assert rel(tr["beta_eff"], beta) < 1e-10
    assert bool((tr["nis"] > 0).all()) and bool(torch.isfinite(tr["nis"]).all())


def test_filter_loop_nis_by_hand_for_one_token() -> None:
    t = random_terms("diag", B=1, T=1, H=1, K=4, V=3)
    p_hat = torch.exp(t.g[0, 0, 0]) ** 2 * t.p0[0, 0] + t.omega[0, 0, 0]
    k = t.k[0, 0, 0]
    z = float((p_hat * k * k).sum())
    nis = float((t.v[0, 0, 0] ** 2).sum()) / (3 * (z + float(t.r[0, 0, 0])))  # S_0 = 0: delta = v
    out = dg.filter_trace(t)
    assert out["nis"].item() == pytest.approx(nis, rel=1e-12)
    assert out["z"].item() == pytest.approx(z, rel=1e-12)


def test_fixed_gain_rule_takes_unit_observation_noise() -> None:
    t = random_terms("delta")
    tr = dg.filter_trace(t)
    bk = t.beta * (t.k * t.k).sum(-1)
    assert rel(tr["beta_eff"], bk) < 1e-12
    assert rel(tr["z"] / (tr["z"] + 1), bk) < 1e-10  # the implied gain z / (r + z) with r = 1
    assert bool((tr["nis"] > 0).all()) and bool(torch.isfinite(tr["nis"]).all())


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("probe")
    return verse_shards(tmp, 80)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    tok = load_tokenizer("mistral-v1")
    out = {}
    for i, (mixer, kw) in enumerate((("kdn_diag", {"mu": "1"}), ("kdn_iso", {}), ("kda", {}))):
        torch.manual_seed(i)
        model = models.build_model(models.model_config("toy", mixer, vocab_size=32000, mixer_kwargs=kw))
        with torch.no_grad():  # trained-looking noise heads: non-zero process noise projections
            for m in model.modules():
                if isinstance(m, (kdn.DiagonalKDN, kdn.IsotropicKDN)):
                    last = m.omega_proj if isinstance(m, kdn.IsotropicKDN) else m.omega_proj[-1]
                    last.weight.normal_(0, 0.05)
        model.save_pretrained(root / mixer / "hf")
        tok.save_pretrained(root / mixer / "hf")
        out[mixer] = root / mixer
    return out


def test_beta_eff_and_nis_of_tiny_models(run_dirs: dict[str, Path], shards: Path) -> None:
    from eval.harness import load_model

    for mixer, path in run_dirs.items():
        model, _ = load_model(dg.resolve_model(path), device="cpu")
        ids = dg.probe_ids(shards, 2, 32, torch.device("cpu"))
        with torch.no_grad():
            ref = model(input_ids=ids, output_beta_eff=True).beta_eff
        stats = dg.filter_stats(model, ids)
        assert sorted(stats) == [0, 1]
        for i, s in stats.items():
            assert s["kind"] == {"kdn_diag": "diag", "kdn_iso": "iso", "kda": "delta"}[mixer]
            beta = s["beta_eff"]
            assert float(beta.min()) >= 0.0 and float(beta.max()) < 1.0
            # the loop's gain is the layer's own (every token kept: 2 x 32 < the subsample size)
            mine = torch.sort(beta.flatten()).values
            theirs = torch.sort(ref[i].transpose(0, 2).reshape(beta.shape[0], -1).flatten().float()).values
            assert rel(mine, theirs) < 1e-5
            assert bool(torch.isfinite(s["nis"]).all()) and float(s["nis"].min()) > 0.0
            if mixer != "kda":
                assert float(s["unc"].min()) > 0.0 and float(s["r"].min()) >= 0.01 and float(s["omega"].min()) > 0.0


def test_mu_intervention_changes_only_mu_and_restores_it(run_dirs: dict[str, Path], shards: Path) -> None:
    from eval.harness import load_model

    model, _ = load_model(dg.resolve_model(run_dirs["kdn_diag"]), device="cpu")
    sweep = dg.mu_intervention(model, shards, 2, 32)
    assert list(sweep) == list(dg.MU_SWEEP) and all(0.0 <= v < 1.0 for v in sweep.values())
    assert sweep["1"] > sweep["dk"] > sweep["4dk"]  # more information per write: smaller later gains
    assert all(m.mu_choice == "1" for _, m in dg.mixers(model))
    kda, _ = load_model(dg.resolve_model(run_dirs["kda"]), device="cpu")
    with pytest.raises(ValueError, match="needs a KDN model"):
        dg.mu_intervention(kda, shards, 2, 32)


def test_cli_writes_figures_and_tables(run_dirs: dict[str, Path], shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "diag"
    assert dg.main([str(run_dirs["kdn_diag"]), str(run_dirs["kda"]), "--shards", str(shards), "--n-seqs", "2",
                    "--seq-len", "32", "--filter-seqs", "1", "--out", str(out), "--paper", "--at-init",
                    "--device", "cpu"]) == 0
    for name in ("beta_eff.png", "beta_eff.pdf", "filter_kdn_diag.png", "filter_kda.png"):
        assert (out / name).stat().st_size > 1000, name
    means = (out / "beta_eff.md").read_text()
    assert "kda (kda)" in means and "0.675" in means  # the paper's KDA mean beside ours
    assert "kda (kda), at initialisation" in means
    assert "| 1 |" in (out / "mu_intervention.md").read_text() and "0.857" in (out / "mu_intervention.md").read_text()
    report = json.loads((out / "diagnostics.json").read_text())
    assert report["mu_intervention"]["model"].startswith("kdn_diag")
    nis = report["models"]["kda (kda)"]["filter"]["0"]["nis"]
    assert len(nis) == 2 and all(math.isfinite(h["mean"]) and h["mean"] > 0 for h in nis)
    with pytest.raises(SystemExit):
        dg.main([str(run_dirs["kda"]), "--filter-seqs", "9", "--n-seqs", "2"])
    with pytest.raises(ValueError, match="neither a run directory"):
        dg.resolve_model(tmp_path)


def test_cli_writes_into_the_run_directory_by_default(run_dirs: dict[str, Path], shards: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert dg.main([str(run_dirs["kda"] / "hf"), "--shards", str(shards), "--n-seqs", "2", "--seq-len", "32",
                    "--filter-seqs", "1", "--device", "cpu"]) == 0
    out = run_dirs["kda"] / "diagnostics"
    assert (out / "beta_eff.md").is_file() and (out / "diagnostics.json").is_file()
    assert not (tmp_path / "diagnostics").exists()
    captured = capsys.readouterr()
    assert f"diagnostics: writing into {out}/" in captured.err and f"wrote {out}/" in captured.out
    # off a terminal: one line per step, numbered, with the elapsed time
    steps = [ln for ln in captured.err.splitlines() if ln.startswith("diagnostics [")]
    assert [ln.split("]")[0] for ln in steps] == ["diagnostics [0/5", "diagnostics [1/5", "diagnostics [2/5",
                                                   "diagnostics [3/5"]
    assert "float64 filter loop, 1 x 32 tokens per layer" in steps[2] and steps[3].endswith(" s)")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_within_a_long_step_and_a_bar_on_a_terminal(run_dirs: dict[str, Path], shards: Path,
                                                                    tmp_path: Path) -> None:
    lines = io.StringIO()
    dg.run([str(run_dirs["kdn_diag"])], tmp_path / "a", shards=str(shards), n_seqs=2, seq_len=128, filter_seqs=1,
           device="cpu", stream=lines, progress_every_s=0.0)
    text = lines.getvalue()
    assert "float64 filter loop, 1 x 128 tokens per layer: layer 1/2, token 64/128" in text
    assert "layer 2/2, token 128/128" in text
    assert "mu intervention on kdn_diag (kdn_diag mu=1): mu=4dk" in text
    bar = _Terminal()
    dg.run([str(run_dirs["kda"])], tmp_path / "b", shards=str(shards), n_seqs=2, seq_len=32, filter_seqs=1,
           device="cpu", stream=bar)
    assert "diagnostics: 5.0/5 steps |" in bar.getvalue() and "diagnostics [" not in bar.getvalue()


def test_preparing_the_default_probe_shards_is_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import data

    asked: list[PrepareConfig] = []
    monkeypatch.setattr(data, "prepare", lambda cfg: asked.append(cfg))
    said = io.StringIO()
    where = tmp_path / "probe"
    assert dg.probe_shards(None, said, where) == where
    assert said.getvalue() == (f"diagnostics: preparing the probe shards (the embedded corpus, 10% held out) in "
                               f"{where}; done once, later runs reuse them (or pass --shards DIR)\n")
    assert [(c.source, c.val_fraction, c.out_dir, c.progress) for c in asked] == [("embedded", 0.1, str(where),
                                                                                    False)]
    (where / "meta.json").parent.mkdir()
    (where / "meta.json").write_text("{}")
    quiet = io.StringIO()
    assert dg.probe_shards(None, quiet, where) == where and quiet.getvalue() == "" and len(asked) == 1


def test_shards_of_another_tokenizer_are_refused(shards: Path, tmp_path: Path) -> None:
    model = models.build_model(models.model_config("toy", "kda", vocab_size=100))
    model.save_pretrained(tmp_path / "small_vocab" / "hf")
    load_tokenizer("mistral-v1").save_pretrained(tmp_path / "small_vocab" / "hf")
    with pytest.raises(ValueError, match="vocabulary of 100; pass --shards prepared with the model's tokenizer"):
        dg.run([str(tmp_path / "small_vocab")], tmp_path / "out", shards=str(shards), n_seqs=2, seq_len=32,
               device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_loop_matches_the_cuda_layers(dtype: torch.dtype) -> None:
    ids = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(0)).cuda()
    for mixer in ("kdn_diag", "kdn_iso", "kda"):
        torch.manual_seed(0)
        model = models.build_model(models.model_config("toy", mixer, vocab_size=1000)).cuda().to(dtype).eval()
        with torch.no_grad():
            ref = model(input_ids=ids, output_beta_eff=True).beta_eff
        stats = dg.filter_stats(model, ids)
        assert sorted(stats) == [0, 1]
        for i, s in stats.items():
            mine = torch.sort(s["beta_eff"].flatten()).values
            theirs = torch.sort(ref[i].float().cpu().transpose(0, 2).flatten()).values
            assert rel(mine, theirs) < (1e-4 if dtype == torch.float32 else 2e-2), (mixer, i)
            assert bool(torch.isfinite(s["nis"]).all()) and float(s["nis"].min()) > 0.0
