"""minidist.planner with experts (minidist.planner_moe): parameter counts against the papers'
(DeepSeek-V3 671B / 37B, Mixtral 46.7B / 12.9B), one expert of top-1 against the dense model it
equals, expert state divided by ep exactly, the all-to-all and gradient bytes against their closed
forms, the roofline's E/k batch by hand, the rules, and `plan --model deepseek-v3`."""
import pytest

from minidist import planner, planner_moe
from minidist.cli import main
from minidist.planner import Cluster, GiB, Layout, ModelSpec

# A GPT whose MLP is 8 experts of width 96, top-2, the first layer dense: l = 4, h = 64, a = 8, V = 96, s = 32.
DENSE = ModelSpec("tiny", layers=4, hidden=64, heads=8, vocab=96, seq_len=32)
MOE = ModelSpec("tiny-moe", layers=4, hidden=64, heads=8, vocab=96, seq_len=32, n_expert=8, top_k=2, expert_ffn=96,
                dense_layers=1)
DEEPSEEK, MIXTRAL = planner.MODELS["deepseek-v3"], planner.MODELS["mixtral-8x7b"]
EXPERT = 2 * 64 * 96 + 96 + 64  # one GPT MLP of width 96 with biases: 12,448


def test_dense_presets_have_no_experts_and_active_equals_total():
    for m in planner.MODELS.values():
        if m.n_expert:
            continue
        assert m.active_parameters == m.parameters
        layout = Layout(1, 1, 1)
        assert "experts" not in planner.memory(m, layout, 128)
        assert "ep" not in planner.step_time(m, layout, Cluster(1), 1, 128)
        with pytest.raises(ValueError, match="needs a model with experts"):
            planner.check_layout(m, Layout(2, 1, 1, ep=2), 128)


def test_one_expert_of_top_1_is_the_dense_model_plus_its_router():
    one = ModelSpec("tiny-1", 4, 64, 8, 96, 32, n_expert=1, top_k=1)  # expert width = ffn = 4h
    assert one.parameters == DENSE.parameters + 4 * 64  # a router of E h = 64 per layer
    assert one.active_parameters == one.parameters
    layout = Layout(2, 2, 1, zero_stage=1)
    dense, moe = (planner.memory(m, layout, 32, 8) for m in (DENSE, one))
    assert moe["activations"] == dense["activations"]
    assert moe["parameters"] - dense["parameters"] == 2 * 2 * 64  # 2 layers' routers on the stage, 2 bytes each
    assert planner.model_flops(one, 8) - planner.model_flops(DENSE, 8) == 8 * 32 * 6 * 4 * 64


def test_counts_by_hand():
    assert planner_moe.expert_parameters(MOE) == EXPERT
    split, replicated = MOE.layer_parameters()
    attention = 4 * 64 * 64 + 3 * 64
    assert split == attention + 64 * 256 + 256 * 64 + 256 and replicated == 4 * 64 + 2 * 64
    moe_layer = attention + 4 * 64 + 8 * 64 + 64 + 8 * EXPERT  # + norms, router, attention's output bias, experts
    embeddings = 96 * 64 + 32 * 64
    assert MOE.parameters == (split + replicated) + 3 * moe_layer + embeddings + 2 * 64
    assert MOE.parameters - MOE.active_parameters == 3 * 6 * EXPERT  # 6 of 8 experts unused in 3 MoE layers


