"""Model-level tests on the CPU at toy size: every mixer x pattern trains, is causal, decodes from its
cache exactly, handles left padding and packed documents, saves and loads, generates; configs
validate (parameter matching at 750M and 1.3B: tests/test_sizes.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import models
from models import MIXERS, KDNConfig, build_model, count_flops_per_token, model_config
from models.sizes import TOLERANCE, build_on_meta, parameter_counts, recurrent_state_size

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

V = 256
PATTERNS = ("recurrent", "hybrid_swa")
ALL = [(m, p) for m in MIXERS for p in PATTERNS]


def _model(mixer: str, pattern: str, dtype: torch.dtype = torch.float64, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config("toy", mixer, pattern, vocab_size=V, **overrides)).to(dtype).eval()


def _tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("mixer", "pattern"), ALL)
def test_trains_on_cpu(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern, torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = _tokens(2, 24)
    losses = []
    for step in range(5):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in model.named_parameters()}
            assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
            silent = {n for n, g in grads.items() if g.abs().max() == 0}
            # only the first factor of KDN's zero-initialised low-rank noise projection starts without gradient
            assert silent <= {n for n in grads if n.endswith("omega_proj.0.weight")}, silent
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("pattern", PATTERNS)
def test_blocks_compute_the_textbook_prenorm_residual(pattern: str) -> None:
    """The blocks carry the residual stream apart from the sublayer outputs (the add fused into the next norm);
    the hidden states must equal the textbook ``h = h + mixer(norm(h)); h = h + mlp(norm(h))`` bit for bit."""
    model = _model("kdn_diag", pattern, torch.float32)
    x = _tokens(2, 20)
    h = model.model.embeddings(x)
    with torch.no_grad():
        for block in model.model.layers:
            h = h + block.mixer(block.mixer_norm(h))[0]
            h = h + block.mlp(block.mlp_norm(h))
        ref = model.model.norm(h)
        out = model.model(x)[0]
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_bf16_parameters_train_without_autocast(mixer: str) -> None:
    """Under FSDP2 the parameters are bf16 and accelerate applies no autocast: the stream stays FP32, every linear
    (the LM head included) reads bf16, the loss is FP32 and every parameter gets a finite gradient."""
    model = _model(mixer, "hybrid_swa", torch.bfloat16).train()
    x = _tokens(2, 24)
    for fused in (True, False):  # the LM head's chunked cross-entropy, then plain logits
        model.config.fuse_cross_entropy = fused
        model.zero_grad()
        out = model(x, labels=x)
        out.loss.backward()
        assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
        assert out.logits is None if fused else out.logits.dtype == torch.bfloat16
        assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())


def test_add_norm_keeps_the_stream_in_fp32() -> None:
    """``add_norm`` returns the norm in the sublayer output's dtype and the stream in at least FP32."""
    norm = models.layers.common.RMSNorm(8)
    o = torch.randn(3, 8).to(torch.bfloat16)
    stream = torch.randn(3, 8)
    y, res = norm.add_norm(o, stream)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32
    torch.testing.assert_close(res, stream + o.float())
    torch.testing.assert_close(y, norm(res).to(torch.bfloat16))
    y0, res0 = norm.add_norm(o, None)
    assert res0.dtype == torch.float32 and torch.equal(res0, o.float())


@pytest.mark.parametrize(("mixer", "pattern"), ALL)
def test_causal(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    x = _tokens(2, 24)
    x2 = x.clone()
    x2[:, 13] = (x2[:, 13] + 7) % V
    with torch.no_grad():
        a, b = model(x).logits, model(x2).logits
    assert torch.equal(a[:, :13], b[:, :13])
    assert (a[:, 13:] - b[:, 13:]).abs().amax() > 1e-6


@pytest.mark.parametrize(("mixer", "pattern"), ALL)
def test_prefill_then_cached_decode_equals_full_forward(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    x = _tokens(2, 30)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :19], use_cache=True)
        steps = [out.logits]
        for t in range(19, 30):
            out = model(x[:, t:t + 1], past_key_values=out.recurrent_cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("mixer", "pattern"), ALL)
