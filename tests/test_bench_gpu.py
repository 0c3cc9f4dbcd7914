"""The GPU check (`python -m kvjax.bench.gpu`) runs end to end on CPU in its `--small` mode:
every step writes its section of the page, and the methods it is given run with the
default kernels and with xla (HeadKV's included: the check gives the random model head
scores). What it measures on CPU says nothing about a GPU; that it runs is what is tested."""

from __future__ import annotations

from kvjax.bench import gpu


def test_small_check_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu.main(["--small", "--no-tests", "--methods", "snapkv,critical_headkv",
                     "--contexts", "256", "--out", str(out)]) == 0
    text = out.read_text()
    for section in ("## Every method", "## Kernels", "## Roofline"):
        assert section in text, section
    rows = [line for line in text.splitlines() if line.startswith("| 256 |")]
    methods = {(r.split("|")[2].strip(), r.split("|")[3].strip()): r.split("|")[4].strip()
               for r in rows if len(r.split("|")) > 5}
    for kind in ("auto", "xla"):
        for name in ("snapkv", "critical_headkv"):
            assert methods.get((kind, name)) == "ok", (kind, name, methods)
