"""Tests for the VNN-LIB reader in :mod:`complete_verifier_ext.spec`."""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from complete_verifier_ext.spec import Clause, Clauses, Region, Spec, SpecError, load_vnnlib
from complete_verifier_ext.spec import load as spec_module


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the disk cache into tmp_path and start every test with an empty in-process cache."""
    cache_home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    monkeypatch.setattr(spec_module, "_MEMORY", spec_module._MemoryCache(8))
    return cache_home


def declarations(n_inputs: int, n_outputs: int) -> str:
    lines = [f"(declare-const X_{i} Real)" for i in range(n_inputs)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_outputs)]
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, body: str, n_inputs: int = 2, n_outputs: int = 3, name: str = "p.vnnlib") -> Path:
    """Write a spec file made of declarations followed by ``body``."""
    path = tmp_path / name
    path.write_text(declarations(n_inputs, n_outputs) + body)
    return path


def line_of(path: Path, needle: str) -> int:
    """1-based number of the first line of ``path`` containing ``needle``."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")


BOX = "(assert (>= X_0 -1))\n(assert (<= X_0 1))\n(assert (>= X_1 0.5))\n(assert (<= X_1 2.5e0))\n"


def rows(clause: Clause) -> list[tuple[list[float], float]]:
    return [(list(c), float(d)) for c, d in zip(clause.C, clause.d, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Well-formed specs
# ---------------------------------------------------------------------------------------------------------


def test_box_and_single_clause(tmp_path: Path) -> None:
    spec = load_vnnlib(write(tmp_path, BOX + "(assert (<= Y_0 Y_1))\n"), cache=False)
    assert isinstance(spec, Spec)
    assert (spec.n_inputs, spec.n_outputs) == (2, 3)
    assert spec.path == str((tmp_path / "p.vnnlib").resolve())
    (region,) = spec.regions
    assert isinstance(region, Region)
    np.testing.assert_array_equal(region.lower, [-1.0, 0.5])
    np.testing.assert_array_equal(region.upper, [1.0, 2.5])
    (clause,) = region.clauses
    assert clause.C.dtype == np.float64 and clause.d.dtype == np.float64
    assert rows(clause) == [([1.0, -1.0, 0.0], 0.0)]


def test_several_clauses_keep_file_order_and_multi_row_clause(tmp_path: Path) -> None:
    body = BOX + "(assert (or (and (>= Y_0 Y_2)) (and (>= Y_1 Y_2) (<= Y_1 3)) (and (<= Y_2 -0.5))))\n"
    (region,) = load_vnnlib(write(tmp_path, body), cache=False).regions
    assert [rows(c) for c in region.clauses] == [
        [([-1.0, 0.0, 1.0], 0.0)],
        [([0.0, -1.0, 1.0], 0.0), ([0.0, 1.0, 0.0], 3.0)],
        [([0.0, 0.0, 1.0], -0.5)],
    ]
    stacked = Clauses.of(region.clauses)
    assert stacked.C.shape == (4, 3) and stacked.d.shape == (4,) and stacked.n_clauses == 3
    assert stacked.owner.tolist() == [0, 1, 1, 2]
    # the margin of a clause is the max over its rows of C y - d; <= 0: it holds
    y = torch.tensor([[0.0, 4.0, 1.0]], dtype=torch.float64)
    assert stacked.point_margins(y).tolist() == [[1.0, 1.0, 1.5]]
    assert stacked.violated(torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)).tolist() == [True]


def test_a_nan_or_infinite_bound_proves_no_clause_and_a_nan_output_is_no_counterexample(tmp_path: Path):
    body = BOX + "(assert (or (and (>= Y_0 Y_2)) (and (>= Y_1 Y_2) (<= Y_1 3)) (and (<= Y_2 -0.5))))\n"
    (region,) = load_vnnlib(write(tmp_path, body), cache=False).regions
    clauses = Clauses.of(region.clauses)
    nan, inf = float("nan"), float("inf")
    lb = torch.tensor([[nan, 5.0, 5.0, 5.0], [-inf, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    m = clauses.margins(lb)  # rows 0 | 1, 2 | 3 are the clauses
    assert m[0, 0] == -inf and m[1, 0] == -inf  # not proven: -inf, never NaN
    assert (m[:, 1:] > 0).all() and (m[2] > 0).all() and not torch.isnan(m).any()
    assert (clauses.bound(lb[:1]) > 0).tolist() == [False, True, True]
    y = torch.tensor([[nan, 0.0, 0.0], [inf, 0.0, inf]], dtype=torch.float64)
    pm = clauses.point_margins(y)
    assert pm[0, 0] == inf and pm[1, 0] == inf  # NaN (and inf - inf) outputs hold no clause


def test_separate_y_asserts_form_one_clause(tmp_path: Path) -> None:
    body = BOX + "(assert (<= Y_0 1))\n(assert (and (>= Y_1 2) (> Y_2 Y_0)))\n"
    (region,) = load_vnnlib(write(tmp_path, body), cache=False).regions
    (clause,) = region.clauses
    assert rows(clause) == [([1.0, 0.0, 0.0], 1.0), ([0.0, -1.0, 0.0], -2.0), ([1.0, 0.0, -1.0], 0.0)]


def test_several_input_regions_grouped_by_box(tmp_path: Path) -> None:
    body = (
        "(assert (or\n"
        "  (and (>= X_0 0) (<= X_0 1) (>= X_1 0) (<= X_1 1) (<= Y_0 Y_1))\n"
        "  (and (>= X_0 2) (<= X_0 3) (>= X_1 0) (<= X_1 1) (<= Y_1 Y_2))\n"
        "  (and (<= X_0 1) (>= X_0 0) (<= X_1 1) (>= X_1 0) (<= Y_2 Y_0) (<= Y_2 5))\n"
        "))\n"
    )
    spec = load_vnnlib(write(tmp_path, body), cache=False)
    assert len(spec.regions) == 2
    first, second = spec.regions
    np.testing.assert_array_equal(first.lower, [0.0, 0.0])
    np.testing.assert_array_equal(first.upper, [1.0, 1.0])
    assert [rows(c) for c in first.clauses] == [
        [([1.0, -1.0, 0.0], 0.0)],
        [([-1.0, 0.0, 1.0], 0.0), ([0.0, 0.0, 1.0], 5.0)],
    ]
    np.testing.assert_array_equal(second.lower, [2.0, 0.0])
    np.testing.assert_array_equal(second.upper, [3.0, 1.0])
    assert [rows(c) for c in second.clauses] == [[([0.0, 1.0, -1.0], 0.0)]]
    assert sum(len(r.clauses) for r in spec.regions) == 3


def test_global_bounds_combine_with_disjunct_bounds(tmp_path: Path) -> None:
    body = (
        "(assert (>= X_1 -2))\n(assert (<= X_1 2))\n"
        "(assert (or (and (>= X_0 0) (<= X_0 1) (<= X_1 1.5) (<= Y_0 0))\n"
        "            (and (>= X_0 5) (<= X_0 6) (>= Y_1 0))))\n"
    )
    first, second = load_vnnlib(write(tmp_path, body), cache=False).regions
    np.testing.assert_array_equal(first.lower, [0.0, -2.0])
    np.testing.assert_array_equal(first.upper, [1.0, 1.5])
    np.testing.assert_array_equal(second.lower, [5.0, -2.0])
    np.testing.assert_array_equal(second.upper, [6.0, 2.0])


def test_reversed_operands_and_number_formats(tmp_path: Path) -> None:
    body = (
        "(assert (>= 0.3 X_0))\n(assert (<= -1.5e-1 X_0))\n"
        "(assert (> X_1 (- 2)))\n(assert (< X_1 +.25E+1))\n"
        "(assert (<= Y_0 1e3))\n"
    )
    (region,) = load_vnnlib(write(tmp_path, body), cache=False).regions
    np.testing.assert_allclose(region.lower, [-0.15, -2.0])
    np.testing.assert_allclose(region.upper, [0.3, 2.5])
    assert rows(region.clauses[0]) == [([1.0, 0.0, 0.0], 1000.0)]


def test_linear_expressions(tmp_path: Path) -> None:
    body = (
        BOX + "(assert (or\n"
        "  (and (<= (+ Y_0 (* 2 Y_1) (- Y_2) 3) (- Y_2 1.5 (* -0.5 Y_0))))\n"
        "  (and (>= (* 2 (+ Y_1 1) 0.5) (- 4)))\n"
        "))\n"
    )
    first, second = load_vnnlib(write(tmp_path, body), cache=False).regions[0].clauses
    # y0 + 2 y1 - y2 + 3 <= y2 - 1.5 + 0.5 y0  ->  0.5 y0 + 2 y1 - 2 y2 <= -4.5
    assert rows(first) == [([0.5, 2.0, -2.0], -4.5)]
    # (y1 + 1) >= -4  ->  -y1 <= 5
    assert rows(second) == [([0.0, -1.0, 0.0], 5.0)]


def test_equality_gives_two_rows(tmp_path: Path) -> None:
    body = "(assert (= X_0 0.5))\n(assert (>= X_1 0))\n(assert (<= X_1 1))\n(assert (= Y_0 (+ Y_1 2)))\n"
    (region,) = load_vnnlib(write(tmp_path, body), cache=False).regions
    np.testing.assert_array_equal(region.lower, [0.5, 0.0])
    np.testing.assert_array_equal(region.upper, [0.5, 1.0])
    assert rows(region.clauses[0]) == [([1.0, -1.0, 0.0], 2.0), ([-1.0, 1.0, 0.0], -2.0)]


def test_comments_and_housekeeping_commands(tmp_path: Path) -> None:
    body = (
        "; comment with ( unbalanced ) ) parens\n" + BOX + "(assert (<= Y_0 Y_1)) ; trailing (\n(check-sat)\n"
    )
    spec = load_vnnlib(write(tmp_path, body), cache=False)
    assert len(spec.regions[0].clauses) == 1


def test_gzip_file(tmp_path: Path) -> None:
    plain = write(tmp_path, BOX + "(assert (or (and (<= Y_0 Y_1)) (and (<= Y_2 Y_1))))\n")
    packed = tmp_path / "p.vnnlib.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_vnnlib(plain, cache=False), load_vnnlib(packed, cache=False)
    assert b.path.endswith(".gz")
    np.testing.assert_array_equal(a.regions[0].lower, b.regions[0].lower)
    assert [rows(c) for c in a.regions[0].clauses] == [rows(c) for c in b.regions[0].clauses]


def test_arrays_are_read_only(tmp_path: Path) -> None:
    region = load_vnnlib(write(tmp_path, BOX + "(assert (<= Y_0 Y_1))\n"), cache=False).regions[0]
    with pytest.raises(ValueError):
        region.lower[0] = 5.0
    with pytest.raises(ValueError):
        region.clauses[0].C[0, 0] = 5.0


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def assert_spec_error(path: Path, line: int, pattern: str) -> None:
    with pytest.raises(SpecError) as info:
        load_vnnlib(path, cache=False)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert re.search(pattern, message), message


def test_spec_error_is_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_error_mixed_x_and_y(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 1))\n(assert (<= X_0 Y_1))\n")
    assert_spec_error(path, line_of(path, "(<= X_0 Y_1)"), "mixes input")


def test_error_missing_lower_bound(tmp_path: Path) -> None:
    path = write(
        tmp_path, "(assert (>= X_0 0))\n(assert (<= X_0 1))\n(assert (<= X_1 1))\n(assert (<= Y_0 1))\n"
    )
    assert_spec_error(path, line_of(path, "declare-const X_1"), r"X_1 has no lower bound")


def test_error_missing_upper_bound_in_one_region(tmp_path: Path) -> None:
    body = (
        "(assert (>= X_1 0))\n(assert (<= X_1 1))\n"
        "(assert (or (and (>= X_0 0) (<= X_0 1) (<= Y_0 0)) (and (>= X_0 0) (<= Y_1 0))))\n"
    )
    path = write(tmp_path, body)
    assert_spec_error(path, line_of(path, "declare-const X_0"), r"X_0 has no upper bound")


def test_error_no_output_constraints(tmp_path: Path) -> None:
    path = write(tmp_path, BOX)
    assert_spec_error(path, line_of(path, "(<= X_1 2.5e0)"), "no output")


def test_error_undeclared_variable(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (or (and (<= Y_0 Y_1))\n (and (<= Y_7 Y_1))))\n")
    assert_spec_error(path, line_of(path, "Y_7"), "undeclared variable 'Y_7'")


def test_error_unexpected_closing_parenthesis(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 Y_1)))\n(assert (<= Y_1 2))\n")
    assert_spec_error(path, line_of(path, "(<= Y_0 Y_1)"), "unbalanced parentheses")


def test_error_unclosed_parenthesis(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 Y_1)\n(assert (<= Y_1 2))\n")
    assert_spec_error(path, line_of(path, "(<= Y_0 Y_1)"), "never closed")


def test_error_unknown_operator(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (or (and (<= Y_0 Y_1))\n (not (<= Y_2 Y_1))))\n")
    assert_spec_error(path, line_of(path, "(not"), "unknown operator 'not'")


def test_error_unknown_arithmetic_operator(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "\n(assert (<= (max Y_0 Y_1) 0))\n")
    assert_spec_error(path, line_of(path, "(max"), "unknown arithmetic operator 'max'")


def test_error_malformed_number(tmp_path: Path) -> None:
    path = write(tmp_path, "(assert (>= X_0 0))\n(assert (<= X_0 1.2.3))\n" + BOX + "(assert (<= Y_0 1))\n")
    assert_spec_error(path, line_of(path, "1.2.3"), "malformed number '1.2.3'")


def test_error_nonlinear_product(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= (* Y_0 Y_1) 0))\n")
    assert_spec_error(path, line_of(path, "(* Y_0 Y_1)"), "non-linear")