def test_left_padded_batch_equals_per_sample(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    seqs = [_tokens(1, 26, seed=2)[0], _tokens(1, 17, seed=3)[0]]
    ids = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 26 - len(s):], mask[i, 26 - len(s):] = s, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            torch.testing.assert_close(batched[i, 26 - len(s):], model(s[None]).logits[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("mixer", "pattern"), ALL)
def test_packed_documents_equal_separate_runs(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    x = _tokens(1, 31)
    cu = torch.tensor([0, 9, 10, 31])
    with torch.no_grad():
        packed = model(x, cu_seqlens=cu).logits
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            torch.testing.assert_close(packed[:, a:b], model(x[:, a:b]).logits, rtol=1e-9, atol=1e-9)


def test_loss_is_shifted_and_skips_document_boundaries_and_padding() -> None:
    model = _model("kda", "recurrent")
    x = _tokens(1, 20)
    cu = torch.tensor([0, 8, 20])
    with torch.no_grad():
        out = model(x, labels=x, cu_seqlens=cu)
        logits = out.logits[0]
    targets = [(t, x[0, t + 1]) for t in range(19) if t != 7]  # position 7 would predict the next document
    manual = torch.stack([F.cross_entropy(logits[t], y) for t, y in targets]).mean()
    torch.testing.assert_close(out.loss, manual)
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        out = model(x, labels=x, attention_mask=mask)
    manual = torch.stack([F.cross_entropy(out.logits[0, t], x[0, t + 1]) for t in range(5, 19)]).mean()
    torch.testing.assert_close(out.loss, manual)
    labels = x.clone()
    labels[0, 10:] = -100
    with torch.no_grad():
        out = model(x, labels=labels)
    manual = torch.stack([F.cross_entropy(out.logits[0, t], x[0, t + 1]) for t in range(9)]).mean()
    torch.testing.assert_close(out.loss, manual)


@pytest.mark.parametrize(("mixer", "pattern"), [("kdn_diag", "hybrid_swa"), ("mamba3_mimo", "recurrent"),
                                                ("attn", "recurrent"), ("gdn2", "RRS")])
def test_save_load_round_trip(tmp_path: object, mixer: str, pattern: str) -> None:
    overrides = {"num_layers": 3} if pattern == "RRS" else {}
    model = _model(mixer, pattern, torch.float32, **overrides)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, KDNConfig) and config.mixer == mixer and config.pattern == pattern
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, models.KDNForCausalLM)
    x = _tokens(2, 12)
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_tied_embeddings_save_and_load(tmp_path: object) -> None:
    model = _model("kda", "recurrent", torch.float32, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embeddings.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embeddings.weight
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_generate_left_padded_batch_equals_per_sample(mixer: str) -> None:
    model = _model(mixer, "hybrid_swa", torch.float32)
    a, b = _tokens(1, 9, seed=4)[0], _tokens(1, 5, seed=5)[0]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 4:], mask[1, 4:] = b, 1
    kw = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    batched = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(batched[0, 9:], model.generate(a[None], **kw)[0, 9:])
    assert torch.equal(batched[1, 9:], model.generate(b[None], **kw)[0, 5:])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_decoding_memory_is_constant_or_window_bounded(pattern: str) -> None:
    model = _model("kdn_iso", pattern, torch.float32)  # toy window: 16 tokens
    x = _tokens(1, 40)
    with torch.no_grad():
        out = model(x[:, :12], use_cache=True)
        sizes = []
        for t in range(12, 40):
            out = model(x[:, t:t + 1], past_key_values=out.recurrent_cache, use_cache=True)
            sizes.append(out.cache.num_elements())
    assert len(set(sizes[4:])) == 1  # once the window is full, nothing grows
    if pattern == "recurrent":
        assert len(set(sizes)) == 1
    else:
        assert all(layer["k"].shape[2] == 15 for layer in out.cache.layers.values() if "k" in layer)


