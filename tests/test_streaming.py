# streaming.py: the sink + window cache against references it must reproduce -- dense
# attention when nothing is evicted, keys recomputed at their re-assigned positions, a
# dense forward with a band mask (sliding window), a fresh forward over the kept tokens
# (one-layer model, where cached K/V depend only on token and position) -- and its bounds,
# its refusals and its CLI.
import json
import os

import pytest
import torch

import streaming
from model import GPT, apply_rope, get_config
from core.errors import UserError
from core.runtime import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp_model(**overrides):
    """tiny (block 64, 2 layers, vocab 512) with large random weights, so attention is peaked
    and forgetting a token (or mis-rotating a key) moves the logits far beyond 1e-5."""
    return GPT(get_config("tiny", init_std=0.1, **overrides), seed=0).eval()


def stream_of(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def streamed_logits(model, tokens, sinks, window, chunk=1, prefill=False):
    cache = streaming.SinkWindowCache(model.config, sinks, window)
    with torch.no_grad():
        parts = [logits[0] for _, logits in streaming.feed(model, cache, tokens[None], chunk,
                                                           prefill)]
    return torch.cat(parts), cache


@pytest.mark.parametrize("chunk", [1, 3])
def test_cache_never_exceeds_sinks_plus_window(chunk):
    model = sharp_model()
    tokens = stream_of(40)
    cache = streaming.SinkWindowCache(model.config, 2, 6)
    lengths = []
    with torch.no_grad():
        for _, _ in streaming.feed(model, cache, tokens[None], chunk):
            lengths.append(cache.length)
            assert cache.k.shape[3] == cache.v.shape[3] == 8     # storage is fixed too
    assert max(lengths) == 8 and all(n <= 8 for n in lengths)
    assert cache.seen == 40 and cache.evicted == 32
    assert streaming.stream_losses(model, tokens, 2, 6, chunk)[1]["peak_tokens"] == 8


@pytest.mark.parametrize("sinks,chunk,prefill", [(4, 1, False), (0, 5, False), (4, 1, True)])
def test_window_covering_the_stream_equals_dense(sinks, chunk, prefill):
    model = sharp_model()
    tokens = stream_of(40)
    with torch.no_grad():
        dense, _ = model(tokens[None])
    got, cache = streamed_logits(model, tokens, sinks, 64 - sinks, chunk, prefill)
    assert cache.evicted == 0
    torch.testing.assert_close(got, dense[0], atol=1e-5, rtol=0)


def test_rerotated_keys_equal_keys_recomputed_at_new_positions():
    """Layer 0's keys are a function of (token, position) only, so the keys the cache holds
    after many slides can be recomputed from the kept tokens at positions 0..capacity-1."""
    model = sharp_model()
    tokens = stream_of(50)
    _, cache = streamed_logits(model, tokens, 2, 10)
    kept = torch.cat([tokens[:2], tokens[-10:]])
    attn = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(kept[None]))
    with torch.no_grad():
        k = attn.wk(x).view(1, 12, -1, attn.head_dim).transpose(1, 2)
        v = attn.wv(x).view(1, 12, -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.rope(torch.arange(12))
        want = apply_rope(k, cos, sin)
        at_stream_positions = apply_rope(k, *model.rope(torch.cat(
            [torch.arange(2), torch.arange(40, 50)])))
    torch.testing.assert_close(cache.k[0, :, :, :12], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.v[0, :, :, :12], v, atol=1e-6, rtol=0)
    # the test can fail: keys left at their stream positions are far off
    assert (cache.k[0, :, :, :12] - at_stream_positions).abs().max() > 1e-2


def test_sliding_window_equals_band_mask_forward():
    """sinks = 0: each token attends to itself and the 7 before it. RoPE scores depend only
    on the distance between positions, so re-assigned positions inside the cache give what
    a dense forward at the stream's own positions gives under a band mask."""
    model = sharp_model()
    tokens = stream_of(48)
    i = torch.arange(48)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)
    with torch.no_grad():
        want, _ = model(tokens[None], mask=band)
        dense, _ = model(tokens[None])
    got, _ = streamed_logits(model, tokens, 0, 8)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)
    assert (got[8:] - dense[0, 8:]).abs().max() > 1e-2          # the window did forget


@pytest.mark.parametrize("sinks", [0, 2])
def test_one_layer_stream_equals_recompute_of_the_kept_tokens(sinks):
    """With one layer, a cached K/V depends only on its token and position, so the streamed
    logit at t equals a fresh forward over [the sinks] + [the last window tokens up to t] at
    positions 0..capacity-1: StreamingLLM's rule, computed the textbook way."""
    model = sharp_model(n_layer=1)
    window = 6
    tokens = stream_of(30)
    got, _ = streamed_logits(model, tokens, sinks, window)
    with torch.no_grad():
        dense, _ = model(tokens[None])
        for t in range(sinks + window, 30):
            kept = torch.cat([tokens[:sinks], tokens[t - window + 1:t + 1]])
            want, _ = model(kept[None])
            torch.testing.assert_close(got[t], want[0, -1], atol=1e-5, rtol=0)
    assert (got[sinks + window:] - dense[0, sinks + window:]).abs().max() > 1e-2