def test_error_input_atom_with_two_variables(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= X_0 X_1))\n(assert (<= Y_0 1))\n")
    assert_spec_error(path, line_of(path, "(<= X_0 X_1)"), "single input variable")


def test_error_empty_box(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (or (and (>= X_0 3) (<= Y_0 1)) (and (<= Y_1 1))))\n")
    assert_spec_error(path, line_of(path, "(>= X_0 3)"), "X_0 has empty bounds")


# ---------------------------------------------------------------------------------------------------------
# Caching
# ---------------------------------------------------------------------------------------------------------


def test_memory_and_disk_cache(tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, BOX + "(assert (or (and (<= Y_0 Y_1) (<= Y_2 4)) (and (<= Y_2 Y_1))))\n")
    first = load_vnnlib(path)
    assert load_vnnlib(path) is first
    cache_files = list((isolated_cache / "complete_verifier_ext" / "specs").iterdir())
    assert len(cache_files) == 1 and cache_files[0].suffix == ".npz"

    monkeypatch.setattr(spec_module, "_MEMORY", spec_module._MemoryCache(8))
    monkeypatch.setattr(spec_module, "build_spec", None)  # must come from disk now
    from_disk = load_vnnlib(path)
    assert from_disk is not first
    assert (from_disk.path, from_disk.n_inputs, from_disk.n_outputs) == (first.path, 2, 3)
    np.testing.assert_array_equal(from_disk.regions[0].upper, first.regions[0].upper)
    assert [rows(c) for c in from_disk.regions[0].clauses] == [rows(c) for c in first.regions[0].clauses]
    assert not from_disk.regions[0].clauses[0].C.flags.writeable


