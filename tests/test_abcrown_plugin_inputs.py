"""The user's files as α,β-CROWN loads them (``abcrown_plugin/inputs.py``): a VNN-LIB 2.0 spec handed
to α,β-CROWN in its own structure, exactly what its reader gives for the 1.x form of the property."""

from __future__ import annotations

import pytest
from plugin_support import BENCH, VENDOR, needs_abcrown, python

pytest.importorskip("vnnlib", reason="the reference VNN-LIB 2.0 parser (pip install vnnlib)")

SAME = """
import shutil, sys, numpy as np
from complete_verifier_ext.abcrown_plugin import bridge, inputs, locate
from complete_verifier_ext.spec import load_vnnlib
bridge.import_abcrown(locate.find({vendor!r}))
import arguments, read_vnnlib
arguments.Config.parse_config([], verbose=False)
for prop in ("prop_1", "prop_2"):
    one = shutil.copy({one!r} + f"/{{prop}}.vnnlib", {tmp!r})  # its reader writes a cache beside the file
    theirs = read_vnnlib.read_vnnlib(one)
    ours = inputs.abcrown_form(load_vnnlib({two!r} + f"/{{prop}}.vnnlib", cache=False))
    assert len(theirs) == len(ours) == 1
    (box_t, specs_t), (box_o, specs_o) = theirs[0], ours[0]
    exact = load_vnnlib(one, cache=False).regions[0]  # ours on the 1.x file: the file's numbers
    box = np.array(box_o)
    assert np.array_equal(box[:, 0], exact.lower) and np.array_equal(box[:, 1], exact.upper)
    # theirs recomputes each bound as mean +- half-width (its rescale path), one float64 ulp off
    assert np.allclose(np.array(box_t, dtype=float), np.array(box_o), rtol=0, atol=1e-15), (box_t, box_o)
    assert len(specs_t) == len(specs_o)
    for (C_t, d_t), (C_o, d_o) in zip(specs_t, specs_o):
        assert C_o.dtype == np.float64 and np.array_equal(C_t, C_o) and np.array_equal(d_t, d_o), (C_t, C_o)
print("same")
"""


@needs_abcrown
@pytest.mark.skipif(not (BENCH / "vnnlib2").is_dir(), reason="../shared/benchmarks/vnnlib2 is absent")
def test_a_2_0_spec_reaches_abcrown_as_its_reader_gives_the_1x_form(tmp_path):
    """ACAS Xu properties 1 and 2: the 2.0 files, read by ours and handed over, are what α,β-CROWN's
    own reader makes of the 1.x files: ``C`` and ``d`` bit for bit (float64), the box the file's numbers
    exactly (α,β-CROWN's own reading of the 1.x box lands within one float64 ulp of them)."""
    code = SAME.format(vendor=str(VENDOR), one=str(BENCH / "acasxu" / "vnnlib"),
                       two=str(BENCH / "vnnlib2" / "acasxu" / "vnnlib"), tmp=str(tmp_path))  # fmt: skip
    out = python(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("same"), out.stderr[-3000:]


def test_a_file_that_is_not_text_is_left_to_abcrowns_reader(tmp_path):
    """Bytes that are not UTF-8, or a broken gzip: not a 2.0 spec to us, so α,β-CROWN's reader (and the
    one-line error around it) sees the file as before."""
    from complete_verifier_ext.abcrown_plugin import inputs

    (tmp_path / "bad.vnnlib").write_bytes(b"(declare-const X_0 Real)\n\xff\xfe\n")
    (tmp_path / "bad.vnnlib.gz").write_bytes(b"\x1f\x8b not really gzip")
    (tmp_path / "cut.vnnlib.gz").write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\xff" * 20)
    for name in ("bad.vnnlib", "bad.vnnlib.gz", "cut.vnnlib.gz"):
        assert inputs.spec2(str(tmp_path / name)) is None
