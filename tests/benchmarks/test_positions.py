"""benchmarks.positions: the hardware-independent position counts of padded and packed steps."""

from benchmarks import positions


def test_counts_follow_the_layouts():
    sdpa, eager = positions.qwen_config("sdpa"), positions.qwen_config("eager")
    for draw in range(3):
        c = positions.count("lognormal", 8, 1024, 64, sdpa, draw)
        assert c["real"] <= c["body_packed"] <= c["body_padded"]
        assert c["head_packed"] == c["real"] - 8 * 64 <= c["head_padded"]
        assert c["rows"] * c["width"] == c["body_packed"]
        narrow = positions.count("lognormal", 8, 1024, 64, eager, draw)
        assert narrow["width"] == -(-(64 + c["head_padded"] // 8) // 16) * 16  # longest, to 16
        # the rule prices narrow rows too, and a wider row costs more per position, so the
        # chosen rows never hold more positions than the narrow ones
        assert c["body_packed"] <= narrow["body_packed"]
    fixed = positions.count("fixed", 8, 1024, 64, sdpa)
    assert fixed["body_packed"] == fixed["body_padded"] == fixed["real"] == 8 * 1088
    rows = positions.main(["--draws", "1"])
    assert [r["profile"] for r in rows] == ["lognormal", "lognormal", "fixed"]