def test_full_attention_cache_grows() -> None:
    model = _model("attn", "recurrent", torch.float32, window=None)
    with torch.no_grad():
        out = model(_tokens(1, 30), use_cache=True)
    assert out.cache.get(0)["k"].shape[2] == 30
    assert recurrent_state_size(model.config) is None


def test_beta_eff_output() -> None:
    for mixer, expect in (("kdn_diag", True), ("kda", True), ("gdn2", True), ("mamba3_siso", False), ("attn", False)):
        model = _model(mixer, "recurrent", torch.float32)
        with torch.no_grad():
            out = model(_tokens(2, 10), output_beta_eff=True)
        assert len(out.beta_eff) == 2
        for beta in out.beta_eff:
            if expect:
                assert beta.shape == (2, 10, 2) and (beta >= 0).all() and (beta < 1).all()
            else:
                assert beta is None


def test_no_weight_decay_flags() -> None:
    model = _model("kdn_diag", "hybrid_swa")
    flagged = {n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert {"model.layers.0.mixer.front.A_log", "model.layers.0.mixer.front.dt_bias",
            "model.layers.0.mixer.prior_theta"} <= flagged
    flagged = {n for n, p in _model("mamba3_mimo", "recurrent").named_parameters()
               if getattr(p, "_no_weight_decay", False)}
    assert {"model.layers.0.mixer.dt_bias", "model.layers.0.mixer.D"} <= flagged


def test_kdn_noise_projection_keeps_zero_init() -> None:
    model = _model("kdn_diag", "recurrent")
    last = model.model.layers[0].mixer.omega_proj[-1]
    assert last.weight.abs().max() == 0 and last.bias.abs().max() == 0
    assert model.model.layers[0].mixer.front.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


# --- configuration ----------------------------------------------------------------------------------


def test_bad_configs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown mixer 'mamba4'.*kdn_diag"):
        KDNConfig(mixer="mamba4")
    with pytest.raises(ValueError, match="unknown mixer"):
        model_config("toy", "mamba4")
    with pytest.raises(ValueError, match="num_heads \\* head_dim == hidden_size"):
        KDNConfig(hidden_size=64, num_heads=3, head_dim=16, mixer="attn")
    with pytest.raises(ValueError, match="num_heads \\* head_dim == hidden_size"):
        KDNConfig(hidden_size=64, num_heads=3, head_dim=16, mixer="kda", pattern="hybrid_swa", num_layers=2)
    KDNConfig(hidden_size=64, num_heads=3, head_dim=16, mixer="kda", num_layers=2)  # no attention: allowed
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="window"):
            KDNConfig(window=bad)
    with pytest.raises(ValueError, match="window"):
        KDNConfig(mixer="attn", mixer_kwargs={"window": 0})  # a config written when attention kept its own window
    with pytest.raises(ValueError, match="has sliding-window layers: set window"):
        KDNConfig(pattern="hybrid_swa", num_layers=2, hidden_size=64, num_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="unknown layer codes"):
        KDNConfig(pattern="RX")
    with pytest.raises(ValueError, match="does not divide"):
        KDNConfig(pattern="RRS", num_layers=16)
    with pytest.raises(ValueError, match="does not take"):
        KDNConfig(mixer="kda", mixer_kwargs={"mu": "dk"})
    with pytest.raises(ValueError, match="unknown size"):
        model_config("7b", "kda")
    with pytest.raises(ValueError, match="positive int"):
        KDNConfig(num_layers=0)


def test_layer_patterns() -> None:
    assert models.layer_pattern("recurrent", 4) == "RRRR"
    assert models.layer_pattern("hybrid_swa", 18) == "RS" * 9
    assert models.layer_pattern("RRRS", 8) == "RRRSRRRS"
    cfg = model_config("1.3b", "kdn_diag", "hybrid_swa")
    assert [cfg.layer_mixer(i)[0] for i in range(18)].count("attn") == 9
    assert cfg.layer_mixer(1) == ("attn", {}) and (cfg.layer_window(0), cfg.layer_window(1)) == (2048, 2048)
    assert model_config("toy", "kda", "RA").layer_window(1) is None  # full attention


