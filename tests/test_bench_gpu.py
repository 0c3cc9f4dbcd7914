"""The GPU check (`python -m kvjax.bench.gpu`) runs end to end on CPU in its `--small` mode:
every step writes its section of the page, and the methods it is given run with the
default kernels and with xla (HeadKV's included: the check gives the random model head
scores). What it measures on CPU says nothing about a GPU; that it runs is what is tested."""

from __future__ import annotations

import pytest

from kvjax.bench import gpu


@pytest.mark.slow  # 65 s on 2 cores; run it (-m slow) before a session's GPU call
def test_small_check_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    both = "snapkv,critical_headkv"
    assert gpu.main(["--small", "--steps", "methods,roofline,kernels,xla", "--methods", both,
                     "--xla-methods", "snapkv", "--contexts", "256", "--roofline-cases",
                     "256x1", "--roofline-layers", "4", "--out", str(out)]) == 0
    text = out.read_text()
    for section in ("## Every method", "## Kernels", "## Roofline"):
        assert section in text, section
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| 1 | 256 |")]
    status = {(c[2], c[3]): c[4] for c in cells if len(c) == 10}
    for kind, name in (("auto", "snapkv"), ("auto", "critical_headkv"), ("xla", "snapkv")):
        assert status.get((kind, name)) == "ok", (kind, name, status)
    # the roofline rows: each (method, decode layer loop) of `ROOFLINE_VARIANTS` ran
    roof = {(c[3], c[4]): c[5] for c in cells if len(c) == 11}
    assert roof == {v: "ok" for v in gpu.ROOFLINE_VARIANTS}, roof
    # a second run appends its rows to the first's, each row naming its run
    assert gpu.main(["--small", "--steps", "methods", "--methods", "snapkv", "--contexts",
                     "256", "--append", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Run 1:" in text and "Run 2:" in text
    assert "| 2 | 256 | auto | snapkv | ok |" in text and "| 1 | 256 | auto | snapkv | ok |" in text


@pytest.mark.parametrize("case", ["1024x1:scan:no_such_method", "1024x1:sideways", "1024:scan",
                                  "1024x1:scan/0", "1024x1:scan/x"])
def test_profile_cases_refuse_what_they_cannot_run(case, tmp_path, capsys):
    """`--profile-cases CONTEXTxBATCH:LAYOUT[/UNROLL][:METHOD]`: a bad case is one usage error that
    names it, before any model is built."""
    with pytest.raises(SystemExit) as e:
        gpu.main(["--small", "--steps", "profile", "--profile-cases", case,
                  "--out", str(tmp_path / "gpu.md")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert repr(case) in err and "LAYOUT[/UNROLL][:METHOD]" in err, err