def test_cache_invalidated_by_modification(tmp_path: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 1))\n")
    assert load_vnnlib(path).regions[0].clauses[0].d[0] == 1.0
    path.write_text(path.read_text().replace("(<= Y_0 1)", "(<= Y_0 7)"))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert load_vnnlib(path).regions[0].clauses[0].d[0] == 7.0


def test_cache_false_bypasses_caches(tmp_path: Path, isolated_cache: Path) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 1))\n")
    assert load_vnnlib(path, cache=False) is not load_vnnlib(path, cache=False)
    assert not isolated_cache.exists()


def test_unwritable_cache_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    spec = load_vnnlib(write(tmp_path, BOX + "(assert (<= Y_0 1))\n"))
    assert spec.n_inputs == 2


def test_corrupt_cache_entry_is_reparsed(tmp_path: Path, isolated_cache: Path, monkeypatch) -> None:
    path = write(tmp_path, BOX + "(assert (<= Y_0 1))\n")
    load_vnnlib(path)
    (entry,) = (isolated_cache / "complete_verifier_ext" / "specs").iterdir()
    entry.write_bytes(b"garbage")
    monkeypatch.setattr(spec_module, "_MEMORY", spec_module._MemoryCache(8))
    assert load_vnnlib(path).regions[0].clauses[0].d[0] == 1.0


