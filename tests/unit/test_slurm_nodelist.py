"""hpctrain.slurm.nodelist: Slurm hostlist expansion, tested on tables of real formats
(checked against `scontrol show hostnames` in tests/test_slurm_jobs.py) and as properties."""
import pytest
from hypothesis import given, strategies as st

from hpctrain.slurm.nodelist import expand_nodelist, expand_tasks_per_node, first_node

# (SLURM_JOB_NODELIST, expected hosts) — formats seen on real clusters.
CASES = [
    ("node001", ["node001"]),
    ("node[001-004,010]", ["node001", "node002", "node003", "node004", "node010"]),
    ("gpu-a[1-2],gpu-b7", ["gpu-a1", "gpu-a2", "gpu-b7"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[9-10]", ["n9", "n10"]),
    ("n[1-010]", ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]),
    ("a,b,c", ["a", "b", "c"]),
    ("nid[00012-00013],login1", ["nid00012", "nid00013", "login1"]),
    ("jrc[0001,0450-0451]", ["jrc0001", "jrc0450", "jrc0451"]),
    ("cn[1,3,5]", ["cn1", "cn3", "cn5"]),
    ("x[1-2]y", ["x1y", "x2y"]),  # Slurm rejects text after the last bracket; we accept it
    # Slurm's own order for three groups (scontrol show hostnames): 2nd slowest, then 1st, 3rd fastest.
    ("r[1-2]n[1-2]g[0-1]", [f"r{r}n{n}g{g}" for n in (1, 2) for r in (1, 2) for g in (0, 1)]),
    ("a[1-2]b[1-2]c[1-2]d[1-2]", [f"a{a}b{b}c{c}d{d}" for c in (1, 2) for b in (1, 2) for a in (1, 2) for d in (1, 2)]),
    ("host.example.org", ["host.example.org"]),
    ("  node[1-2]\n", ["node1", "node2"]),  # stray whitespace around the value is tolerated
]


@pytest.mark.parametrize("text,hosts", CASES, ids=[c[0].strip() for c in CASES])
def test_expand_table(text, hosts):
    assert expand_nodelist(text) == hosts


BAD = [
    ("", "empty hostlist"),
    ("n[1-2", "unclosed"),
    ("n1-2]", "unmatched"),
    ("n[1[2]]", "nested"),
    ("n[]", "empty []"),
    ("n[3-1]", "backwards"),
    ("n[a-b]", "bad range"),
    ("n[1-2-3]", "bad range"),
    ("a,,b", "empty host name"),
    (",a", "empty host name"),
    ("[1-2]", "no name before"),
    ("a b", "whitespace"),
    ("n[0-99999999]", "more than"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[b[0] or "empty" for b in BAD])
def test_bad_hostlists_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        expand_nodelist(text)
    assert repr(text.strip()) in str(err.value) or text.strip() == ""


def test_first_node():
    assert first_node("gpu-a[3-4],gpu-b7") == "gpu-a3"


@pytest.mark.parametrize(
    "text,counts",
    [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3])],
)
def test_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(3)", "x", "2(x)", "-1"])
def test_tasks_per_node_bad(text):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(text)


@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True),
    lo=st.integers(0, 500),
    span=st.integers(0, 30),
    width=st.integers(1, 5),
)
def test_range_property(prefix, lo, span, width):
    """[lo-hi] gives hi-lo+1 distinct names, in order, padded to the width of lo."""
    lo_text = str(lo).zfill(width)
    hosts = expand_nodelist(f"{prefix}[{lo_text}-{lo + span}]")
    assert len(hosts) == span + 1 == len(set(hosts))
    assert hosts == [prefix + str(n).zfill(len(lo_text)) for n in range(lo, lo + span + 1)]


@given(st.lists(st.from_regex(r"[a-z]{1,4}[0-9]{0,3}", fullmatch=True), min_size=1, max_size=8))
def test_plain_comma_lists_round_trip(names):
    assert expand_nodelist(",".join(names)) == names
