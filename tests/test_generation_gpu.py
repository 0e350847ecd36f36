"""models.generation on CUDA: the captured step gives the greedy tokens of the same step run eagerly (256 tokens,
every mixer, left-padded rows in an idle-row bucket); batch-size buckets reuse their graphs and a second call captures
nothing new; ``model.generate`` routes to the static path and agrees with HF's loop; the in-place fused KDN step
equals the copying one."""
from __future__ import annotations

import pytest
import torch

import models
from kdn.ops import fused_recurrent
from models.generation import decoders, generate

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
V = 512
CASES = [("kdn_diag", "recurrent"), ("kdn_diag", "hybrid_swa"), ("kdn_iso", "hybrid_swa"), ("kda", "hybrid_swa"),
         ("gdn", "recurrent"), ("deltanet", "recurrent"), ("gdn2", "recurrent"), ("mamba3_siso", "recurrent"),
         ("mamba3_mimo", "recurrent"), ("attn", "recurrent"), ("kdn_diag", "RSA")]


def _model(mixer: str, pattern: str, dtype: torch.dtype = torch.bfloat16, size: str = "small") -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"num_layers": len(pattern)} if pattern not in ("recurrent", "hybrid_swa") else {}
    cfg = models.model_config(size, mixer, pattern, vocab_size=V, intermediate_size=512, **kw)
    return models.build_model(cfg).to(CUDA, dtype).eval()


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long, device=CUDA)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = torch.randint(3, V, (n,), device=CUDA, generator=g)
        mask[i, T - n:] = 1
    return ids, mask


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    return "equal" if not len(diff) else f"first difference at row {int(diff[0, 0])}, position {int(diff[0, 1])}"


@pytest.mark.parametrize(("mixer", "pattern"), CASES)
def test_captured_graph_gives_the_eager_greedy_tokens(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    ids, mask = _prompts((40, 23, 7))  # bucket 4: one idle row; 40 + 256 tokens pass the small window (256)
    eager = generate(model, ids, 256, attention_mask=mask, cuda_graph=False, output_scores=True)
    graph = generate(model, ids, 256, attention_mask=mask, cuda_graph=True, output_scores=True)
    assert decoders(model).captures == 1
    assert torch.equal(graph.sequences, eager.sequences), _first_difference(graph.sequences, eager.sequences)
    err = ((graph.scores - eager.scores).norm() / eager.scores.norm()).item()
    assert err < 1e-6, err
    assert torch.isfinite(graph.scores).all()


def test_buckets_reuse_their_graphs_and_a_second_call_captures_nothing() -> None:
    model = _model("kdn_diag", "hybrid_swa")
    pool = decoders(model)
    ids, mask = _prompts((30, 12, 9))
    first = generate(model, ids, 32, attention_mask=mask)
    assert pool.captures == 1 and len(pool.decoders) == 1
    again = generate(model, ids, 32, attention_mask=mask)
    assert pool.captures == 1 and torch.equal(first.sequences, again.sequences)
    four, mask4 = _prompts((20, 20, 5, 11), seed=1)  # the same bucket (4)
    generate(model, four, 32, attention_mask=mask4)
    assert pool.captures == 1
    one = generate(model, ids[:1], 32)  # bucket 1: a new graph, then reused
    assert pool.captures == 2
    generate(model, ids[:1], 16)
    assert pool.captures == 2
    assert torch.equal(one.sequences[0, 30:], first.sequences[0, 30:])  # rows do not depend on the batch
    with pytest.raises(ValueError, match="largest batch bucket"):
        generate(model, four, 8, attention_mask=mask4, batch_buckets=(1, 2))


@pytest.mark.parametrize("mixer", ["kdn_diag", "kda", "attn"])
def test_model_generate_routes_to_the_static_path(mixer: str) -> None:
    """FP32 weights: HF's loop (``static_decode=False``) and the static path agree on the logits of 24 new tokens."""
    model = _model(mixer, "hybrid_swa", torch.float32)
    ids, mask = _prompts((33, 17))
    kw = {"attention_mask": mask, "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, "eos_token_id": None,
          "return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        hf = model.generate(ids, static_decode=False, **kw)
        ours = model.generate(ids, **kw)
    assert decoders(model).captures == 1
    a, b = torch.stack(ours.scores, 1), torch.stack(hf.scores, 1)
    n = int((ours.sequences == hf.sequences).all(0).long().cumprod(0).sum()) - ids.shape[1]  # tokens before any split
    assert n >= 8, _first_difference(ours.sequences, hf.sequences)
    err = ((a[:, :n] - b[:, :n]).norm() / b[:, :n].norm()).item()
    assert err < 1e-3, err


def test_model_generate_under_autocast_matches_eager_static_steps() -> None:
    """FP32 weights under bf16 autocast (as the evaluation suites run): the captured step equals the eager one."""
    model = _model("kdn_diag", "hybrid_swa", torch.float32)
    ids, mask = _prompts((25, 9))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        graph = generate(model, ids, 64, attention_mask=mask)
        eager = generate(model, ids, 64, attention_mask=mask, cuda_graph=False)
        routed = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
    assert torch.equal(graph.sequences, eager.sequences), _first_difference(graph.sequences, eager.sequences)
    assert torch.equal(routed, graph.sequences)


@pytest.mark.parametrize("isotropic", [False, True])
def test_inplace_fused_step_equals_the_copying_step(isotropic: bool) -> None:
    B, H, K = 3, 4, 64
    g = torch.Generator(device=CUDA).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=CUDA, generator=g)

    q, k = (torch.nn.functional.normalize(rand(B, 1, H, K) - 0.5, dim=-1) for _ in range(2))
    v, gate = rand(B, 1, H, K) - 0.5, -rand(B, 1, H, K)
    omega = rand(B, 1, H) if isotropic else rand(B, 1, H, K)
    r, mu = rand(B, 1, H) + 0.1, torch.full((H,), float(K), device=CUDA)
    S, u = rand(B, H, K, K) - 0.5, rand(*((B, H) if isotropic else (B, H, K))) + 0.1
    fn = fused_recurrent.fused_recurrent_isotropic_kdn if isotropic else fused_recurrent.fused_recurrent_diagonal_kdn
    o_ref, (S_ref, u_ref) = fn(q, k, v, gate, omega, r, mu, (S, u))
    S_in = S.clone()
    o, (S_out, u_out) = fn(q, k, v, gate, omega, r, mu, (S_in, u), inplace=True)
    assert S_out.data_ptr() == S_in.data_ptr()
    for a, b in ((o, o_ref), (S_out, S_ref), (u_out, u_ref)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contiguous FP32"):
        fn(q, k, v, gate, omega, r, mu, (S.to(torch.bfloat16), u), inplace=True)