def test_published_totals_and_active_parameters():
    # DeepSeek-V3 report section 4.2: "671B total parameters, of which 37B are activated for each token"
    assert DEEPSEEK.parameters == pytest.approx(671e9, rel=0.01)
    assert DEEPSEEK.active_parameters == pytest.approx(37e9, rel=0.02)
    # Mixtral 8x7B: 46.7B total, 12.9B active (Mistral AI)
    assert MIXTRAL.parameters == pytest.approx(46.7e9, rel=0.01)
    assert MIXTRAL.active_parameters == pytest.approx(12.9e9, rel=0.01)
    # MLA by hand from config_671B.json: wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert DEEPSEEK.attention_split() == mla == 187_107_328


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_state_divides_by_ep_exactly(zero):
    # dp = 8, pp = 2: stage 1 holds layers 2, 3 (both MoE); 8 experts over ep ranks; ZeRO over dp / ep replicas
    base = None
    for ep in (1, 2, 4, 8):
        mem = planner.memory(MOE, Layout(8, 2, 1, zero_stage=zero, ep=ep), 32, 16, stage=1)
        experts = 2 * (8 // ep) * EXPERT  # parameters on one GPU
        r = 8 // ep
        expect = (2 * (experts // r if zero >= 3 else experts) + 2 * (experts // r if zero >= 2 else experts)
                  + 12 * (experts // r if zero >= 1 else experts))
        assert mem["experts"] == expect
        rest = mem["parameters"] + mem["gradients"] + mem["optimizer"] - mem["experts"]
        base = rest if base is None else base
        assert rest == base  # the rest as for ep = 1
    assert planner.memory(MOE, Layout(8, 2, 1, ep=8), 32, 16, stage=1)["experts"] * 8 == \
        planner.memory(MOE, Layout(8, 2, 1, ep=1), 32, 16, stage=1)["experts"]


@pytest.mark.parametrize("ep, recompute, passes", [(2, "none", 4), (4, "selective", 4), (8, "full", 6)])
def test_all_to_all_bytes_are_the_closed_form(ep, recompute, passes):
    layout = Layout(8, 2, 1, micro_batch=2, recompute=recompute, ep=ep)
    messages, nbytes = planner_moe.all_to_all_bytes(MOE, layout, 32, 64)
    microbatches = 64 // (8 * 2)
    count = 2 * microbatches * passes  # the busiest stage has 2 MoE layers
    per_rank = 2 * 2 * 2 * 32 * 64  # e k b s h bytes of one rank's dispatch
    assert messages == count * (ep - 1)
    assert nbytes == pytest.approx(count * (ep - 1) / ep * per_rank, rel=1e-15)
    cluster = Cluster(16, gpus_per_node=4)  # the ep group spans t p ep = 2 ep ranks: the network when > 4
    link = cluster.link(2 * ep)
    expect = messages * link.alpha + nbytes * link.beta
    assert planner.step_time(MOE, layout, cluster, 64)["ep"] == pytest.approx(expect)
    assert planner_moe.all_to_all_bytes(MOE, Layout(8, 2, 1), 32, 64) == (0.0, 0.0)


def test_expert_gradients_are_all_reduced_over_their_replicas_only():
    layout = Layout(8, 1, 1, ep=4)  # r = 2 replicas of each expert
    messages, nbytes = planner.dp_bytes(MOE, layout)
    rest = planner._stage_parameters(MOE, layout, 0)
    experts = 3 * 2 * EXPERT  # 3 MoE layers x 8 / 4 experts
    assert messages == 2 * 7 + 2 * 1
    assert nbytes == pytest.approx(2 * (2 * 7 / 8 * rest + 2 * 1 / 2 * experts))


def test_the_roofline_batch_is_e_over_k_times_the_ridge():
    # a machine of 300 TFLOP/s and 2 TB/s: ridge 150 FLOP/byte. 16-bit weights: an expert needs 150 tokens,
    # DeepSeek's E/k = 256/8 = 32 makes the batch 32 x 150 = 4800 tokens; float32 weights twice that
    assert planner_moe.compute_bound_batch(256, 8, 300e12, 2e12) == pytest.approx(4800)
    assert planner_moe.compute_bound_batch(256, 8, 300e12, 2e12, element_size=4) == pytest.approx(9600)
    assert planner_moe.compute_bound_batch(1, 1, 300e12, 2e12) == pytest.approx(150)
    assert planner_moe.compute_bound_batch(8, 2, 312e12, 1.5e12) == pytest.approx(4 * 208)
    with pytest.raises(ValueError, match="top_k"):
        planner_moe.compute_bound_batch(8, 9, 1.0, 1.0)


def test_layers_cut_unevenly_and_the_rules():
    counts = [planner_moe.layer_counts(DEEPSEEK, 16, i) for i in range(16)]
    assert counts[0] == (3, 1) and counts[1] == (0, 4) and counts[15] == (0, 3)
    assert sum(d + m for d, m in counts) == 61 and sum(d for d, _ in counts) == 3
    planner.check_layout(DEEPSEEK, Layout(128, 16, 1, ep=64), 4096, 15360)  # the published layout is legal
    for layout, words in ((Layout(8, 3, 1, ep=8, interleave=2), "does not divide the 4 layers"),
                          (Layout(16, 1, 1, ep=16), "more than the 8 routed experts"),
                          (Layout(4, 1, 2, ep=2), "expert tensor parallelism is not modelled")):
        with pytest.raises(ValueError, match=words):
            planner.check_layout(MOE, layout, 32)
    with pytest.raises(ValueError, match="must divide dp"):
        Layout(6, 1, 1, ep=4)
    with pytest.raises(ValueError, match="top_k"):
        ModelSpec("bad", 2, 64, 8, 96, 32, n_expert=4, top_k=5)


def test_deepseek_v3_what_if_on_its_published_layout():
    # report section 3.2: 16-way PP, 64-way EP over 8 nodes, ZeRO-1 DP, no TP, on 2048 H800s; section 4.2:
    # batch 15360 sequences of 4K; section 3.2.2: NVLink 160 GB/s, InfiniBand 50 GB/s. Attention without its
    # scores kept (selective: FlashAttention's memory), bf16 peak 989 TFLOP/s at the default mfu 0.5.
    cluster = Cluster(2048, peak_flops=989e12, nvlink_bandwidth=160e9, network_bandwidth=50e9)
    layout = Layout(128, 16, 1, zero_stage=1, recompute="selective", ep=64)
    mem = planner.memory(DEEPSEEK, layout, 4096, 15360)
    time = planner.step_time(DEEPSEEK, layout, cluster, 15360, 4096)
    assert mem["stage"] == 0 and 60 * GiB < mem["total"] < 90 * GiB  # the first stage, activations most of it
    # section 3.2.1: cross-node EP gives "a computation-to-communication ratio of approximately 1:1"
    assert 0.8 < time["compute"] / time["ep"] < 1.25
    assert time["dp"] < 0.05 * time["ep"]  # the experts' gradients cross 2 replicas only


def test_cli_plans_deepseek_v3(capsys):
    argv = ["plan", "--model", "deepseek-v3", "--gpus", "2048", "--gpu-memory", "80", "--global-batch", "15360",
            "--zero", "1", "--ep", "64", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "256 routed + 1 shared" in out and "37.552 B active" in out and "   ep " in out and " a2a " in out
    assert "best: " in out and "ep=64" in out
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "8", "--gpu-memory", "80"]) == 1
    assert "no layout of deepseek-v3 fits 8 GPU(s)" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2", "--gpus", "8", "--gpu-memory", "80", "--ep", "2"]) == 2
    assert "--ep: gpt2 is dense" in capsys.readouterr().err
