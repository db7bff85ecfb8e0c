"""Hypothesis strategies for FQNs and patterns, shared by the pattern and plan tests."""

from __future__ import annotations

from hypothesis import strategies as st

SEGMENTS = [
    "layers",
    "mlp",
    "experts",
    "0",
    "1",
    "7",
    "10",
    "12",
    "127",
    "128",
    "007",
    "down_proj",
    "gate",
    "a",
    "ab",
    "b",
    "x_y",
    "ü",
    "blöck",
    "-",
    "a*b",
]

names = st.one_of(
    st.just(""),
    st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=5).map(".".join),
)


def segment_pattern(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from([s for s in SEGMENTS if "*" not in s]))
    form = draw(st.integers(0, 11))
    if form == 0:
        return base
    if form == 1:
        return base[: draw(st.integers(0, len(base)))] + "*"
    if form == 2:
        return "*" + base[draw(st.integers(0, len(base))) :]
    if form == 3:
        k = draw(st.integers(0, max(0, len(base) - 1)))
        return base[:k] + "?" + base[k + 1 :]
    if form == 4:
        return draw(st.sampled_from(["[a-m]*", "[!0-9]*", "[0-9]", "[0-9][0-9]*", "[!a]b", r"[\-_x]*", "[.a]*"]))
    if form == 5:
        return draw(st.sampled_from(["<0-15>", "<0-127>", "<10-99>", "<7-7>", "<0-0>", "<100-200>"]))
    if form == 6:
        return "**"
    if form == 7:
        return "{" + ",".join(draw(st.lists(st.sampled_from(SEGMENTS[:12]), min_size=1, max_size=3))) + "}"
    if form == 8:
        return draw(st.sampled_from(["{mlp,experts.<0-9>}", "{a,b.{x_y,mlp}}", "{a,{b,ab}*}", "{layers.*,gate}", "e{xperts,}"]))
    if form == 9:
        return "*"
    if form == 10:
        return base + "<0-9>"
    return draw(st.sampled_from(["<1-12>*", "?*", "*_*", "{0,1}<0-9>", r"a\*b", r"a\*?"]))


@st.composite
def patterns(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 12))
    if kind == 0:
        return draw(st.sampled_from(["", "**", "re:layers\\.[0-9]+\\..*", "re:.*proj", "re:(a|b)(\\.x_y)?", "re:", "re:a*"]))
    count = draw(st.integers(1, 4))
    segments = [segment_pattern(draw) for _ in range(count)]
    # `**` twice in a row is allowed; glue is always a dot.
    return ".".join(segments)
