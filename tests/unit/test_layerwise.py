"""The layer-wise sending rule (prefill_node/layerwise.py): it picks whichever mode its own
measurements say makes the KV ready sooner, so a CPU box whose sender competes with the
forward pass stops streaming, and a GPU box (no competition) streams long prompts."""

from __future__ import annotations

from pdserve.prefill_node.layerwise import EXPLORE, WARM, BatchTails, LayerwiseRule

MB = 1 << 20


def feed(rule: LayerwiseRule, plain_s_per_token: float, slowdown: float, tails: tuple) -> None:
    """Warm the rule with a machine's behaviour: `tails` = (layer-wise, at end) s per byte."""
    for _ in range(WARM):
        rule.observe_pass(1000, 1000 * plain_s_per_token, layerwise=False)
        rule.observe_pass(1000, 1000 * plain_s_per_token * slowdown, layerwise=True)
        rule.observe_tail(10 * MB, 10 * MB * tails[0], layerwise=True)
        rule.observe_tail(10 * MB, 10 * MB * tails[1], layerwise=False)


def measured(rule: LayerwiseRule, tokens: int, kv_bytes: int) -> bool:
    while True:  # skip the exploration batches
        d = rule.decide(tokens, kv_bytes)
        if d.why == "measured":
            return d.layerwise


def test_forced_and_threshold_modes_ignore_measurements():
    for mode, want in (("on", True), ("off", False)):
        rule = LayerwiseRule(mode)
        feed(rule, 1e-3, 5.0, (1e-9, 1e-9))
        assert rule.decide(10, 1).layerwise is want
    rule = LayerwiseRule("threshold", min_tokens=768)
    assert rule.decide(767, MB).why == "threshold" and not rule.decide(767, MB).layerwise
    assert rule.decide(768, MB).layerwise


def test_a_cold_rule_measures_both_modes_before_trusting_either():
    rule = LayerwiseRule("auto", min_tokens=768)
    first = rule.decide(4000, 100 * MB)
    assert not first.layerwise and first.why == "explore"  # at-end side first
    assert rule.decide(100, MB).why == "threshold"
    for _ in range(WARM):
        rule.observe_pass(1000, 1.0, layerwise=False)
        rule.observe_tail(MB, 0.01, layerwise=False)
    d = rule.decide(4000, 100 * MB)
    assert d.layerwise and d.why == "explore"  # now the layer-wise side


def test_a_cpu_whose_sender_slows_the_pass_stops_streaming():
    # 2-core figures of benchmarks/overlap.py at 4,000 tokens (184 MB of KV): the pass
    # (16.9 s) slows ~9.5 % while sending, which costs more than the 191 ms serial transfer
    # it hides (1.7 ms stays exposed)
    rule = LayerwiseRule("auto")
    feed(rule, 4.2e-3, 1.095, (0.0017 / 184 / MB, 0.191 / 184 / MB))
    assert measured(rule, 4000, 184 * MB) is False
    lw, end = rule.predict(4000, 184 * MB)
    assert lw > end


def test_a_gpu_whose_pass_is_not_slowed_streams_long_prompts():
    # the pass is as fast with the sender running (the copy engines move the KV); serial
    # transfer at 25 GB/s, layer-wise only the last of 32 layers stays exposed
    rule = LayerwiseRule("auto")
    feed(rule, 5e-5, 1.0, (4e-5 / 32 / MB, 4e-5 / MB))
    assert measured(rule, 8000, 1000 * MB) is True
    lw, end = rule.predict(8000, 1000 * MB)
    assert end - lw > 0.03


def test_a_warm_rule_still_tries_the_losing_mode_now_and_then():
    rule = LayerwiseRule("auto")
    feed(rule, 4.2e-3, 1.095, (0.0017 / 184 / MB, 0.191 / 184 / MB))
    decisions = [rule.decide(4000, 184 * MB) for _ in range(4 * EXPLORE)]
    explored = [d for d in decisions if d.why == "explore"]
    assert len(explored) == 4 and all(d.layerwise for d in explored)
    assert all(not d.layerwise for d in decisions if d.why == "measured")


def test_a_batch_gives_one_tail_sample_its_bytes_over_its_last_acknowledgement():
    # four equal transfers sent at the end share the link: the k-th is acknowledged k
    # seconds after the pass. The batch's KV was ready 4 s after the pass, 1 s per 10 MB:
    # a sample per transfer would have said 2.5x that (k / 10 MB each, averaged)
    rule = LayerwiseRule("auto")
    tails = BatchTails(rule)
    batch = tails.open(ended=100.0)
    for k in range(4):
        tails.add(batch, f"r{k}", 10 * MB, layerwise=False)
    tails.acked("r0", 101.0)  # acknowledged before the pass's last KvDone went out
    tails.seal(batch)
    for k in (1, 2, 3):
        assert rule.tail[False].count == 0
        tails.acked(f"r{k}", 101.0 + k)
    assert rule.tail[False].count == 1 and rule.tail[True].count == 0
    assert rule.tail[False].value == 4.0 / (40 * MB)
    assert not tails.of  # nothing kept


def test_a_lost_transfer_or_mixed_modes_give_no_tail_sample():
    rule = LayerwiseRule("auto")
    tails = BatchTails(rule)
    lost = tails.open(ended=0.0)
    tails.add(lost, "a", MB, layerwise=True)
    tails.add(lost, "b", MB, layerwise=True)
    tails.seal(lost)
    tails.acked("a", 1.0)
    tails.lost("b")  # refused: the time says nothing of the link
    mixed = tails.open(ended=0.0)
    tails.add(mixed, "c", MB, layerwise=True)
    tails.add(mixed, "d", MB, layerwise=False)  # `--layerwise threshold`
    tails.seal(mixed)
    tails.acked("c", 1.0)
    tails.acked("d", 1.0)
    assert rule.tail[True].count == rule.tail[False].count == 0 and not tails.of
    empty = tails.open(ended=0.0)  # a pass whose requests all ended at their first token
    tails.seal(empty)
    assert rule.tail[True].count == rule.tail[False].count == 0