def test_unknown_mixer_lookup_lists_known_names() -> None:
    with pytest.raises(ValueError, match="known mixers: attn, deltanet"):
        MIXERS["mamba4"]
    assert set(MIXERS) == {"kdn_diag", "kdn_iso", "deltanet", "gdn", "kda", "gdn2", "mamba3_siso", "mamba3_mimo",
                           "attn"}


# --- sizes ------------------------------------------------------------------------------------------


def test_paper_backbones() -> None:
    for size, (layers, d, heads) in {"750m": (16, 2048, 16), "1.3b": (18, 2304, 18)}.items():
        cfg = model_config(size, "kdn_diag")
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (
            layers, d, heads, 128, 32000)
        assert cfg.window == 2048
    assert model_config("toy", "kda", vocab_size=1000).vocab_size == 1000


def test_per_layer_ffn_widths_build_save_and_load(tmp_path) -> None:
    cfg = model_config("toy", "kdn_diag", intermediate_size=[96, 160])
    model = build_model(cfg)
    assert [b.mlp.up_proj.out_features for b in model.model.layers] == [96, 160]
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.config.intermediate_size == [96, 160]
    assert [b.mlp.down_proj.in_features for b in loaded.model.layers] == [96, 160]
    with pytest.raises(ValueError, match="intermediate_size lists 3 widths for 2 layers"):
        model_config("toy", "kda", intermediate_size=[64, 64, 64])
    with pytest.raises(ValueError, match="intermediate_size must be a positive int or a list"):
        model_config("toy", "kda", intermediate_size=[64, 0])


def test_meta_build_allocates_nothing() -> None:
    model = build_on_meta(model_config("1.3b", "kdn_diag"))
    assert all(p.is_meta for p in model.parameters())


def test_size_table_prints_every_mixer(capsys: pytest.CaptureFixture[str]) -> None:
    from models.size_table import main

    main(["--sizes", "100m", "--pattern", "hybrid_swa"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("max block-stack parameter deviation: ")
    assert float(lines[-1].split(": ")[1].rstrip("%")) <= 100 * TOLERANCE
    assert lines[0].startswith("target 100m: ") and "KDA" in lines[0]
    assert sorted(line.split()[1] for line in lines[3:-1]) == sorted(MIXERS)


def test_flops_per_token() -> None:
    kda = model_config("750m", "kda")
    n_matmul = parameter_counts(kda)[0] - kda.vocab_size * kda.hidden_size  # the embedding lookup is free
    f = count_flops_per_token(kda, 4096)
    assert 6 * n_matmul < f < 6.5 * n_matmul
    assert count_flops_per_token(kda, 8192) == f  # recurrent: independent of context
    full = model_config("750m", "attn", mixer_kwargs={"window": None})
    assert count_flops_per_token(full, 8192) > count_flops_per_token(full, 4096)
    swa = model_config("750m", "attn")  # 2K window: attention cost saturates
    assert count_flops_per_token(swa, 16384) - count_flops_per_token(swa, 8192) < 0.02 * f
    assert count_flops_per_token(full, 16384) - count_flops_per_token(full, 8192) > 0.2 * f


def test_compiled_model_matches_eager() -> None:
    """``trainer.compile`` wraps the model in ``torch.compile``: the traced graph (breaks at the kernels and the LM
    head's chunked loss) gives the eager loss and gradients (``aot_eager``: no C++ toolchain on the CPU)."""
    torch.manual_seed(0)
    model = build_model(model_config("toy", "kdn_diag", "recurrent", vocab_size=V)).train()
    ids = _tokens(2, 16)
    grads = []
    for m in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=0)
    for a, b in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