# ---------------------------------------------------------------------------------------------------------
# Real benchmark files
# ---------------------------------------------------------------------------------------------------------

_BOUND_RE = re.compile(r"\(assert \((<=|>=) X_(\d+) ([-+.\deE]+)\)\)")


def expected_box(path: Path, n_inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent reading of the simple one-bound-per-assert box used by the benchmark files."""
    lower, upper = np.full(n_inputs, np.nan), np.full(n_inputs, np.nan)
    for op, index, value in _BOUND_RE.findall(path.read_text()):
        (upper if op == "<=" else lower)[int(index)] = float(value)
    return lower, upper


def test_mnist_prop_0(shared_dir: Path) -> None:
    path = shared_dir / "benchmarks" / "mnist_fc" / "vnnlib" / "prop_0_0.03.vnnlib"
    spec = load_vnnlib(path, cache=False)
    assert (spec.n_inputs, spec.n_outputs, len(spec.regions)) == (784, 10, 1)
    (region,) = spec.regions
    lower, upper = expected_box(path, 784)
    np.testing.assert_array_equal(region.lower, lower)
    np.testing.assert_array_equal(region.upper, upper)
    assert len(region.clauses) == 9
    others = [0, 1, 2, 3, 5, 6, 7, 8, 9]
    for clause, other in zip(region.clauses, others, strict=True):
        expected = np.zeros(10)
        expected[4], expected[other] = 1.0, -1.0  # (>= Y_other Y_4)  ->  Y_4 - Y_other <= 0
        assert clause.C.shape == (1, 10)
        np.testing.assert_array_equal(clause.C[0], expected)
        np.testing.assert_array_equal(clause.d, [0.0])


@pytest.mark.parametrize("bench_name", ["mnist_fc", "oval21", "sri_resnet_a"])
def test_benchmark_files_parse(shared_dir: Path, bench_name: str) -> None:
    files = sorted((shared_dir / "benchmarks" / bench_name / "vnnlib").glob("*.vnnlib"))
    if not files:
        pytest.skip(f"no vnnlib files for {bench_name}")
    for path in files[:3]:
        spec = load_vnnlib(path, cache=False)
        assert spec.n_outputs == 10 and len(spec.regions) == 1
        assert len(spec.regions[0].clauses) == 9
        lower, upper = expected_box(path, spec.n_inputs)
        np.testing.assert_array_equal(spec.regions[0].lower, lower)
        np.testing.assert_array_equal(spec.regions[0].upper, upper)


def test_cifar_spec_parses(shared_dir: Path) -> None:
    """A 3072-input oval21 spec (its parse time is a benchmark matter, not a test's)."""
    files = sorted((shared_dir / "benchmarks" / "oval21" / "vnnlib").glob("*.vnnlib"))
    if not files:
        pytest.skip("no oval21 vnnlib files")
    spec = load_vnnlib(files[0], cache=False)
    assert spec.n_inputs == 3072 and len(spec.regions) == 1
    assert (spec.regions[0].lower <= spec.regions[0].upper).all()


def test_a_file_that_is_not_text_is_one_line_naming_it(tmp_path):
    """Bytes that are not UTF-8, or a broken gzip, are the user's mistake: a SpecError, not a traceback."""
    cases = {
        "bad.vnnlib": (b"(declare-const X_0 Real)\n\xff\xfe\n", "not a UTF-8 text file"),
        "bad.vnnlib.gz": (b"\x1f\x8b not really gzip", "not a readable gzip file"),
        "cut.vnnlib.gz": (
            b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\xff" * 20,
            "not a readable gzip file",
        ),
    }
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SpecError, match=words) as e:
            load_vnnlib(tmp_path / name, cache=False)
        assert str(e.value).startswith(str(tmp_path / name)) and "\n" not in str(e.value)