def test_stream_generate_equals_generate_while_nothing_is_evicted():
    model = sharp_model()
    prompt = stream_of(10).tolist()
    want = model.generate(prompt, 30, temperature=0)
    got, cache = streaming.stream_generate(model, prompt, 30, 4, 60, temperature=0)
    assert got == want and cache.evicted == 0
    # and it goes on past block_size (64) with the cache bounded
    long, cache = streaming.stream_generate(model, prompt, 150, 4, 28, temperature=0)
    assert len(long) == 150 and cache.length == 32 and cache.seen == 10 + 149


def test_dense_recompute_reference_is_a_fresh_forward_per_position():
    model = sharp_model()
    tokens = stream_of(30)
    losses, _ = streaming.recompute_losses(model, tokens, 8, batch=4)
    assert losses.shape == (29,)
    with torch.no_grad():
        for t in (3, 7, 8, 20, 28):
            lo = max(0, t - 7)
            logits, _ = model(tokens[None, lo:t + 1])
            want = torch.nn.functional.cross_entropy(logits[0, -1], tokens[t + 1])
            torch.testing.assert_close(losses[t], want, atol=1e-5, rtol=0)
    with_bos, _ = streaming.recompute_losses(model, tokens, 8, batch=4, bos=7)
    torch.testing.assert_close(with_bos[:8], losses[:8])        # one shared first forward
    with torch.no_grad():
        row = torch.cat([torch.tensor([7]), tokens[14:21]])      # [bos] + 7 tokens up to 20
        logits, _ = model(row[None])
    want = torch.nn.functional.cross_entropy(logits[0, -1], tokens[21])
    torch.testing.assert_close(with_bos[20], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sinks,window,match", [
    (0, 0, "window must be at least 1"), (4, 4, "fewer than the window"),
    (5, 4, "fewer than the window"), (-1, 8, "sinks must be >= 0"),
    (4, 61, "exceeds the model's context")])
def test_bad_policy_is_one_user_error(sinks, window, match):
    with pytest.raises(UserError, match=match):
        streaming.SinkWindowCache(get_config("tiny"), sinks, window)


def test_misuse_is_refused():
    mla = get_config("tiny", kv_lora_rank=16, qk_rope_head_dim=4)
    with pytest.raises(UserError, match="MLA"):
        streaming.SinkWindowCache(mla, 2, 8)
    model = sharp_model()
    cache = streaming.SinkWindowCache(model.config, 2, 8)
    with pytest.raises(UserError, match="chunk must be in 1..window"):
        next(streaming.feed(model, cache, stream_of(20)[None], chunk=9))
    with pytest.raises(UserError, match="make_room"), torch.no_grad():
        model(stream_of(11)[None], positions=torch.arange(11), cache=cache)


@pytest.mark.parametrize("argv,match", [
    (["measure", "--windw", "3"], "unknown flag --windw"),
    (["measure", "--window", "0"], "window must be at least 1"),
    (["generate", "--sinks", "8", "--window", "8"], "fewer than the window"),
    (["measure", "--tokens", "0"], "--tokens must be at least 1")])
def test_cli_bad_input_exits_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(streaming.main, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and match in err


def test_measure_cli_end_to_end(text_file, tmp_path):
    argv = ["measure", "--checkpoint", "none", "--data", text_file, "--train-steps", "2",
            "--tokens", "150", "--sinks", "2", "--window", "30", "--out", str(tmp_path),
            "--plots", str(tmp_path)]
    losses, stats = streaming.main(argv)
    names = list(losses)
    assert all(v.shape == (149,) for v in losses.values())
    for name in names[1:3]:      # nothing evicted in the first 32 positions: all agree
        torch.testing.assert_close(losses[name][:32], losses[names[0]][:32], atol=1e-4,
                                   rtol=0)
        assert stats[name]["peak_tokens"] == 32
    saved = json.load(open(tmp_path / "measure_sinks2_window30.json"))
    assert saved["window"] == 30 and len(saved["losses"][names[2]]) == 149
    svg = open(os.path.join(tmp_path, "streaming_loss_sinks2_window30.svg")).read()
    assert svg.count("<polyline") == 4          # + the window without its 2 sinks
    excess = open(os.path.join(tmp_path, "streaming_excess_sinks2_window30.svg")).read()
    assert excess.count("<polyline") == 3       # each cache policy minus the reference
    again, _ = streaming.main(argv)             # the fresh model is reused, not retrained
    assert len(list(tmp_path.glob("fresh-tiny-2steps-seed0-*.pt"))) == 1
    torch.testing.assert_close(again[names[2]], losses[names[2]])


def test_sink_probe_matches_uniform_attention_of_an_untrained_model():
    """init_std 0.02: scores ≈ 0, attention ≈ uniform, so the weight on the first 4 keys is
    what uniform attention gives (≈ 14% here; 1/16 of it if the first keys were not summed,
    more if the early queries were counted); the probe is still a working cache."""
    model = GPT(get_config("tiny"), seed=0).eval()
    tokens = stream_of(128)
    mass, uniform = streaming.sink_mass(model, tokens, 4, windows=2)
    assert len(mass) == 2 and all(abs(m - uniform) < 1e-4 for m in mass)
    sharp = sharp_model()
    probe = streaming.SinkProbe(sharp.config, 64, 4)
    with torch.no_grad():
        got, _ = sharp(tokens[None, :64], cache=probe)
        want, _ = sharp(tokens[None, :64])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
